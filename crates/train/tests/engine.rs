//! One engine: HF checkpoints train through composer-model's decoder and KV-cached sampler
//! with their own chat template and EOS ids; checkpoints keep the loaded tokenizer side
//! byte-identical; the reference policy, DAPO dynamic sampling and the per-step sample
//! records.

use std::path::{Path, PathBuf};

use composer_train::trainer::open_session;
use composer_train::{run_train, TrainOptions};
use serde_json::Value;

mod common;
use common::hf_fixture as fixture;
use common::{tiny_model_and_task, train_metrics};

fn reference(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

fn opts(recipe: &Path, run_dir: &Path) -> TrainOptions {
    TrainOptions {
        recipe_path: Some(recipe.to_path_buf()),
        quiet: true,
        run_dir_override: Some(run_dir.to_path_buf()),
        ..Default::default()
    }
}

/// A one-step recipe on an HF checkpoint with a `messages` dataset.
fn hf_recipe(dir: &Path, model: &Path) -> PathBuf {
    let ex = &reference("qwen2-tiny")["chat_template_example"];
    let row = serde_json::json!({"messages": ex["messages"], "answer": "4"});
    let data = dir.join("data.jsonl");
    std::fs::write(&data, format!("{row}\n{row}\n")).unwrap();
    let recipe = dir.join("recipe.toml");
    std::fs::write(
        &recipe,
        format!(
            r#"
[model]
path = {model:?}

[data]
dataset = {data:?}
eval_dataset = {data:?}

[rollout]
num_generations = 2
max_completion_length = 4

[train]
steps = 1
prompts_per_step = 1
eval_every = 0
checkpoint_every = 1
"#
        ),
    )
    .unwrap();
    recipe
}

#[test]
fn messages_rows_use_the_checkpoints_chat_template() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    let recipe = hf_recipe(tmp.path(), &model);
    let s = open_session(&opts(&recipe, &tmp.path().join("run"))).unwrap();
    let rendered = reference("qwen2-tiny")["chat_template_example"]["rendered"]
        .as_str()
        .unwrap()
        .to_string();
    let tok = composer_model::Tokenizer::from_dir(&model).unwrap();
    let want = tok.encode(&rendered).unwrap();
    assert_eq!(s.train_rows[0].prompt, rendered);
    assert_eq!(s.encode(&s.train_rows[0].prompt).unwrap(), want);
    // The chat markers are single special tokens, not characters.
    assert!(want.len() < rendered.len() / 2, "{want:?}");
}

#[test]
fn every_eos_id_of_generation_config_stops_a_sample() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for e in std::fs::read_dir(fixture("qwen2-tiny")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), model.join(e.file_name())).unwrap();
    }
    let gen = model.join("generation_config.json");
    let mut g: Value = serde_json::from_str(&std::fs::read_to_string(&gen).unwrap()).unwrap();
    g["eos_token_id"] = serde_json::json!([2, 7]);
    std::fs::write(&gen, g.to_string()).unwrap();
    let recipe = hf_recipe(tmp.path(), &model);
    let s = open_session(&opts(&recipe, &tmp.path().join("run"))).unwrap();
    assert!(
        s.stop_ids.contains(&2) && s.stop_ids.contains(&7),
        "{:?}",
        s.stop_ids
    );
}

#[test]
fn hf_checkpoint_keeps_the_loaded_files_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    let recipe = hf_recipe(tmp.path(), &model);
    let run = tmp.path().join("run");
    let out = run_train(&opts(&recipe, &run)).unwrap();
    assert_eq!(out.steps_completed, 1);
    let ck = run.join("checkpoint");
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        assert_eq!(
            std::fs::read(model.join(name)).unwrap(),
            std::fs::read(ck.join(name)).unwrap(),
            "{name} differs from the loaded checkpoint's"
        );
    }
    assert!(!ck.join("reference.safetensors").exists());
    // config.json: only the dtype may change.
    let mut src: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let dst: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    src["dtype"] = serde_json::json!("float32");
    assert_eq!(src, dst);
    // The saved checkpoint loads back through composer-model.
    composer_model::Policy::load(&ck, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap();
    // The step's samples were recorded for audit.
    let samples = std::fs::read_to_string(run.join("samples/step_000001.jsonl")).unwrap();
    let lines: Vec<Value> = samples
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        assert_eq!(
            l["completion_ids"].as_array().unwrap().len(),
            l["sampler_logprobs"].as_array().unwrap().len()
        );
        assert_eq!(l["policy_version"], 0);
        assert!(l["reward"].is_number());
    }
}

