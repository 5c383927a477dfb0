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
