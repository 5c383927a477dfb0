//! The whole engine on a real HF checkpoint: `messages` rows rendered with the checkpoint's own
//! chat template, a KL term against a frozen reference (`beta = 0.04`), all three channels
//! (RLVR, hint self-distillation, replay of traces recorded from a real teacher checkpoint by
//! `record-traces`) and DAPO dynamic sampling, for 5 steps. Every step's samples are recorded
//! in the run dir, and the prompt ids there equal the ids of transformers' rendering.

use std::path::Path;

use composer_train::record_traces::{record_traces, RecordTracesOptions};
use composer_train::{run_train, TrainOptions};
use serde_json::{json, Value};

mod common;
use common::hf_fixture as fixture;
use common::train_metrics;

/// The rows' user messages; the first is the fixture's `chat_template_example`.
const QUESTIONS: [&str; 4] = [
    "What is 2+2?",
    "What is 3+4?",
    "Name a prime.",
    "Reverse 'abc'.",
];

/// Rows whose first one is the fixture's `chat_template_example` (transformers rendered it).
fn write_rows(path: &Path, reference_messages: &Value) {
    let mut text = format!(
        "{}\n",
        json!({"messages": reference_messages, "answer": "4"})
    );
    for q in &QUESTIONS[1..] {
        let row = json!({"messages": [{"role": "user", "content": q}], "answer": "x"});
        text.push_str(&format!("{row}\n"));
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn hf_messages_recipe_with_kl_all_channels_and_dynamic_sampling_trains_five_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("reference.json")).unwrap())
            .unwrap();
    let example = &reference["chat_template_example"];
    let data = tmp.path().join("rows.jsonl");
    write_rows(&data, &example["messages"]);

    // The random tiny checkpoint emits "A" in roughly half of its short completions: a regex
    // verifier on it gives groups with reward variance, so every channel has work to do.
    let traces = tmp.path().join("traces.jsonl");
    let recorded = record_traces(&RecordTracesOptions {
        model_dir: model.clone(),
        data: data.clone(),
        out: traces.clone(),
        append: false,
        teacher: None,
        num_samples: 4,
        top_k: 4,
        max_new_tokens: 6,
        temperature: 1.0,
        seed: 7,
        verifier: "regex".into(),
        verifier_pattern: Some("A".into()),
        device: "cpu".into(),
    })
    .unwrap();
    assert!(recorded.passed > 0, "{recorded:?}");

    let recipe = tmp.path().join("recipe.toml");
    std::fs::write(
        &recipe,
        format!(
            r#"
[model]
path = {model:?}

[data]
dataset = {data:?}
eval_dataset = {data:?}
verifiers = [{{ kind = "regex", weight = 1.0, pattern = "A" }}]

[rollout]
num_generations = 4
max_completion_length = 6
temperature = 1.0

[loss]
beta = 0.04
hint_weight = 1.0
replay_weight = 1.0
dynamic_sampling = true
max_dynamic_sampling_rounds = 4

[replay]
traces = [{traces:?}]

[optimizer]
lr = 1e-3

[train]
steps = 5
prompts_per_step = 2
seed = 11
eval_every = 0
checkpoint_every = 0
"#
        ),
    )
    .unwrap();
    let run = tmp.path().join("run");
    let out = run_train(&TrainOptions {
        recipe_path: Some(recipe),
        quiet: true,
        run_dir_override: Some(run.clone()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(out.steps_completed, 5);

    let lines = train_metrics(&run);
    assert_eq!(lines.len(), 5);
    let series = |key: &str| -> Vec<f64> {
        lines
            .iter()
            .map(|l| {
                l[key]
                    .as_f64()
                    .unwrap_or_else(|| panic!("{key} missing or not a number in {l}"))
            })
            .collect()
    };
    for key in ["kl", "loss/rlvr", "loss/hint", "loss/replay"] {
        let v = series(key);
        assert!(v.iter().all(|x| x.is_finite()), "{key}: {v:?}");
    }
    // π starts at π_ref (KL 0) and moves away from the frozen reference.
    let kl = series("kl");
    assert!(kl[0].abs() < 1e-6, "{kl:?}");
    assert!(kl[1..].iter().any(|k| *k > 0.0), "{kl:?}");
    // Hints were given and trained on; teacher traces were replayed.
    let hinted: u64 = lines
        .iter()
        .map(|l| l["hint/samples"].as_u64().unwrap())
        .sum();
    assert!(hinted > 0);
    assert!(series("loss/hint").iter().any(|x| *x != 0.0));
    assert!(series("loss/replay").iter().any(|x| *x != 0.0));
    for l in &lines {
        assert!(l["dynamic_sampling/rounds"].as_u64().unwrap() >= 1, "{l}");
    }

    // Token faithfulness audit: every step's samples are on disk, with ids and sampler
    // log-probs of equal length, and every prompt's ids are those of transformers' rendering.
    // transformers renders the reference row as below (reference.json); this template does the
    // same for every single-user-message row.
    let chatml = |q: &str| format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(
        chatml(example["messages"][0]["content"].as_str().unwrap()),
        example["rendered"].as_str().unwrap()
    );
    let tok = composer_model::Tokenizer::from_dir(&model).unwrap();
    let expected: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| tok.encode(&chatml(q)).unwrap())
        .collect();
    let mut samples = 0;
    for step in 1..=5 {
        let path = run.join(format!("samples/step_{step:06}.jsonl"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for line in text.lines() {
            let s: Value = serde_json::from_str(line).unwrap();
            assert_eq!(
                s["completion_ids"].as_array().unwrap().len(),
                s["sampler_logprobs"].as_array().unwrap().len()
            );
            assert!(s["reward"].is_number() && s["policy_version"].is_number());
            let prompt: Vec<u32> = serde_json::from_value(s["prompt_ids"].clone()).unwrap();
            assert!(expected.contains(&prompt), "step {step}: {prompt:?}");
            samples += 1;
        }
    }
    assert!(samples >= 5 * 2 * 4, "{samples}");
}

/// Records `rows` with teacher `model` (named `teacher`) into `out`; every completion passes
/// (the regex `.*`), so every recorded prompt is covered.
fn record(
    model: &Path,
    teacher: &str,
    rows: &Path,
    out: &Path,
    append: bool,
    top_k: usize,
) -> anyhow::Result<composer_train::record_traces::RecordSummary> {
    record_traces(&RecordTracesOptions {
        model_dir: model.to_path_buf(),
        data: rows.to_path_buf(),
        out: out.to_path_buf(),
        append,
        teacher: Some(teacher.into()),
        num_samples: 2,
        top_k,
        max_new_tokens: 4,
        temperature: 1.0,
        seed: 3,
        verifier: "regex".into(),
        verifier_pattern: Some(".*".into()),
        device: "cpu".into(),
    })
}

#[test]
fn two_teachers_recorded_into_one_store_are_replayed_and_uncovered_rows_are_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let student = fixture("qwen2-tiny");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(student.join("reference.json")).unwrap())
            .unwrap();
    let data = tmp.path().join("rows.jsonl");
    write_rows(&data, &reference["chat_template_example"]["messages"]);
    let lines: Vec<String> = std::fs::read_to_string(&data)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(lines.len(), 4);
    // Teacher A covers rows 1-2, teacher B (another family, same tokenizer) row 3; row 4 has
    // no trace.
    let rows_a = tmp.path().join("a.jsonl");
    std::fs::write(&rows_a, format!("{}\n{}\n", lines[0], lines[1])).unwrap();
    let rows_b = tmp.path().join("b.jsonl");
    std::fs::write(&rows_b, format!("{}\n", lines[2])).unwrap();
    let store = tmp.path().join("traces.jsonl");
    std::fs::write(&store, "stale content from an earlier run\n").unwrap();
    // Without --append the store is truncated (the stale line goes).
    let a = record(&student, "teacher-a", &rows_a, &store, false, 4).unwrap();
    let b = record(
        &fixture("llama-tiny"),
        "teacher-b",
        &rows_b,
        &store,
        true,
        4,
    )
    .unwrap();
    assert_eq!((a.traces, b.traces), (4, 2));
    let loaded = composer_loss::TraceStore::load(&store).unwrap();
    assert_eq!(loaded.traces.len(), 6);
    assert_eq!(loaded.teachers(), vec!["teacher-a", "teacher-b"]);

    // Appending with another tokenizer or another top-K is refused, naming the store.
    let other = tmp.path().join("other-tokenizer");
    std::fs::create_dir(&other).unwrap();
    for f in std::fs::read_dir(&student).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, other.join(f.file_name().unwrap())).unwrap();
    }
    let mut tj = std::fs::read_to_string(other.join("tokenizer.json")).unwrap();
    tj.push('\n');
    std::fs::write(other.join("tokenizer.json"), tj).unwrap();
    let e = format!(
        "{:#}",
        record(&other, "teacher-c", &rows_b, &store, true, 4).unwrap_err()
    );
    assert!(
        e.contains("--append") && e.contains("traces.jsonl") && e.contains("tokenizer"),
        "{e}"
    );
    let e = format!(
        "{:#}",
        record(&student, "teacher-c", &rows_b, &store, true, 3).unwrap_err()
    );
    assert!(e.contains("top-K 4") && e.contains("--top-k 3"), "{e}");
    let not_traces = tmp.path().join("not-traces.jsonl");
    std::fs::write(&not_traces, "{\"hello\": 1}\n").unwrap();
    let e = format!(
        "{:#}",
        record(&student, "teacher-c", &rows_b, &not_traces, true, 4).unwrap_err()
    );
    assert!(
        e.contains("not a trace store") && e.contains("line 1"),
        "{e}"
    );
    // A store whose traces carry no tokenizer fingerprint (scripted, older) is refused too.
    let unmarked = tmp.path().join("unmarked.jsonl");
    let mut t: Value = serde_json::to_value(&loaded.traces[0]).unwrap();
    t.as_object_mut().unwrap().remove("tokenizer");
    std::fs::write(&unmarked, format!("{t}\n")).unwrap();
    let e = format!(
        "{:#}",
        record(&student, "teacher-c", &rows_b, &unmarked, true, 4).unwrap_err()
    );
    assert!(e.contains("no tokenizer fingerprint"), "{e}");
    // The refused appends wrote nothing.
    assert_eq!(
        composer_loss::TraceStore::load(&store)
            .unwrap()
            .traces
            .len(),
        6
    );

    let recipe = tmp.path().join("recipe.toml");
    std::fs::write(
        &recipe,
        format!(
            r#"
[model]
path = {student:?}

[data]
dataset = {data:?}
verifiers = [{{ kind = "regex", weight = 1.0, pattern = "A" }}]

[rollout]
num_generations = 2
max_completion_length = 4

[loss]
replay_weight = 1.0

[replay]
traces = [{store:?}]
teacher_weights = [0.5]

[train]
steps = 1
prompts_per_step = 4
seed = 5
eval_every = 0
checkpoint_every = 0
"#
        ),
    )
    .unwrap();
    let run = tmp.path().join("run");
    run_train(&TrainOptions {
        recipe_path: Some(recipe),
        quiet: true,
        run_dir_override: Some(run.clone()),
        ..Default::default()
    })
    .unwrap();
    let lines = train_metrics(&run);
    assert_eq!(lines.len(), 1);
    let l = &lines[0];
    assert_eq!(l["replay/rows_without_trace"], 1, "{l}");
    let replay = l["loss/replay"].as_f64().unwrap();
    assert!(replay.is_finite() && replay != 0.0, "{l}");
}
