//! composer-loss: the three-channel Composer loss on candle tensors.
//!
//! `L = L_rlvr + α·L_hint + β·L_replay`
//!
//! * [`rlvr`] — the policy-gradient family of TRL's `GRPOTrainer`, verl's `core_algos.py` and
//!   PRIME-RL's `loss.py` (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo, dppo+kl).
//! * [`advantages`] — group-relative, RLOO, REINFORCE++(-baseline), OPO, multi-reward
//!   aggregation, the DAPO dynamic-sampling filter (plain `f64` slices).
//! * [`hint`] — hint self-distillation (SDPO / OPSD): divergences, hint-prompt construction,
//!   the EMA teacher.
//! * [`replay`] + [`traces`] — trace replay from frozen teachers: DPO family and token-level
//!   forward KL, and the JSONL trace store.
//! * [`composer`] — the weighted sum with per-channel switches and metrics.
//!
//! Conventions: per-token tensors are `[B, T]` (f32 or f64), right-padded; `loss_mask` holds 0/1
//! floats; advantages are `[B]` or per token `[B, T]`. Every loss is a pure function returning `(scalar, metrics)`;
//! inputs that must not receive gradients (old/sampler/reference/teacher log-probs) are detached
//! inside the functions, so callers need not remember to.

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]
#![deny(missing_docs)]

pub mod advantages;
pub mod composer;
pub mod divergence;
pub mod hint;
pub mod inputs;
pub mod replay;
pub mod rlvr;
pub mod traces;
mod util;

pub use advantages::{
    compute_advantages, compute_remax_advantages, filter_zero_variance_groups, group_advantages,
    group_advantages_with, grpo_passk_advantages, opo_advantages, reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages, remax_advantages, rloo_advantages, AdvantageConfig,
    AdvantageEstimator, DynamicSamplingResult, MultiRewardAggregation, SingletonGroup, StdScaling,
};
pub use composer::{composer_loss, ComposerConfig, ComposerMetrics};
pub use hint::{
    build_hint_prompts, ema_tensors, ema_update, hint_loss, DistillationAgg, HintConfig,
    HintDivergence, HintMetrics, HintSupport, HintTemplate, RolloutForHint, DEFAULT_HINT_TEMPLATE,
};
pub use inputs::{DpoInputs, HintInputs, LossInputs, LossScale, ReplayInputs, TeacherKlInputs};
pub use replay::{
    dpo_loss, replay_loss, sequence_logprobs, teacher_kl_loss, DpoConfig, DpoLossType, DpoMetrics,
    ReplayConfig, ReplayMetrics, TeacherKlMetrics,
};
pub use rlvr::{
    agg_loss, rlvr_loss, CispoClipMode, EntropyNormalization, ImportanceSamplingLevel, KlEstimator,
    LossAggMode, LossType, RlvrConfig, RlvrMetrics, SamplerIsMode, SequenceRatioGradient,
};
pub use traces::{collate_topk, TopkBatch, Trace, TraceStore, TraceWriter};

/// Errors of this crate: every variant names the tensor, field, file or line at fault.
#[derive(Debug, thiserror::Error)]
pub enum LossError {
    /// A tensor has the wrong shape.
    #[error("tensor `{tensor}`: expected shape {expected}, got {got:?}")]
    Shape {
        /// Name of the offending tensor / field.
        tensor: &'static str,
        /// Expected shape, in words.
        expected: String,
        /// Actual dims.
        got: Vec<usize>,
    },
    /// An input that this configuration needs is absent.
    #[error("missing input `{field}`: {reason}")]
    Missing {
        /// Name of the absent field.
        field: &'static str,
        /// Why the configuration needs it.
        reason: String,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("invalid config `{key}`: {message}")]
    Config {
        /// The config key at fault.
        key: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A bad value inside an input (NaN, wrong length, ...).
    #[error("invalid input `{field}`: {message}")]
    Input {
        /// The input field at fault.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A trace-store file could not be read or parsed; names the file and (1-based) line.
    #[error("{path}:{line}: {message}")]
    TraceFile {
        /// The file.
        path: String,
        /// 1-based line number (0 when the error is not tied to a line).
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, LossError>;
