//! Issue 16's CI-sized memory bound: one GRPO training step of a Qwen2-shaped model with
//! Qwen's vocabulary (V = 151,936; hidden 64, 2 layers, tied embeddings, the fixture's
//! tokenizer) on 64 completions × 256 tokens runs in under 3 GB peak RSS. f32 logits of that
//! batch alone would be 10 GB; the fused, chunked LM head keeps one chunk of them.
//!
//! A test binary of its own: the process's peak RSS (`VmHWM`) is this test's.

use std::path::Path;

use candle_core::Device;
use composer_model::{ModelConfig, Transformer};
use composer_train::{run_train, TrainOptions};
use serde_json::json;

mod common;
use common::{hf_fixture, train_metrics};

const QWEN_VOCAB: usize = 151_936;
const COMPLETION_TOKENS: usize = 256;
const PEAK_RSS_LIMIT_BYTES: u64 = 3_000_000_000;

/// A random Qwen2 checkpoint with the fixture's shape and tokenizer but Qwen's vocabulary.
fn write_model(dir: &Path) {
    let fixture = hf_fixture("qwen2-tiny");
    let mut cfg = ModelConfig::from_dir(&fixture).unwrap();
    cfg.vocab_size = QWEN_VOCAB;
    cfg.max_position_embeddings = 512;
    assert_eq!((cfg.hidden_size, cfg.num_hidden_layers), (64, 2));
    let (model, _) = Transformer::random_init(&cfg, 5, &Device::Cpu).unwrap();
    model.save_pretrained(dir).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
}

#[test]
fn grpo_step_with_qwen_vocabulary_and_64x256_tokens_stays_under_3_gb() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    write_model(&model);
    let data = tmp.path().join("rows.jsonl");
    let rows: String = (0..8)
        .map(|i| {
            let q = format!("What is {i}+{i}?");
            format!(
                "{}\n",
                json!({"messages": [{"role": "user", "content": q}], "answer": "x"})
            )
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
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
eval_size = 1
verifiers = [{{ kind = "regex", weight = 1.0, pattern = "A" }}]

[rollout]
num_generations = 8
max_completion_length = {COMPLETION_TOKENS}
temperature = 1.0

[loss]
hint_weight = 0.0
replay_weight = 0.0

[train]
steps = 1
prompts_per_step = 8
seed = 3
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
    assert_eq!(out.steps_completed, 1);
    let peak = composer_model::bench::peak_rss_bytes()
        .expect("peak RSS from /proc/self/status (this test needs Linux)");

    // The step really trained on ~64 × 256 completion tokens (a random model over 151,936
    // ids almost never samples EOS early).
    let lines = train_metrics(&run);
    assert_eq!(lines.len(), 1);
    let line = &lines[0];
    let mean_len = line["completions/mean_length"]
        .as_f64()
        .unwrap_or_else(|| panic!("no mean completion length in {line}"));
    assert!(
        mean_len > 0.95 * COMPLETION_TOKENS as f64,
        "completions were shorter than expected: {mean_len}"
    );
    assert!(line["grad_norm"].as_f64().unwrap().is_finite());
    eprintln!("peak RSS {:.2} GB", peak as f64 / 1e9);
    assert!(
        peak < PEAK_RSS_LIMIT_BYTES,
        "peak RSS {:.2} GB exceeds the 3 GB bound",
        peak as f64 / 1e9
    );
}
