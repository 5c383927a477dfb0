//! [`Recipe`] and its smaller sections.

use std::path::PathBuf;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::model::TinyConfig;

use super::defaults::{
    d_betas, d_ckpt_every, d_digits, d_eps, d_eval_every, d_eval_size, d_kv_block_size, d_lr,
    d_max_completion_length, d_max_nonfinite, d_num_generations, d_ops, d_prompts, d_run_dir,
    d_schedule, d_steps, d_warm_batch, d_warm_lr, d_warm_steps, one, one_usize,
};
use super::{EnvSection, LossSection};

/// A complete recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    /// The policy.
    pub model: ModelSection,
    /// Prompts and rewards.
    pub data: DataSection,
    /// Sampling.
    pub rollout: RolloutSection,
    /// The three-channel loss.
    pub loss: LossSection,
    /// AdamW and the learning-rate schedule.
    pub optimizer: OptimizerSection,
    /// Step counts, batch shape, seed, intervals.
    pub train: TrainSection,
    /// Supervised warm-up before RL (optional).
    pub warmup: Option<WarmupSection>,
    /// Teacher traces for the replay channel (optional).
    pub replay: Option<ReplaySection>,
    /// Where the run writes.
    pub output: OutputSection,
    /// Rollouts in an environment (built-in or a remote OpenEnv server) instead of the
    /// data's prompts and verifiers (optional).
    pub env: Option<EnvSection>,
}

/// `[model]`: an HF checkpoint directory, or the built-in tiny model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Directory of an HF checkpoint (config.json, model.safetensors, tokenizer.json).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Shape of a randomly initialised Qwen2-shaped model with a char-level tokenizer built
    /// for the data.
    #[serde(default)]
    pub builtin_tiny: Option<TinyConfig>,
    /// Where the policy trains and samples: `cpu` (default), `cuda` or `cuda:N` (a build with
    /// `--features cuda`).
    #[serde(default = "d_device")]
    pub device: String,
    /// TRL `use_peft`: train LoRA adapters on the frozen model instead of every weight.
    #[serde(default)]
    pub use_peft: bool,
    /// TRL `lora_r`: adapter rank.
    #[serde(default = "d_lora_r")]
    pub lora_r: usize,
    /// TRL `lora_alpha`: the adapter update is scaled by `lora_alpha / lora_r`.
    #[serde(default = "d_lora_alpha")]
    pub lora_alpha: f64,
    /// TRL `lora_dropout`: dropout on the adapters' input while training.
    #[serde(default = "d_lora_dropout")]
    pub lora_dropout: f64,
    /// TRL `lora_target_modules`: projections to adapt (`q_proj`, ..., `down_proj`) or
    /// `"all-linear"`; absent: PEFT's default for the family (`q_proj`, `v_proj`).
    #[serde(default)]
    pub lora_target_modules: Option<LoraTargets>,
}

fn d_device() -> String {
    "cpu".into()
}
fn d_lora_r() -> usize {
    16
}
fn d_lora_alpha() -> f64 {
    32.0
}
fn d_lora_dropout() -> f64 {
    0.05
}

/// `lora_target_modules`: a list of module names, or the string `"all-linear"` (any other
/// single string is refused: PEFT reads it as a regex).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LoraTargets {
    /// `["q_proj", "v_proj"]`.
    List(Vec<String>),
    /// `"all-linear"`.
    One(String),
}

impl ModelSection {
    /// The LoRA config of `use_peft = true` (None when off); a bad `lora_*` value is an
    /// error naming its key.
    pub fn lora_config(&self) -> Result<Option<composer_model::LoraConfig>> {
        if !self.use_peft {
            return Ok(None);
        }
        let targets: Option<Vec<String>> = match &self.lora_target_modules {
            None => None,
            Some(LoraTargets::List(l)) => Some(l.clone()),
            Some(LoraTargets::One(s)) if s == "all-linear" => Some(vec![s.clone()]),
            // PEFT reads any other single string as a regex over full module names.
            Some(LoraTargets::One(s)) => bail!(
                "key `lora_target_modules` = {s:?}: a single string is PEFT's regex form, which \
                 is not supported; give a list (e.g. [{s:?}]) or \"all-linear\""
            ),
        };
        Ok(Some(composer_model::LoraConfig::new(
            self.lora_r,
            self.lora_alpha,
            self.lora_dropout,
            targets.as_deref(),
        )?))
    }
}

