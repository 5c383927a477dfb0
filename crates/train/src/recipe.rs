//! The training recipe: one TOML file with sections `[model]`, `[data]`, `[rollout]`, `[loss]`,
//! `[optimizer]`, `[train]`, `[warmup]`, `[replay]`, `[output]`, `[env]`.
//!
//! Unknown keys are rejected (`deny_unknown_fields` everywhere); the error names the file, the
//! key path (`[section] key`) and the closest valid key (Jaro-Winkler via `strsim`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use composer_loss::hint::HintTemplate;
use composer_loss::{AdvantageConfig, DistillationAgg, DpoLossType, HintConfig, RlvrConfig};
use serde::de::DeserializeOwned;

use crate::model::TinyConfig;

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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRecipe {
    /// The policy.
    model: ModelSection,
    /// Prompts and rewards.
    data: DataSection,
    /// Sampling.
    #[serde(default)]
    rollout: RolloutSection,
    #[serde(default)]
    loss: Option<toml::Table>,
    /// AdamW and the learning-rate schedule.
    #[serde(default)]
    optimizer: OptimizerSection,
    /// Step counts, batch shape, seed, intervals.
    #[serde(default)]
    train: TrainSection,
    /// Supervised warm-up before RL (optional).
    #[serde(default)]
    warmup: Option<WarmupSection>,
    /// Teacher traces for the replay channel (optional).
    #[serde(default)]
    replay: Option<ReplaySection>,
    /// Where the run writes.
    #[serde(default)]
    output: OutputSection,
    /// Environment rollouts (optional).
    #[serde(default)]
    env: Option<EnvSection>,
    /// `[diloco]`: parsed by composer-diloco (`train --diloco-replica-id`); ignored here.
    #[serde(default)]
    #[allow(dead_code)]
    diloco: Option<toml::Table>,
}

/// `[env]`: roll out in an environment. Each step resets `prompts_per_step` episodes (one
/// reset seed per group, shared by its `num_generations` samples), the policy plays up to
/// `max_turns` turns, and the env's reward replaces the verifiers' score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSection {
    /// `"builtin"` (an env of composer-env, in process), `"openenv"` (a remote server taking
    /// text actions) or `"openenv_tools"` (a remote MCP-tool server, played as a chat with
    /// tools in the chat template's format: see `tool_env`).
    pub kind: String,
    /// Built-in env name: `"code"` (sandboxed Python tasks) or `"echo"`.
    #[serde(default)]
    pub name: Option<String>,
    /// OpenEnv server URL (`http://HOST:PORT`); several servers comma-separated, each running
    /// up to `max_concurrent` episodes.
    #[serde(default)]
    pub url: Option<String>,
    /// Environment variable holding the server URL(s), read when `url` is unset.
    #[serde(default)]
    pub url_env: Option<String>,
    /// Most model turns per episode.
    #[serde(default = "one_usize")]
    pub max_turns: usize,
    /// Most tokens per episode (prompt, model turns and observations).
    #[serde(default = "d_env_max_tokens")]
    pub max_total_tokens: usize,
    /// Most concurrent episodes per server.
    #[serde(default = "d_env_concurrent")]
    pub max_concurrent: usize,
    /// Limit of one env call (reset/step), seconds.
    #[serde(default = "d_env_call_timeout")]
    pub call_timeout_s: f64,
    /// Limit of one whole episode, seconds.
    #[serde(default = "d_env_episode_timeout")]
    pub episode_timeout_s: f64,
    /// Limit of one connection attempt to an OpenEnv server, seconds.
    #[serde(default = "d_env_connect_timeout")]
    pub connect_timeout_s: f64,
    /// How long a server may fail every connection without one success before the pool gives
    /// it up, seconds; when every server is given up the run stops with an error
    /// (composer-env's `PoolConfig::server_down_budget`).
    #[serde(default = "d_env_server_down_budget")]
    pub server_down_budget_s: f64,
    /// Retries of a failed episode (server error, restart...) before its sample is replaced
    /// by a zero-advantage copy of a peer.
    #[serde(default = "d_env_retries")]
    pub episode_retries: usize,
    /// `"final"`: the last step's reward; `"sum"`: the sum over the episode's steps.
    #[serde(default = "d_env_reward")]
    pub reward: String,
    /// Rewards at or above this count as passed (hint channel, pass rates).
    #[serde(default = "one")]
    pub pass_reward: f64,
    /// Template of the first observation (the prompt); `{observation}` is replaced.
    #[serde(default = "d_env_template")]
    pub prompt_template: String,
    /// Template of later observations, appended after each model turn (masked out of the loss).
    #[serde(default = "d_env_template")]
    pub observation_template: String,
    /// `openenv_tools`: a Jinja chat template file to render tools and tool results with,
    /// in place of the checkpoint's own (which must otherwise support tools).
    #[serde(default)]
    pub chat_template: Option<std::path::PathBuf>,
    /// `openenv_tools`: a system message before the task (None: the template's default).
    #[serde(default)]
    pub system_prompt: Option<String>,
}