fn small_recipe(dir: &Path, extra_loss: &str, train: &str) -> PathBuf {
    // All three channels on (as `all_channels_rollout!`), plus `extra_loss` keys of `[loss]`.
    let text = format!(
        r#"{}
[rollout]
num_generations = 4
max_completion_length = 3

[loss]
hint_weight = 1.0
replay_weight = 1.0
{extra_loss}
[loss.hint.template]
reprompt = "{{solution}}{{prompt}}"
solution = "[{{successful_previous_attempt}}]"
feedback = ""

{train}
[warmup]
steps = 20
batch_size = 16
hint_fraction = 0.3

[replay]
traces = ["builtin:scripted"]
"#,
        tiny_model_and_task!(),
    );
    let p = dir.join("recipe.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn kl_to_a_frozen_reference_and_dpo_against_it() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = small_recipe(
        tmp.path(),
        "beta = 0.05\nsync_ref_model = true\nref_model_sync_steps = 2\nref_model_mixup_alpha = 0.5\n",
        "[train]\nsteps = 4\nprompts_per_step = 4\nseed = 3\neval_every = 0\ncheckpoint_every = 2\n",
    );
    let run = tmp.path().join("run");
    run_train(&opts(&recipe, &run)).unwrap();
    let lines = train_metrics(&run);
    assert_eq!(lines.len(), 4);
    // Step 1 starts at π = π_ref: KL 0; later steps move away from the frozen reference.
    let kl: Vec<f64> = lines.iter().map(|l| l["kl"].as_f64().unwrap()).collect();
    assert!(kl[0].abs() < 1e-6, "{kl:?}");
    assert!(kl[1..].iter().any(|k| *k > 1e-7), "{kl:?}");
    // DPO against a frozen reference is not log 2 once the policy has moved.
    let dpo: Vec<f64> = lines
        .iter()
        .filter(|l| l["replay/dpo_pairs"].as_u64().unwrap() > 0)
        .map(|l| l["loss/replay_dpo"].as_f64().unwrap())
        .collect();
    assert!(!dpo.is_empty());
    assert!(
        dpo.iter()
            .any(|d| (d - std::f64::consts::LN_2).abs() > 1e-5),
        "{dpo:?}"
    );
    assert!(run.join("checkpoint/reference.safetensors").is_file());
}

/// A checkpoint's weights file as f64 vectors by name.
fn load_weights(path: &Path) -> std::collections::BTreeMap<String, Vec<f64>> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let v = t
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            (k, v)
        })
        .collect()
}

fn max_abs_diff(
    a: &std::collections::BTreeMap<String, Vec<f64>>,
    b: &std::collections::BTreeMap<String, Vec<f64>>,
) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .flat_map(|(k, x)| x.iter().zip(&b[k]).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f64::max)
}

