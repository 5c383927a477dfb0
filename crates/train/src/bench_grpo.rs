//! `composer-rl bench grpo`: whole GRPO steps (rollout, reward, train, weight publish) of the
//! real trainer on an HF checkpoint, for a side-by-side comparison with TRL's `GRPOTrainer`
//! on the same checkpoint, prompts and shape (the CLI runs `tools/bench_grpo_trl.py`).
//!
//! composer-rl's side is an ordinary run of [`run_train`] with a recipe written for the
//! shape: `prompts` prompts × `group` samples per step, up to `new_tokens` new tokens, plain
//! GRPO-family loss (`loss_type`, no KL, no hint or replay channel), the same cheap reward as
//! TRL's side (odd completion length in characters), no eval, no intermediate checkpoint. Step times are the run's own `time/step_s` lines (the four walls beside them),
//! so the benchmark measures the code that trains.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use composer_telemetry::keys;
use serde::Serialize;

use crate::trainer::{run_train, TrainOptions};

/// The shape of the comparison.
#[derive(Debug, Clone, Serialize)]
pub struct GrpoStepBenchOptions {
    /// HF checkpoint directory (config.json, model.safetensors, tokenizer.json); with
    /// `shape`, the directory whose tokenizer files the written checkpoint takes.
    pub model_dir: PathBuf,
    /// A named benchmark shape (`composer_model::bench::shape_model_config`): random f32
    /// weights of it (seed 0) are written as an HF checkpoint under `out_dir/model` and both
    /// sides train that. Its vocabulary is widened to the tokenizer's when smaller.
    pub shape: Option<String>,
    /// Prompts per step.
    pub prompts: usize,
    /// Samples per prompt (`num_generations`).
    pub group: usize,
    /// Most new tokens per sample (`max_completion_length`).
    pub new_tokens: usize,
    /// Steps run; the first is a warm-up, the median of the others is reported.
    pub steps: usize,
    /// `[loss] loss_type` (TRL's `loss_type`).
    pub loss_type: String,
    /// AdamW learning rate.
    pub learning_rate: f64,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// `[train] bf16`.
    pub bf16: bool,
    /// Where the prompts, the recipe and the run go.
    pub out_dir: PathBuf,
}

/// The step times of one side.
#[derive(Debug, Clone, Serialize)]
pub struct GrpoStepTimes {
    /// Wall seconds of every step, in order (the first includes warm-up).
    pub step_s: Vec<f64>,
    /// Median of `step_s` after the first (of all when there is one).
    pub median_step_s: f64,
    /// Mean completion length over the steps.
    pub mean_completion_length: f64,
}

/// composer-rl's side: step times and the four walls.
#[derive(Debug, Clone, Serialize)]
pub struct GrpoStepBenchReport {
    /// Whole steps.
    pub steps: GrpoStepTimes,
    /// Medians (after the first step) of rollout, reward, train and weight-sync seconds.
    pub walls_s: [f64; 4],
    /// The prompts file both sides read (JSONL rows with `prompt`).
    pub prompts_file: PathBuf,
    /// The checkpoint both sides train (`model_dir`, or the one written for `shape`).
    pub model_dir: PathBuf,
}

/// The median of `xs` after the first (warm-up) element, or of `xs` when it has one (NaN when
/// empty: no step ran).
pub fn median_after_warmup(xs: &[f64]) -> f64 {
    match xs {
        [] => f64::NAN,
        [only] => *only,
        [_, rest @ ..] => composer_model::bench_rollout::median(rest),
    }
}

/// The benchmark's prompts: short Python stubs of a few lengths, `count` of them.
fn prompts(count: usize) -> Vec<String> {
    (0..count)
        .map(|i| {
            let args = ["a", "a, b", "xs", "text, sep", "n"][i % 5];
            format!(
                "def task_{i}({args}):\n    \"\"\"Solve task {i}{}.\"\"\"\n",
                " carefully".repeat(i % 4)
            )
        })
        .collect()
}

/// Checks the options before anything is written or loaded.
fn check(o: &GrpoStepBenchOptions) -> Result<()> {
    if o.prompts == 0 || o.group < 2 || o.new_tokens == 0 || o.steps == 0 {
        bail!(
            "bench grpo: --prompts, --new-tokens and --steps must be >= 1 and --group >= 2 (got \
             {}, {}, {}, {})",
            o.prompts,
            o.new_tokens,
            o.steps,
            o.group
        );
    }
    if o.shape.is_none() && !o.model_dir.join("config.json").is_file() {
        bail!(
            "bench grpo: --model {}: no config.json there (an HF checkpoint directory is needed)",
            o.model_dir.display()
        );
    }
    if o.shape.is_some() && !o.model_dir.join("tokenizer.json").is_file() {
        bail!(
            "bench grpo: --model {}: no tokenizer.json there (with --shape, --model names the \
             tokenizer's directory)",
            o.model_dir.display()
        );
    }
    if let Some(shape) = &o.shape {
        composer_model::bench::shape_model_config(shape)?;
    }
    Ok(())
}