fn d_env_max_tokens() -> usize {
    1024
}
fn d_env_concurrent() -> usize {
    4
}
fn d_env_call_timeout() -> f64 {
    60.0
}
fn d_env_episode_timeout() -> f64 {
    300.0
}
fn d_env_connect_timeout() -> f64 {
    10.0
}
fn d_env_server_down_budget() -> f64 {
    60.0
}
fn d_env_retries() -> usize {
    1
}
fn d_env_reward() -> String {
    "final".into()
}
fn d_env_template() -> String {
    "{observation}".into()
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
    /// Batch-invariant sampling and recomputation: the sampler's log-probs equal the
    /// trainer's recomputed log π_old bitwise (`mismatch/max_abs` = 0), at a throughput cost.
    #[serde(default)]
    pub deterministic: bool,
    /// Most samples decoding at once (continuous batching; 0 = all at once).
    #[serde(default)]
    pub max_running_sequences: usize,
    /// Most KV-cache slots (rows × slots per row) the sampler's batch may hold; admission
    /// waits when full (0 = no limit).
    #[serde(default)]
    pub kv_token_budget: usize,
    /// Prompt tokens per prefill forward (0 = whole prompts).
    #[serde(default)]
    pub prefill_chunk: usize,
}

impl Default for RolloutSection {
    fn default() -> Self {
        Self {
            num_generations: d_num_generations(),
            max_completion_length: d_max_completion_length(),
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            deterministic: false,
            max_running_sequences: 0,
            kv_token_budget: 0,
            prefill_chunk: 0,
        }
    }
}

/// `[loss]`: L = L_rlvr + hint_weight · L_hint + replay_weight · L_replay.
///
/// Keys directly under `[loss]` are those of composer-loss's [`RlvrConfig`] (TRL names:
/// `loss_type`, `epsilon`, `epsilon_high`, `delta`, `beta`, `mask_truncated_completions`,
/// `importance_sampling_level`, ...) and [`AdvantageConfig`] (`estimator`, `scale_rewards`,
/// `dynamic_sampling`, ...), plus the channel weights.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossSection {
    /// The policy-gradient surrogate's options.
    pub rlvr: RlvrConfig,
    /// The advantage estimator's options.
    pub advantage: AdvantageConfig,
    /// α: weight of the hint self-distillation channel (0 = off).
    pub hint_weight: f64,
    /// β: weight of the trace replay channel (0 = off).
    pub replay_weight: f64,
    /// `[loss.hint]`.
    pub hint: HintSection,
    /// `[loss.replay]`.
    pub replay: ReplayLossConfig,
    /// The frozen reference policy (KL term of RLVR with `beta > 0`, DPO of the replay
    /// channel): `ref_model_path`, `sync_ref_model`, `ref_model_mixup_alpha`,
    /// `ref_model_sync_steps` (TRL names).
    pub reference: ReferenceConfig,
    /// With `dynamic_sampling = true`: most extra sampling rounds per step to replace
    /// zero-variance groups (`max_dynamic_sampling_rounds`).
    pub max_dynamic_sampling_rounds: usize,
}