#[test]
fn sync_ref_model_mixes_the_policy_into_the_reference_on_sync_steps_only() {
    // TRL's SyncRefModelCallback: every `ref_model_sync_steps` steps,
    // π_ref ← α·π + (1 − α)·π_ref; untouched on the other steps. Checked on the
    // checkpointed weights after steps 1 (no sync), 2 (sync) and 3 (no sync).
    let tmp = tempfile::tempdir().unwrap();
    let alpha = 0.3;
    let recipe = small_recipe(
        tmp.path(),
        &format!(
            "beta = 0.05\nsync_ref_model = true\nref_model_sync_steps = 2\nref_model_mixup_alpha = {alpha}\n"
        ),
        "[train]\nsteps = 3\nprompts_per_step = 4\nseed = 3\neval_every = 0\ncheckpoint_every = 1\n",
    );
    let run = tmp.path().join("run");
    let snapshot = || {
        let c = run.join("checkpoint");
        (
            load_weights(&c.join("model.safetensors")),
            load_weights(&c.join("reference.safetensors")),
        )
    };
    let mut o = opts(&recipe, &run);
    o.max_steps_override = Some(1);
    run_train(&o).unwrap();
    let (_, r1) = snapshot();
    let mut states = Vec::new();
    for stop in [2, 3] {
        let resumed = TrainOptions {
            resume: Some(run.clone()),
            quiet: true,
            max_steps_override: Some(stop),
            ..Default::default()
        };
        assert_eq!(run_train(&resumed).unwrap().steps_completed, stop);
        states.push(snapshot());
    }
    let (p2, r2) = &states[0];
    let (p3, r3) = &states[1];
    // Step 2 synced: r2 = α·p2 + (1 − α)·r1, and that moved the reference.
    let mixed: std::collections::BTreeMap<String, Vec<f64>> = r1
        .iter()
        .map(|(k, r)| {
            let p = &p2[k];
            (
                k.clone(),
                r.iter()
                    .zip(p)
                    .map(|(r, p)| alpha * p + (1.0 - alpha) * r)
                    .collect(),
            )
        })
        .collect();
    assert!(
        max_abs_diff(r2, &mixed) < 1e-6,
        "{}",
        max_abs_diff(r2, &mixed)
    );
    assert!(
        max_abs_diff(r2, &r1) > 1e-5,
        "the sync did not move the reference"
    );
    // Step 3 did not sync: the reference is unchanged though the policy moved.
    assert_eq!(max_abs_diff(r3, r2), 0.0);
    assert!(max_abs_diff(p3, p2) > 1e-6);
}

#[test]
fn dynamic_sampling_fills_the_batch_with_nonzero_variance_groups() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = small_recipe(
        tmp.path(),
        "dynamic_sampling = true\nmax_dynamic_sampling_rounds = 3\n",
        "[train]\nsteps = 3\nprompts_per_step = 4\nseed = 5\neval_every = 0\ncheckpoint_every = 0\n",
    );
    let run = tmp.path().join("run");
    run_train(&opts(&recipe, &run)).unwrap();
    for l in train_metrics(&run) {
        let dropped = l["dynamic_sampling/dropped_groups"].as_u64().unwrap();
        let rounds = l["dynamic_sampling/rounds"].as_u64().unwrap();
        assert!((1..=4).contains(&rounds), "{l}");
        let n = l["completions/lengths"].as_array().unwrap().len();
        if rounds < 4 {
            // The batch was filled: 4 groups of 4, none with zero reward variance.
            assert_eq!(n, 16, "{l}");
        }
        if dropped == 0 {
            assert_eq!(rounds, 1);
        }
        let reward_std = l["reward/std"].as_f64().unwrap();
        assert!(reward_std > 0.0 || n == 16, "{l}");
    }
}

#[test]
fn record_traces_writes_the_trace_store_format() {
    use composer_train::record_traces::{record_traces, RecordTracesOptions};
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    hf_recipe(tmp.path(), &model);
    let out = tmp.path().join("traces.jsonl");
    let summary = record_traces(&RecordTracesOptions {
        model_dir: model.clone(),
        data: tmp.path().join("data.jsonl"),
        out: out.clone(),
        append: false,
        teacher: None,
        num_samples: 2,
        top_k: 4,
        max_new_tokens: 5,
        temperature: 1.0,
        seed: 1,
        verifier: "numeric".into(),
        verifier_pattern: None,
        device: "cpu".into(),
    })
    .unwrap();
    assert_eq!(summary.traces, 4);
    let store = composer_loss::TraceStore::load(&out).unwrap();
    assert_eq!(store.traces.len(), 4);
    let rendered = reference("qwen2-tiny")["chat_template_example"]["rendered"]
        .as_str()
        .unwrap()
        .to_string();
    let tok = composer_model::Tokenizer::from_dir(&model).unwrap();
    for t in &store.traces {
        assert_eq!(t.teacher, "qwen2-tiny");
        assert_eq!(t.prompt_ids, tok.encode(&rendered).unwrap());
        assert_eq!(t.topk_ids.len(), t.completion_ids.len());
        assert!(t.topk_ids.iter().all(|k| k.len() == 4));
        // Sorted by decreasing log-prob, all ≤ 0.
        for lp in &t.topk_logprobs {
            assert!(lp.windows(2).all(|w| w[0] >= w[1]) && lp[0] <= 0.0);
        }
    }
}

