//! Shared by the trainer's integration tests.
#![allow(dead_code, unused_macros, unused_imports)]

/// The smallest useful policy (a 1-layer built-in model) and the 1-digit arithmetic task, as
/// recipe text; each test appends its own `[rollout]`, `[loss]`, `[train]`... sections with
/// `concat!(tiny_model_and_task!(), r#"..."#)`.
macro_rules! tiny_model_and_task {
    () => {
        r#"
[model.builtin_tiny]
hidden_size = 16
layers = 1
heads = 2
kv_heads = 1
intermediate_size = 32

[data]
task = "arithmetic"
eval_size = 10

[data.arithmetic]
digits = 1
"#
    };
}
pub(crate) use tiny_model_and_task;

/// Rollout and loss sections for the tiny task with all three channels on: 4 samples of at
/// most 3 tokens per prompt, hint and replay at weight 1, and a short hint template (the
/// successful peer's answer in brackets before the prompt).
macro_rules! all_channels_rollout {
    () => {
        r#"
[rollout]
num_generations = 4
max_completion_length = 3

[loss]
hint_weight = 1.0
replay_weight = 1.0

[loss.hint.template]
reprompt = "{solution}{prompt}"
solution = "[{successful_previous_attempt}]"
feedback = ""
"#
    };
}
pub(crate) use all_channels_rollout;

/// Trains `recipe` quietly into `run_dir` (no resume, no step limit override).
pub fn train_quietly(
    recipe: &std::path::Path,
    run_dir: &std::path::Path,
) -> anyhow::Result<composer_train::RunOutcome> {
    composer_train::run_train(&composer_train::TrainOptions {
        recipe_path: Some(recipe.to_path_buf()),
        quiet: true,
        run_dir_override: Some(run_dir.to_path_buf()),
        ..Default::default()
    })
}

/// The `kind = "train"` lines of a run's metrics.jsonl.
pub fn train_metrics(run_dir: &std::path::Path) -> Vec<serde_json::Value> {
    composer_telemetry::read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|l| l["kind"] == "train")
        .collect()
}

/// A tiny HF checkpoint from `../shared/fixtures/hf-tiny` (or `$COMPOSER_SHARED/fixtures`).
pub fn hf_fixture(name: &str) -> std::path::PathBuf {
    let shared = std::env::var("COMPOSER_SHARED")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared")
        });
    shared.join("fixtures/hf-tiny").join(name)
}