/// The reference policy π_ref, TRL's `GRPOConfig` / `DPOConfig` keys.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceConfig {
    /// An HF checkpoint directory to use as the reference; None = the policy's weights when
    /// RL starts (after the warm-up).
    pub ref_model_path: Option<PathBuf>,
    /// Every `ref_model_sync_steps` RL steps, π_ref ← α·π + (1 − α)·π_ref.
    pub sync_ref_model: bool,
    /// α of the sync (TRL default 0.6).
    pub ref_model_mixup_alpha: f64,
    /// Steps between syncs (TRL default 512).
    pub ref_model_sync_steps: usize,
}

impl Default for ReferenceConfig {
    fn default() -> Self {
        Self {
            ref_model_path: None,
            sync_ref_model: false,
            ref_model_mixup_alpha: d_mixup_alpha(),
            ref_model_sync_steps: d_ref_sync_steps(),
        }
    }
}

fn d_mixup_alpha() -> f64 {
    0.6
}
fn d_ref_sync_steps() -> usize {
    512
}
fn d_dynamic_rounds() -> usize {
    4
}

/// `[loss.hint]`: composer-loss's [`HintConfig`] keys (`divergence`, `alpha`, `support`,
/// `is_clip`) plus how the teacher prompt is built.
#[derive(Debug, Clone, PartialEq)]
pub struct HintSection {
    /// Divergence options.
    pub config: HintConfig,
    /// Student top-K tokens per position (+ one tail bucket).
    pub top_k: usize,
    /// Apply only to failing completions (passing ones already agree with their peers).
    pub only_failed: bool,
    /// `[loss.hint.template]`: `reprompt` (`{prompt}`, `{solution}`, `{feedback}`),
    /// `solution` (`{successful_previous_attempt}`), `feedback` (`{feedback_raw}`).
    pub template: HintTemplate,
}