/// Bad flags and bad rows are refused before the trace file is touched, naming the flag or the
/// row, and a recording that fails leaves the file as it was (also with `--append`).
#[test]
fn record_traces_refuses_bad_input_and_keeps_the_file() {
    use composer_train::record_traces::{record_traces, RecordTracesOptions};
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("qwen2-tiny");
    hf_recipe(tmp.path(), &model);
    let out = tmp.path().join("traces.jsonl");
    let good = RecordTracesOptions {
        model_dir: model.clone(),
        data: tmp.path().join("data.jsonl"),
        out: out.clone(),
        append: false,
        teacher: None,
        num_samples: 1,
        top_k: 2,
        max_new_tokens: 3,
        temperature: 1.0,
        seed: 1,
        verifier: "numeric".into(),
        verifier_pattern: None,
        device: "cpu".into(),
    };
    record_traces(&good).unwrap();
    let kept = std::fs::read(&out).unwrap();
    assert!(!kept.is_empty());
    // A dataset whose second row is empty.
    let rows = tmp.path().join("empty_row.jsonl");
    std::fs::write(
        &rows,
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"\", \"answer\": \"1\"}\n",
    )
    .unwrap();
    let cases: Vec<(RecordTracesOptions, &str)> = vec![
        (
            RecordTracesOptions {
                temperature: -1.0,
                ..good.clone()
            },
            "--temperature",
        ),
        (
            RecordTracesOptions {
                temperature: f64::NAN,
                ..good.clone()
            },
            "--temperature",
        ),
        (
            RecordTracesOptions {
                top_k: 0,
                ..good.clone()
            },
            "--top-k",
        ),
        (
            RecordTracesOptions {
                top_k: 1 << 30,
                ..good.clone()
            },
            "--top-k",
        ),
        (
            RecordTracesOptions {
                max_new_tokens: 0,
                ..good.clone()
            },
            "--max-new-tokens",
        ),
        (
            RecordTracesOptions {
                num_samples: 0,
                ..good.clone()
            },
            "--num-samples",
        ),
        (
            RecordTracesOptions {
                verifier: "regex".into(),
                ..good.clone()
            },
            "pattern",
        ),
        (
            RecordTracesOptions {
                verifier: "regex".into(),
                verifier_pattern: Some("(".into()),
                ..good.clone()
            },
            "pattern",
        ),
        (
            RecordTracesOptions {
                data: rows.clone(),
                ..good.clone()
            },
            "row 2",
        ),
        (
            RecordTracesOptions {
                data: rows.clone(),
                append: true,
                ..good.clone()
            },
            "row 2",
        ),
    ];
    for (o, named) in cases {
        let e = format!("{:#}", record_traces(&o).unwrap_err());
        assert!(e.contains(named), "expected {named:?} in: {e}");
        assert_eq!(std::fs::read(&out).unwrap(), kept, "{e}: the file changed");
    }
    // Appending adds to what is there.
    let before = composer_loss::TraceStore::load(&out).unwrap().traces.len();
    record_traces(&RecordTracesOptions {
        append: true,
        ..good.clone()
    })
    .unwrap();
    let after = composer_loss::TraceStore::load(&out).unwrap().traces.len();
    assert_eq!(after, 2 * before);
}