/// Writes random weights of `shape` with the tokenizer files of `tokenizer_dir` as an HF
/// checkpoint in `dir`.
fn write_shape_checkpoint(shape: &str, tokenizer_dir: &Path, dir: &Path) -> Result<()> {
    let tokenizer = composer_model::Tokenizer::from_dir(tokenizer_dir)?;
    let cfg = composer_model::bench::shape_model_config_for(shape, &tokenizer)?;
    let (model, _) = composer_model::Transformer::random_init(&cfg, 0, &candle_core::Device::Cpu)?;
    model.save_pretrained(dir)?;
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let from = tokenizer_dir.join(file);
        if from.is_file() {
            std::fs::copy(&from, dir.join(file))
                .with_context(|| format!("copying {} to {}", from.display(), dir.display()))?;
        }
    }
    Ok(())
}

/// Writes the prompts and the recipe under `out_dir`; returns (prompts file, recipe file).
fn write_inputs(o: &GrpoStepBenchOptions, model_dir: &Path) -> Result<(PathBuf, PathBuf)> {
    std::fs::create_dir_all(&o.out_dir)
        .with_context(|| format!("creating --out-dir {}", o.out_dir.display()))?;
    let prompts_file = o.out_dir.join("prompts.jsonl");
    let mut rows = String::new();
    for p in prompts(o.prompts * o.steps) {
        writeln!(rows, "{}", serde_json::json!({"prompt": p, "answer": "1"}))?;
    }
    std::fs::write(&prompts_file, rows)
        .with_context(|| format!("writing {}", prompts_file.display()))?;
    let recipe_file = o.out_dir.join("recipe.toml");
    let recipe = format!(
        r#"# Written by `composer-rl bench grpo`.
[model]
path = {model:?}
device = {device:?}

[data]
dataset = {data:?}
eval_dataset = {data:?}
# Reward 1 for an odd number of characters: as TRL's side (`len(completion) % 2`), cheap,
# and with spread in every group, so the advantages (and the loss) are not zero.
verifiers = [{{ kind = "regex", weight = 1.0, pattern = '(?s)^(..)*.$' }}]

[rollout]
num_generations = {group}
max_completion_length = {new_tokens}
temperature = 1.0

[loss]
loss_type = {loss_type:?}
beta = 0.0

[optimizer]
lr = {lr:e}

[train]
steps = {steps}
prompts_per_step = {prompts}
eval_every = 0
checkpoint_every = {never}
bf16 = {bf16}

[output]
run_dir = {run:?}
"#,
        model = model_dir.display().to_string(),
        device = o.device,
        data = prompts_file.display().to_string(),
        group = o.group,
        new_tokens = o.new_tokens,
        loss_type = o.loss_type,
        lr = o.learning_rate,
        steps = o.steps,
        prompts = o.prompts,
        never = o.steps + 1,
        bf16 = o.bf16,
        run = o.out_dir.join("run").display().to_string(),
    );
    std::fs::write(&recipe_file, recipe)
        .with_context(|| format!("writing {}", recipe_file.display()))?;
    Ok((prompts_file, recipe_file))
}

/// Runs composer-rl's side: the trainer for `steps` steps, then its metrics.
pub fn bench_grpo_step(o: &GrpoStepBenchOptions) -> Result<GrpoStepBenchReport> {
    check(o)?;
    let model_dir = match &o.shape {
        Some(shape) => {
            let dir = o.out_dir.join("model");
            write_shape_checkpoint(shape, &o.model_dir, &dir)?;
            dir
        }
        None => o.model_dir.clone(),
    };
    let (prompts_file, recipe_file) = write_inputs(o, &model_dir)?;
    let out = run_train(&TrainOptions {
        recipe_path: Some(recipe_file),
        resume: None,
        quiet: true,
        run_dir_override: None,
        max_steps_override: None,
        overwrite: true,
    })?;
    let lines = composer_telemetry::read_metrics(&out.run_dir.join("metrics.jsonl"))?;
    let train: Vec<_> = lines
        .iter()
        .filter(|l| l.get(keys::KIND).and_then(|k| k.as_str()) == Some(keys::KIND_TRAIN))
        .collect();
    let series = |key: &str| -> Vec<f64> {
        train
            .iter()
            .filter_map(|l| l.get(key).and_then(|x| x.as_f64()))
            .collect()
    };
    let step_s = series(keys::TIME_STEP);
    if step_s.len() != o.steps {
        bail!(
            "bench grpo: the run logged {} steps of {} ({})",
            step_s.len(),
            o.steps,
            out.run_dir.display()
        );
    }
    let lengths = series(keys::COMPLETION_MEAN_LENGTH);
    let walls_s = [
        keys::TIME_ROLLOUT,
        keys::TIME_REWARD,
        keys::TIME_TRAIN,
        keys::TIME_SYNC,
    ]
    .map(|k| median_after_warmup(&series(k)));
    Ok(GrpoStepBenchReport {
        steps: GrpoStepTimes {
            median_step_s: median_after_warmup(&step_s),
            step_s,
            mean_completion_length: lengths.iter().sum::<f64>() / lengths.len().max(1) as f64,
        },
        walls_s,
        prompts_file,
        model_dir,
    })
}