/// `[data]`: a JSONL dataset or the built-in procedural task, plus the reward verifiers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// Built-in procedural task: `"arithmetic"`.
    #[serde(default)]
    pub task: Option<String>,
    /// Knobs of the arithmetic task.
    #[serde(default)]
    pub arithmetic: ArithmeticConfig,
    /// JSONL prompts with `prompt` or `messages`, and `answer`.
    #[serde(default)]
    pub dataset: Option<PathBuf>,
    /// Held-out JSONL for eval; when absent, `eval_size` rows are held out of the training data.
    #[serde(default)]
    pub eval_dataset: Option<PathBuf>,
    /// Held-out eval set size.
    #[serde(default = "d_eval_size")]
    pub eval_size: usize,
    /// Rewards, summed with their weights. Default: numeric match, weight 1.
    #[serde(default = "d_verifiers")]
    pub verifiers: Vec<VerifierSpec>,
    /// A prompt that leaves no room in the model's context: `"error"` (default; the run stops
    /// before training, naming the file and line) or `"skip"` (the row is dropped and counted).
    #[serde(default = "d_overlong_prompts")]
    pub overlong_prompts: String,
}

fn d_overlong_prompts() -> String {
    "error".into()
}

fn d_verifiers() -> Vec<VerifierSpec> {
    vec![VerifierSpec {
        kind: "numeric".into(),
        weight: 1.0,
        pattern: None,
    }]
}

/// The built-in arithmetic task: `"37+58="` → `"95"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArithmeticConfig {
    /// Digits of each operand (operands in [10^(d-1), 10^d - 1]).
    #[serde(default = "d_digits")]
    pub digits: u32,
    /// Operators drawn uniformly: any of `+`, `-`, `*`.
    #[serde(default = "d_ops")]
    pub ops: Vec<String>,
    /// Largest operand (default 10^digits − 1); e.g. 49 keeps 2-digit sums at two digits.
    #[serde(default)]
    pub operand_max: Option<u64>,
}

impl Default for ArithmeticConfig {
    fn default() -> Self {
        Self {
            digits: d_digits(),
            ops: d_ops(),
            operand_max: None,
        }
    }
}

/// One reward: `kind` = `"exact"`, `"numeric"`, `"regex"` (with `pattern`) or `"code"` (the
/// row's `answer` holds `{"entry_point", "tests"}` JSON; tests run in the sandbox), and its weight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifierSpec {
    /// `exact` | `numeric` | `regex` | `code`.
    pub kind: String,
    /// Weight in the summed reward.
    #[serde(default = "one")]
    pub weight: f64,
    /// Regex for `kind = "regex"` (`{answer}` is replaced by the escaped answer).
    #[serde(default)]
    pub pattern: Option<String>,
}