#[test]
fn every_step_logs_the_sampler_trainer_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = hf_recipe(tmp.path(), &fixture("qwen2-tiny"));
    let run = tmp.path().join("run");
    run_train(&opts(&recipe, &run)).unwrap();
    let lines = train_metrics(&run);
    assert!(!lines.is_empty());
    for l in &lines {
        let max_abs = l["mismatch/max_abs"].as_f64().expect("mismatch/max_abs");
        let kl = l["mismatch/kl"].as_f64().expect("mismatch/kl");
        // f32 KV-cached sampler vs the trainer's full forward: equal up to rounding.
        assert!((0.0..1e-3).contains(&max_abs), "{l}");
        assert!((0.0..1e-6).contains(&kl), "{l}");
    }
}

#[test]
fn deterministic_mode_makes_the_mismatch_exactly_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = hf_recipe(tmp.path(), &fixture("qwen2-tiny"));
    let text = std::fs::read_to_string(&recipe).unwrap();
    let text = text.replace(
        "[rollout]\n",
        "[rollout]\ndeterministic = true\ntemperature = 0.9\n",
    );
    std::fs::write(&recipe, text).unwrap();
    let run = tmp.path().join("run");
    run_train(&opts(&recipe, &run)).unwrap();
    let lines = train_metrics(&run);
    assert!(!lines.is_empty());
    for l in &lines {
        assert_eq!(l["mismatch/max_abs"].as_f64(), Some(0.0), "{l}");
        assert_eq!(l["mismatch/kl"].as_f64(), Some(0.0), "{l}");
    }
}

#[test]
fn rollout_scheduler_limits_change_when_samples_run_not_what_they_sample() {
    let run_with = |extra: &str| -> Result<Vec<Value>, String> {
        let tmp = tempfile::tempdir().unwrap();
        let recipe = hf_recipe(tmp.path(), &fixture("qwen2-tiny"));
        let text = std::fs::read_to_string(&recipe).unwrap();
        let text = text
            .replace("num_generations = 2", "num_generations = 5")
            .replace("max_completion_length = 4", "max_completion_length = 6")
            .replace("[rollout]\n", &format!("[rollout]\n{extra}"));
        std::fs::write(&recipe, text).unwrap();
        let run = tmp.path().join("run");
        run_train(&opts(&recipe, &run)).map_err(|e| format!("{e:#}"))?;
        Ok(train_metrics(&run))
    };
    let all_at_once = run_with("").unwrap();
    let limited = run_with(
        "max_running_sequences = 2\nkv_token_budget = 4000\nprefill_chunk = 3\nkv_block_size = 5\n",
    )
    .unwrap();
    assert_eq!(all_at_once.len(), limited.len());
    for (a, b) in all_at_once.iter().zip(&limited) {
        assert_eq!(
            a["completions/lengths"], b["completions/lengths"],
            "{a}\n{b}"
        );
        assert_eq!(a["reward/mean"], b["reward/mean"], "{a}\n{b}");
    }
    // The fixed-shape decode steps (`cuda_graphs`; no capture on the CPU) sample the same.
    let fixed = run_with("cuda_graphs = true\nmax_running_sequences = 3\n").unwrap();
    for (a, b) in all_at_once.iter().zip(&fixed) {
        assert_eq!(
            a["completions/lengths"], b["completions/lengths"],
            "{a}\n{b}"
        );
        assert_eq!(a["reward/mean"], b["reward/mean"], "{a}\n{b}");
    }
    // A budget that cannot hold one sample is refused naming the key.
    let err = run_with("kv_token_budget = 5\n").unwrap_err();
    assert!(err.contains("kv_token_budget"), "{err}");
    // So is a block size of 0.
    let err = run_with("kv_block_size = 0\n").unwrap_err();
    assert!(err.contains("[rollout] kv_block_size"), "{err}");
}