impl Default for HintSection {
    fn default() -> Self {
        Self {
            config: HintConfig::default(),
            top_k: 8,
            only_failed: false,
            template: HintTemplate::default(),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HintOwn {
    #[serde(default = "d_hint_top_k")]
    top_k: usize,
    #[serde(default)]
    only_failed: bool,
    #[serde(default)]
    template: HintTemplate,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LossOwn {
    #[serde(default)]
    hint_weight: f64,
    #[serde(default)]
    replay_weight: f64,
    #[serde(default)]
    hint: Option<toml::Table>,
    #[serde(default)]
    replay: ReplayLossConfig,
    #[serde(default)]
    ref_model_path: Option<PathBuf>,
    #[serde(default)]
    sync_ref_model: bool,
    #[serde(default = "d_mixup_alpha")]
    ref_model_mixup_alpha: f64,
    #[serde(default = "d_ref_sync_steps")]
    ref_model_sync_steps: usize,
    #[serde(default = "d_dynamic_rounds")]
    max_dynamic_sampling_rounds: usize,
}

/// `[loss.replay]`: DPO pairs (chosen = passing teacher trace, rejected = failing rollout of the
/// same prompt) and token-level forward KL to the teachers' recorded top-K distributions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayLossConfig {
    /// Weight of the DPO term.
    #[serde(default = "one")]
    pub dpo_weight: f64,
    /// DPO β (TRL DPOTrainer `beta`).
    #[serde(default = "d_dpo_beta")]
    pub dpo_beta: f64,
    /// Weight of the token-KL term.
    #[serde(default = "one")]
    pub kl_weight: f64,
    /// DPO variant (TRL DPOTrainer `loss_type`): `sigmoid` (default), `hinge`, `ipo`.
    #[serde(default)]
    pub dpo_loss_type: DpoLossType,
    /// Aggregation of the token-KL term: `seq-mean-token-mean` (TRL 1.16 SDPO, default) or
    /// `token-mean`.
    #[serde(default)]
    pub kl_loss_agg_mode: DistillationAgg,
}

impl Default for ReplayLossConfig {
    fn default() -> Self {
        Self {
            dpo_weight: 1.0,
            dpo_beta: d_dpo_beta(),
            kl_weight: 1.0,
            dpo_loss_type: DpoLossType::default(),
            kl_loss_agg_mode: DistillationAgg::default(),
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
    /// micro-batches of at most this many tokens; the gradients of all of them are accumulated. A single row longer than the budget trains alone. Unset:
    /// no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens_per_microbatch: Option<usize>,
    /// TRL's `padding_free`: every teacher-forcing forward packs its micro-batch's rows
    /// without padding into one row (positions restart per sequence, attention stays inside
    /// each), so forward and backward cost only real tokens; the values are the padded ones.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub padding_free: bool,
    /// TRL's `gradient_checkpointing`: the backward recomputes each decoder layer's
    /// activations instead of keeping them (same gradients, less memory, one more forward
    /// per layer). CPU only (`[model] device = "cpu"`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gradient_checkpointing: bool,
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

fn one() -> f64 {
    1.0
}
fn one_usize() -> usize {
    1
}
fn d_eval_size() -> usize {
    200
}
fn d_verifiers() -> Vec<VerifierSpec> {
    vec![VerifierSpec {
        kind: "numeric".into(),
        weight: 1.0,
        pattern: None,
    }]
}
fn d_digits() -> u32 {
    2
}
fn d_ops() -> Vec<String> {
    vec!["+".into()]
}
fn d_num_generations() -> usize {
    8
}
fn d_max_completion_length() -> usize {
    8
}
fn d_hint_top_k() -> usize {
    8
}
fn d_dpo_beta() -> f64 {
    0.1
}
fn d_lr() -> f64 {
    1e-3
}
fn d_betas() -> [f64; 2] {
    [0.9, 0.999]
}
fn d_eps() -> f64 {
    1e-8
}
fn d_schedule() -> String {
    "constant".into()
}
fn d_steps() -> usize {
    100
}
fn d_prompts() -> usize {
    16
}
fn d_eval_every() -> usize {
    10
}
fn d_ckpt_every() -> usize {
    50
}
fn d_max_nonfinite() -> usize {
    3
}
fn d_warm_steps() -> usize {
    200
}
fn d_warm_batch() -> usize {
    64
}
fn d_warm_lr() -> f64 {
    3e-3
}
fn d_run_dir() -> PathBuf {
    PathBuf::from("runs/default")
}

/// A complete, commented example recipe (shown by `composer-rl train --help`).
pub const EXAMPLE_RECIPE: &str = include_str!("example_recipe.toml");

/// The recipe `composer-rl train` runs with no arguments: the built-in arithmetic task, a tiny
/// model from scratch, a short warm-up, then RL with all three channels on.
pub const EMBEDDED_DEFAULT_RECIPE: &str = include_str!("default_recipe.toml");

/// The embedded default recipe, parsed.
pub fn embedded_default_recipe() -> Recipe {
    parse_recipe(
        EMBEDDED_DEFAULT_RECIPE,
        Path::new("<embedded default recipe>"),
    )
    .expect("the embedded default recipe parses (tested)")
}

/// Read and validate a recipe file.
pub fn load_recipe(path: &Path) -> Result<Recipe> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading recipe {}", path.display()))?;
    parse_recipe(&text, path)
}

/// Parse and validate recipe text; `origin` names the file in errors.
pub fn parse_recipe(text: &str, origin: &Path) -> Result<Recipe> {
    let raw: RawRecipe = toml::from_str(text).map_err(|e| {
        let msg = e.message().to_string();
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
        let section = line.map(|l| section_at(text, l)).unwrap_or_default();
        // The key is what precedes `=` on the error's line (the span may cover the value).
        let key = e
            .span()
            .map(|s| {
                let start = s.start.min(text.len());
                let line_start = text[..start].rfind('\n').map(|i| i + 1).unwrap_or(0);
                let line_end = text[start..]
                    .find('\n')
                    .map(|i| start + i)
                    .unwrap_or(text.len());
                let line = &text[line_start..line_end];
                match line.split_once('=') {
                    Some((k, _)) if !line.trim_start().starts_with('[') => k.trim().to_string(),
                    _ => text[start..s.end.min(text.len())].trim().to_string(),
                }
            })
            .unwrap_or_default();
        let key_path = if section.is_empty() {
            key.clone()
        } else {
            format!("[{section}] {key}")
        };
        let hint = suggestion(&msg)
            .map(|s| format!(" (did you mean `{s}`?)"))
            .unwrap_or_default();
        let at = line.map(|l| format!(" line {l}")).unwrap_or_default();
        anyhow::anyhow!(
            "recipe {}{at}, key `{key_path}`: {msg}{hint}",
            origin.display()
        )
    })?;
    let loss = parse_loss(raw.loss.unwrap_or_default(), text)
        .map_err(|e| anyhow::anyhow!("recipe {}{e}", origin.display()))?;
    let recipe = Recipe {
        model: raw.model,
        data: raw.data,
        rollout: raw.rollout,
        loss,
        optimizer: raw.optimizer,
        train: raw.train,
        warmup: raw.warmup,
        replay: raw.replay,
        output: raw.output,
        env: raw.env,
    };
    // Ranges first: their errors carry the file, key and allowed range themselves.
    crate::validate::validate_ranges(&recipe, origin)?;
    validate(&recipe).with_context(|| format!("recipe {}", origin.display()))?;
    Ok(recipe)
}

/// Field names of a `deny_unknown_fields` struct, read from serde's "expected one of" message.
fn field_names<T: DeserializeOwned>() -> Vec<String> {
    let mut probe = toml::Table::new();
    probe.insert("__composer_probe__".into(), toml::Value::Integer(0));
    match T::deserialize(toml::Value::Table(probe)) {
        Ok(_) => vec![],
        Err(e) => {
            let msg = e.to_string();
            let rest = msg.split_once("expected").map(|x| x.1).unwrap_or("");
            rest.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect()
        }
    }
}

/// Split `table` between several key sets (first match wins); an unknown key is an error
/// naming `section`, the line, and the closest known key.
fn split_table(
    table: toml::Table,
    section: &str,
    sets: &[Vec<String>],
    text: &str,
) -> std::result::Result<Vec<toml::Table>, String> {
    let mut out = vec![toml::Table::new(); sets.len()];
    for (k, v) in table {
        match sets.iter().position(|s| s.contains(&k)) {
            Some(i) => {
                out[i].insert(k, v);
            }
            None => {
                let all: Vec<&String> = sets.iter().flatten().collect();
                let best = all
                    .iter()
                    .map(|c| (strsim::jaro_winkler(&k, c), c))
                    .filter(|(s, _)| *s > 0.6)
                    .max_by(|a, b| a.0.total_cmp(&b.0))
                    .map(|(_, c)| format!(" (did you mean `{c}`?)"))
                    .unwrap_or_default();
                return Err(format!(
                    "{}, key `[{section}] {k}`: unknown key{best}",
                    line_of(text, section, &k)
                ));
            }
        }
    }
    Ok(out)
}

/// " line N" of `key` inside `[section]`, or "" when not found.
fn line_of(text: &str, section: &str, key: &str) -> String {
    let mut in_section = false;
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with('[') {
            in_section = t.trim_matches(|c| c == '[' || c == ']').trim() == section;
        } else if in_section && t.split('=').next().map(str::trim) == Some(key) {
            return format!(" line {}", i + 1);
        }
    }
    String::new()
}

fn typed<T: DeserializeOwned>(
    t: toml::Table,
    section: &str,
    text: &str,
) -> std::result::Result<T, String> {
    let keys: Vec<String> = t.keys().cloned().collect();
    T::deserialize(toml::Value::Table(t)).map_err(|e| {
        let msg = e.to_string();
        let key = keys
            .iter()
            .find(|k| msg.contains(&format!("`{k}`")))
            .or(keys.first());
        match key {
            Some(k) => format!(
                "{}, key `[{section}] {k}`: {}",
                line_of(text, section, k),
                msg.trim()
            ),
            None => format!(", section `[{section}]`: {}", msg.trim()),
        }
    })
}

fn parse_loss(table: toml::Table, text: &str) -> std::result::Result<LossSection, String> {
    let sets = [
        field_names::<RlvrConfig>(),
        field_names::<AdvantageConfig>(),
        field_names::<LossOwn>(),
    ];
    let mut parts = split_table(table, "loss", &sets, text)?.into_iter();
    let rlvr: RlvrConfig = typed(parts.next().unwrap_or_default(), "loss", text)?;
    let advantage: AdvantageConfig = typed(parts.next().unwrap_or_default(), "loss", text)?;
    let own: LossOwn = typed(parts.next().unwrap_or_default(), "loss", text)?;
    let hint_sets = [field_names::<HintConfig>(), field_names::<HintOwn>()];
    let mut hp =
        split_table(own.hint.unwrap_or_default(), "loss.hint", &hint_sets, text)?.into_iter();
    let config: HintConfig = typed(hp.next().unwrap_or_default(), "loss.hint", text)?;
    let hown: HintOwn = typed(hp.next().unwrap_or_default(), "loss.hint", text)?;
    Ok(LossSection {
        rlvr,
        advantage,
        hint_weight: own.hint_weight,
        replay_weight: own.replay_weight,
        hint: HintSection {
            config,
            top_k: hown.top_k,
            only_failed: hown.only_failed,
            template: hown.template,
        },
        replay: own.replay,
        reference: ReferenceConfig {
            ref_model_path: own.ref_model_path,
            sync_ref_model: own.sync_ref_model,
            ref_model_mixup_alpha: own.ref_model_mixup_alpha,
            ref_model_sync_steps: own.ref_model_sync_steps,
        },
        max_dynamic_sampling_rounds: own.max_dynamic_sampling_rounds,
    })
}

/// The `[section]` header in force at 1-based `line`.
fn section_at(text: &str, line: usize) -> String {
    let mut section = String::new();
    for l in text.lines().take(line) {
        let t = l.trim();
        if t.starts_with('[') {
            section = t.trim_matches(|c| c == '[' || c == ']').trim().to_string();
        }
    }
    section
}

/// For serde's "unknown field `x`, expected one of `a`, `b`", the closest expected key.
fn suggestion(msg: &str) -> Option<String> {
    let rest = msg.strip_prefix("unknown field `")?;
    let (unknown, expected) = rest.split_once('`')?;
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|k| (strsim::jaro_winkler(unknown, k), k))
        .filter(|(s, _)| *s > 0.6)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.to_string())
}

fn validate(r: &Recipe) -> Result<()> {
    match (&r.model.path, &r.model.builtin_tiny) {
        (None, None) => bail!("key `[model]`: set `path` (an HF checkpoint) or `builtin_tiny`"),
        (Some(_), Some(_)) => bail!("key `[model]`: set only one of `path` and `builtin_tiny`"),
        _ => {}
    }
    match (&r.data.task, &r.data.dataset) {
        (None, None) => {
            bail!("key `[data]`: set `task = \"arithmetic\"` or `dataset = \"file.jsonl\"`")
        }
        (Some(t), _) if t != "arithmetic" => {
            bail!("key `[data] task`: unknown task {t:?} (known: \"arithmetic\")")
        }
        _ => {}
    }
    if !(1..=4).contains(&r.data.arithmetic.digits) {
        bail!(
            "key `[data.arithmetic] digits`: must be 1..=4, got {}",
            r.data.arithmetic.digits
        );
    }
    for op in &r.data.arithmetic.ops {
        if !["+", "-", "*"].contains(&op.as_str()) {
            bail!("key `[data.arithmetic] ops`: unknown operator {op:?} (known: + - *)");
        }
    }
    for (i, v) in r.data.verifiers.iter().enumerate() {
        match v.kind.as_str() {
            "exact" | "numeric" | "code" => {}
            "regex" => {
                let p = v.pattern.as_deref().with_context(|| {
                    format!("key `[[data.verifiers]]` #{i}: kind = \"regex\" needs `pattern`")
                })?;
                regex::Regex::new(&p.replace("{answer}", "0"))
                    .with_context(|| format!("key `[[data.verifiers]]` #{i} pattern"))?;
            }
            k => bail!("key `[[data.verifiers]]` #{i} kind: unknown verifier {k:?} (known: exact, numeric, regex, code)"),
        }
    }
    let one_of = |key: &str, v: &str, allowed: &[&str]| -> Result<()> {
        if !allowed.contains(&v) {
            bail!(
                "key `{key}`: unknown value {v:?} (known: {})",
                allowed.join(", ")
            );
        }
        Ok(())
    };
    one_of(
        "[data] overlong_prompts",
        &r.data.overlong_prompts,
        &["error", "skip"],
    )?;
    one_of(
        "[optimizer] schedule",
        &r.optimizer.schedule,
        &["constant", "cosine"],
    )?;
    r.loss
        .rlvr
        .validate()
        .map_err(|e| anyhow::anyhow!("key `[loss]`: {e}"))?;
    if !r.loss.hint.template.reprompt.contains("{prompt}") {
        bail!("key `[loss.hint.template] reprompt`: must contain {{prompt}}");
    }
    if r.loss.hint.top_k == 0 {
        bail!("key `[loss.hint] top_k`: must be >= 1");
    }
    if r.rollout.num_generations < 1 || r.train.prompts_per_step < 1 {
        bail!("key `[rollout] num_generations` and `[train] prompts_per_step` must be >= 1");
    }
    if r.rollout.temperature < 0.0 {
        bail!("key `[rollout] temperature`: must be >= 0");
    }
    let budget = r.rollout.kv_token_budget;
    if budget > 0 && budget <= r.rollout.max_completion_length {
        bail!(
            "key `[rollout] kv_token_budget` = {budget} cannot hold one sample: it must exceed max_completion_length ({}) plus the prompt",
            r.rollout.max_completion_length
        );
    }
    if r.train.mode == TrainMode::Async && r.env.is_some() {
        bail!("key `[train] mode = \"async\"` does not support `[env]` rollouts yet; use `mode = \"sync\"`");
    }
    if !(r.train.reward_latency_s >= 0.0) {
        bail!("key `[train] reward_latency_s` must be >= 0");
    }
    if r.train.num_iterations < 1
        || r.train.mini_batches < 1
        || r.train.gradient_accumulation_steps < 1
    {
        bail!("key `[train] num_iterations`, `mini_batches`, `gradient_accumulation_steps` must be >= 1");
    }
    if let Some(env) = &r.env {
        validate_env(env, r)?;
    }
    let rf = &r.loss.reference;
    if rf.sync_ref_model {
        if !(0.0..=1.0).contains(&rf.ref_model_mixup_alpha) {
            bail!(
                "key `[loss] ref_model_mixup_alpha`: must be in [0, 1], got {}",
                rf.ref_model_mixup_alpha
            );
        }
        if rf.ref_model_sync_steps < 1 {
            bail!("key `[loss] ref_model_sync_steps`: must be >= 1");
        }
    }
    if let Some(p) = &rf.ref_model_path {
        if !p.join("config.json").is_file() {
            bail!(
                "key `[loss] ref_model_path`: {} is not an HF checkpoint directory (no config.json)",
                p.display()
            );
        }
    }
    if r.loss.advantage.dynamic_sampling && (r.env.is_some() || r.train.mode == TrainMode::Async) {
        bail!("key `[loss] dynamic_sampling`: supported in `[train] mode = \"sync\"` without `[env]` only");
    }
    if let Some(rp) = &r.replay {
        if !rp.teacher_weights.is_empty() && rp.teacher_weights.len() != rp.traces.len() {
            bail!(
                "key `[replay] teacher_weights`: {} weights for {} trace files",
                rp.teacher_weights.len(),
                rp.traces.len()
            );
        }
    }
    Ok(())
}

fn validate_env(e: &EnvSection, r: &Recipe) -> Result<()> {
    match e.kind.as_str() {
        "builtin" => match e.name.as_deref() {
            Some("code" | "echo") => {}
            Some(other) => {
                bail!("key `[env] name`: unknown built-in env {other:?} (known: code, echo)")
            }
            None => bail!("key `[env] name`: kind = \"builtin\" needs `name` (code or echo)"),
        },
        "openenv" | "openenv_tools" => {
            if e.url.is_none() && e.url_env.is_none() {
                bail!(
                    "key `[env] url`: kind = {:?} needs `url` (http://HOST:PORT) or `url_env`",
                    e.kind
                );
            }
        }
        other => bail!(
            "key `[env] kind`: unknown value {other:?} (known: builtin, openenv, openenv_tools)"
        ),
    }
    if e.kind == "openenv_tools" {
        // The chat template renders every observation; text templates would corrupt it.
        for (key, t) in [
            ("prompt_template", &e.prompt_template),
            ("observation_template", &e.observation_template),
        ] {
            if t != "{observation}" {
                bail!("key `[env] {key}`: kind = \"openenv_tools\" renders observations with the chat template; leave it at \"{{observation}}\"");
            }
        }
    } else {
        for key in ["chat_template", "system_prompt"] {
            let set = match key {
                "chat_template" => e.chat_template.is_some(),
                _ => e.system_prompt.is_some(),
            };
            if set {
                bail!("key `[env] {key}`: only used with kind = \"openenv_tools\"");
            }
        }
    }
    if e.max_turns < 1 {
        bail!("key `[env] max_turns`: must be >= 1");
    }
    if e.max_concurrent < 1 {
        bail!("key `[env] max_concurrent`: must be >= 1");
    }
    if e.max_total_tokens <= r.rollout.max_completion_length {
        bail!(
            "key `[env] max_total_tokens`: {} leaves no room for a prompt before `[rollout] max_completion_length` = {}",
            e.max_total_tokens,
            r.rollout.max_completion_length
        );
    }
    for (key, v) in [
        ("call_timeout_s", e.call_timeout_s),
        ("episode_timeout_s", e.episode_timeout_s),
        ("connect_timeout_s", e.connect_timeout_s),
        ("server_down_budget_s", e.server_down_budget_s),
    ] {
        if !(v > 0.0) || !v.is_finite() {
            bail!("key `[env] {key}`: must be a positive number of seconds, got {v}");
        }
    }
    if !["final", "sum"].contains(&e.reward.as_str()) {
        bail!(
            "key `[env] reward`: unknown value {:?} (known: final, sum)",
            e.reward
        );
    }
    for (key, t) in [
        ("prompt_template", &e.prompt_template),
        ("observation_template", &e.observation_template),
    ] {
        if !t.contains("{observation}") {
            bail!("key `[env] {key}`: must contain {{observation}}");
        }
    }
    Ok(())
}