/// `[rollout]`: sampling of the RL completions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutSection {
    /// Completions per prompt (the group size G).
    #[serde(default = "d_num_generations")]
    pub num_generations: usize,
    /// Longest completion in tokens.
    #[serde(default = "d_max_completion_length")]
    pub max_completion_length: usize,
    /// Sampling temperature (the trainer divides its logits by it too, as TRL does).
    #[serde(default = "one")]
    pub temperature: f64,
    /// Nucleus sampling mass (1 = off).
    #[serde(default = "one")]
    pub top_p: f64,
    /// Top-k sampling (0 = off).
    #[serde(default)]
    pub top_k: usize,
    /// Min-p sampling (TRL's `min_p`): keep tokens with `p ≥ min_p · p_max` (0 = off).
    #[serde(default)]
    pub min_p: f64,
    /// Batch-invariant sampling and recomputation: the sampler's log-probs equal the
    /// trainer's recomputed log π_old bitwise (`mismatch/max_abs` = 0), at a throughput cost.
    #[serde(default)]
    pub deterministic: bool,
    /// Most samples decoding at once (continuous batching; 0 = all at once).
    #[serde(default)]
    pub max_running_sequences: usize,
    /// Most KV-cache slots (blocks held × `kv_block_size`, a prompt's blocks shared by its
    /// samples counted once) the sampler may hold; admission waits when full (0 = no limit).
    #[serde(default)]
    pub kv_token_budget: usize,
    /// Prompt tokens per prefill forward (0 = whole prompts).
    #[serde(default)]
    pub prefill_chunk: usize,
    /// Token slots per block of the sampler's paged KV cache (>= 1).
    #[serde(default = "d_kv_block_size")]
    pub kv_block_size: usize,
    /// Decode steps at fixed, padded batch sizes, each size captured once as a CUDA graph and
    /// replayed (on the CPU the same steps run without capture). Not with `[train] mode =
    /// "async"` on a GPU: a capture records all work on the device.
    #[serde(default)]
    pub cuda_graphs: bool,
}

impl Default for RolloutSection {
    fn default() -> Self {
        Self {
            num_generations: d_num_generations(),
            max_completion_length: d_max_completion_length(),
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            deterministic: false,
            max_running_sequences: 0,
            kv_token_budget: 0,
            prefill_chunk: 0,
            kv_block_size: d_kv_block_size(),
            cuda_graphs: false,
        }
    }
}

/// `[optimizer]`: AdamW (torch.optim.AdamW semantics) with warm-up and schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    /// Peak learning rate.
    #[serde(default = "d_lr")]
    pub lr: f64,
    /// (β1, β2).
    #[serde(default = "d_betas")]
    pub betas: [f64; 2],
    /// Decoupled weight decay.
    #[serde(default)]
    pub weight_decay: f64,
    /// Adam ε.
    #[serde(default = "d_eps")]
    pub eps: f64,
    /// Linear warm-up steps (optimizer steps).
    #[serde(default)]
    pub warmup_steps: usize,
    /// `constant` | `cosine` (to 0 at the last step).
    #[serde(default = "d_schedule")]
    pub schedule: String,
    /// Global gradient-norm clip (0 = off).
    #[serde(default = "one")]
    pub max_grad_norm: f64,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        toml::from_str("").expect("defaults parse")
    }
}