/// The lines of `RUN_DIR/samples/step_NNNNNN.jsonl`.
fn recorded_samples(run: &Path, step: usize) -> Vec<Value> {
    std::fs::read_to_string(run.join(format!("samples/step_{step:06}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

/// Trains `estimator` for 2 steps (`temperature` for the sampled rollouts) and checks the
/// losses are finite; returns the run dir.
fn two_steps(dir: &Path, estimator: &str, temperature: f64) -> PathBuf {
    let recipe = small_recipe(
        dir,
        &format!("estimator = \"{estimator}\"\n"),
        "[train]\nsteps = 2\nprompts_per_step = 4\nseed = 5\neval_every = 0\ncheckpoint_every = 0\n",
    );
    // A second verifier (the completion starts with a character of the answer) gives the
    // barely warmed-up model rewards that differ between prompts.
    let text = std::fs::read_to_string(&recipe)
        .unwrap()
        .replace(
            "max_completion_length = 3",
            &format!("max_completion_length = 3\ntemperature = {temperature}"),
        )
        .replace(
            "task = \"arithmetic\"",
            "task = \"arithmetic\"\nverifiers = [{ kind = \"numeric\" }, { kind = \"regex\", pattern = \"^[{answer}]\" }]",
        );
    std::fs::write(&recipe, text).unwrap();
    let run = dir.join(format!("run-{estimator}-{temperature}"));
    assert_eq!(run_train(&opts(&recipe, &run)).unwrap().steps_completed, 2);
    let lines = train_metrics(&run);
    assert_eq!(lines.len(), 2);
    for l in &lines {
        assert!(f(l, "loss/rlvr").is_finite(), "{l}");
        assert!(l.get("skipped").is_none(), "{l}");
    }
    run
}

#[test]
fn grpo_passk_trains_with_the_library_advantages() {
    let tmp = tempfile::tempdir().unwrap();
    let run = two_steps(tmp.path(), "grpo_passk", 1.0);
    let mut nonzero = 0;
    for step in 1..=2 {
        let s = recorded_samples(&run, step);
        let rewards: Vec<f64> = s.iter().map(|x| f(x, "reward")).collect();
        let recorded: Vec<f64> = s.iter().map(|x| f(x, "advantage")).collect();
        // The recipe's defaults: group std scaling, std ε 1e-4 (TRL's).
        let want = composer_loss::grpo_passk_advantages(&rewards, 4, true, 1e-4).unwrap();
        for (a, b) in recorded.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-9,
                "step {step}: {recorded:?} vs {want:?}"
            );
        }
        nonzero += recorded.iter().filter(|a| **a != 0.0).count();
    }
    assert!(
        nonzero > 0,
        "every advantage was 0: the test proves nothing"
    );
}

#[test]
fn remax_baseline_is_the_reward_of_the_greedy_completion() {
    let tmp = tempfile::tempdir().unwrap();
    // Sampled rollouts: advantage = reward − the baseline of the sample's prompt, the same
    // baseline for a prompt's whole group, and its mean is the logged metric.
    let run = two_steps(tmp.path(), "remax", 1.0);
    let lines = train_metrics(&run);
    for step in 1..=2 {
        let s = recorded_samples(&run, step);
        for x in &s {
            let want = f(x, "reward") - f(x, "remax_baseline");
            assert!((f(x, "advantage") - want).abs() <= 1e-9, "{x}");
        }
        for g in s.chunks(4) {
            assert!(g
                .iter()
                .all(|x| x["remax_baseline"] == g[0]["remax_baseline"]));
        }
        let mean = s.iter().map(|x| f(x, "remax_baseline")).sum::<f64>() / s.len() as f64;
        let logged = f(&lines[step - 1], "remax/baseline_reward");
        assert!((mean - logged).abs() <= 1e-9, "{mean} vs {logged}");
    }
    // Greedy rollouts (temperature 0): every sample is its prompt's greedy completion, so the
    // baseline is its own reward, prompt by prompt — with rewards that differ between prompts.
    let run = two_steps(tmp.path(), "remax", 0.0);
    let all: Vec<Value> = (1..=2).flat_map(|k| recorded_samples(&run, k)).collect();
    for x in &all {
        assert_eq!(f(x, "remax_baseline"), f(x, "reward"), "{x}");
        assert_eq!(f(x, "advantage"), 0.0, "{x}");
    }
    let rewards: Vec<f64> = all.iter().map(|x| f(x, "reward")).collect();
    assert!(
        rewards.iter().any(|r| *r > 0.0) && rewards.contains(&0.0),
        "rewards {rewards:?} do not tell prompts apart: the test proves nothing"
    );
}