/// `[train]`: the step loop's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// RL steps.
    #[serde(default = "d_steps")]
    pub steps: usize,
    /// Prompts sampled per step (each gets `num_generations` completions).
    #[serde(default = "d_prompts")]
    pub prompts_per_step: usize,
    /// μ: passes over each batch; old log-probs are recomputed before the first update when > 1.
    #[serde(default = "one_usize")]
    pub num_iterations: usize,
    /// Optimizer steps per pass (the batch is split by prompt groups).
    #[serde(default = "one_usize")]
    pub mini_batches: usize,
    /// Micro-batches whose gradients are accumulated inside one mini-batch.
    #[serde(default = "one_usize")]
    pub gradient_accumulation_steps: usize,
    /// Token budget of one micro-batch (padded rows × row length; with `padding_free` the
    /// real tokens; TRL/verl-style dynamic micro-batching): each of the
    /// `gradient_accumulation_steps` micro-batches is split further, in order, into
    /// micro-batches of at most this many tokens; the gradients of all of them are
    /// accumulated. A single row longer than the budget trains alone. Unset: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens_per_microbatch: Option<usize>,
    /// TRL's `padding_free`: every teacher-forcing forward packs its micro-batch's rows
    /// without padding into one row (positions restart per sequence, attention stays inside
    /// each), so forward and backward cost only real tokens; the values are the padded ones.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub padding_free: bool,
    /// TRL's `gradient_checkpointing`: the backward recomputes each decoder layer's
    /// activations instead of keeping them (same gradients, less memory, one more forward
    /// per layer), on the CPU and on CUDA.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gradient_checkpointing: bool,
    /// TRL's `bf16`: every training forward and backward runs on a bf16 copy of the f32
    /// master weights (cast after each optimizer step); gradients are accumulated, clipped
    /// and applied in f32, AdamW's moments are f32, checkpoints store the f32 masters, and
    /// rollouts sample with the bf16 copy ([`crate::mixed_precision`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bf16: bool,
    /// TRL's `fp16`: refused when true (fp16 training needs loss scaling, which is not
    /// implemented); accepted as false so TRL configs carry over.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fp16: bool,
    /// Seed of every random draw (each draw depends on (seed, step, index)).
    #[serde(default)]
    pub seed: u64,
    /// Greedy eval every N steps (0 = only at the end).
    #[serde(default = "d_eval_every")]
    pub eval_every: usize,
    /// Checkpoint every N steps (0 = only at the end).
    #[serde(default = "d_ckpt_every")]
    pub checkpoint_every: usize,
    /// Consecutive non-finite steps before the run stops.
    #[serde(default = "d_max_nonfinite")]
    pub max_nonfinite_steps: usize,
    /// Stop early once eval accuracy reaches this (0 = never).
    #[serde(default)]
    pub stop_at_accuracy: f64,
    /// Actor layout: `sync` (generate, score, train, publish one after the other) or `async`
    /// (generator and rewarder threads feed the trainer through bounded queues).
    #[serde(default)]
    pub mode: TrainMode,
    /// Async mode: largest accepted lag (trainer version − the rollout's policy version);
    /// staler rollouts are dropped and counted, never trained on.
    #[serde(default = "one_u64")]
    pub max_staleness: u64,
    /// Extra seconds added to every sample's verification (simulates a slow environment for
    /// the async benchmark; 0 in real runs).
    #[serde(default)]
    pub reward_latency_s: f64,
}

/// `[train] mode`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainMode {
    /// One after the other, in one thread (deterministic).
    #[default]
    Sync,
    /// Generator, rewarder and trainer actors with bounded staleness.
    Async,
}

fn one_u64() -> u64 {
    1
}

impl Default for TrainSection {
    fn default() -> Self {
        toml::from_str("").expect("defaults parse")
    }
}

/// `[warmup]`: supervised fine-tuning before RL; loss on completion tokens only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmupSection {
    /// JSONL of `prompt` + `completion` rows; when absent, examples come from the built-in task.
    #[serde(default)]
    pub dataset: Option<PathBuf>,
    /// Optimizer steps.
    #[serde(default = "d_warm_steps")]
    pub steps: usize,
    /// Rows per step.
    #[serde(default = "d_warm_batch")]
    pub batch_size: usize,
    /// Constant learning rate.
    #[serde(default = "d_warm_lr")]
    pub lr: f64,
    /// Fraction of generated examples shown in the hint format (the teacher prompt of the hint
    /// channel), so the model learns to read a hint.
    #[serde(default)]
    pub hint_fraction: f64,
}

/// `[replay]`: teacher trace files (trace store JSONL) and their weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplaySection {
    /// Trace files; `"builtin:scripted"` = traces written by the arithmetic task's scripted
    /// teacher into RUN_DIR/traces/scripted.jsonl at the start of the run.
    pub traces: Vec<String>,
    /// One weight per trace file (default 1 each).
    #[serde(default)]
    pub teacher_weights: Vec<f64>,
}

/// `[output]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// Run directory (metrics.jsonl, checkpoint/, report.html, recipe.toml).
    #[serde(default = "d_run_dir")]
    pub run_dir: PathBuf,
}

impl Default for OutputSection {
    fn default() -> Self {
        Self {
            run_dir: d_run_dir(),
        }
    }
}
