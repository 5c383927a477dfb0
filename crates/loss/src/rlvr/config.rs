//! Configuration, enums and metrics of the RLVR channel.
use crate::{LossError, Result};
use serde::{Deserialize, Serialize};

/// How per-token losses become one scalar (and which normaliser they use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// Per-sequence token mean, then mean over sequences (original GRPO; length-biased).
    Grpo,
    /// Token mean over the local micro-batch.
    Bnpo,
    /// Token sum divided by `B · max_completion_length` (Dr. GRPO).
    DrGrpo,
    /// Token sum divided by the global active-token count of the step (DAPO). TRL's default.
    #[default]
    Dapo,
    /// Clipped IS-weight policy gradient (MiniMax-M1 / ScaleRL); cap = `epsilon_high`.
    Cispo,
    /// Soft adaptive gate σ(τ(r−1))·4/τ instead of hard clipping (SAPO).
    Sapo,
    /// Length-unbiased sequence policy optimisation: sequence loss × its length (LUSPO).
    Luspo,
    /// Gamma-weighted sequence IS (VESPO).
    Vespo,
    /// PRIME-RL's default: DPPO probability-difference mask + squared-log-ratio KL.
    #[serde(alias = "dppo_kl", alias = "prime_rl")]
    Dppo,
    /// verl `gpg`: ℓ = −A·log π (no ratio).
    Gpg,
    /// verl `clip_cov`: clipped surrogate; tokens whose covariance
    /// (A − mean A)(log π − mean log π) lies in (`clip_cov_lb`, `clip_cov_ub`) get no gradient.
    ClipCov,
    /// verl `kl_cov`: ℓ = −A·r, plus `ppo_kl_coef`·\|log r\| on the top `kl_cov_ratio` tokens by
    /// covariance.
    KlCov,
    /// verl `geo_mean` (GMPO): −mean_i Ā_i·exp(mean_t clip_sgn(log r)), Ā_i the masked mean of A.
    GeoMean,
}

/// How the entropy bonus is normalised when no `loss_agg_mode` is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntropyNormalization {
    /// Σ m_eff·H / Σ m_eff over the micro-batch, ÷ micro-batches, for every loss type
    /// (TRL ≥ 1.16). Default.
    #[default]
    MicroBatchMean,
    /// The policy term's own normaliser (global tokens for dapo/cispo/vespo/dppo; TRL < 1.16).
    PolicyNormalizer,
}

/// CISPO's clipping of the detached IS weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CispoClipMode {
    /// min(r, ε_high), ε_high an absolute cap (TRL). Default.
    #[default]
    UpperCap,
    /// clip(r, 1−ε, 1+ε_high) (verl `compute_policy_loss_cispo`).
    TwoSided,
}

/// Where the gradient of the sequence-level (GSPO) ratio flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SequenceRatioGradient {
    /// Through r_i = exp(mean_t log r): every token's loss reaches every token (TRL). Default.
    #[default]
    Sequence,
    /// s_it = sg(r_i)·π_t/sg(π_t): token t's loss reaches token t only (verl `gspo`). Equal to
    /// `sequence` for one advantage per sequence.
    Token,
}

/// Token-level ratios (PPO) or one length-normalised ratio per sequence (GSPO).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingLevel {
    /// r_it = exp(log π − log π_old).
    #[default]
    Token,
    /// r_i = exp(mean_t (log π − log π_old)) (GSPO).
    Sequence,
}

/// The sampler/trainer mismatch correction (TRL's `vllm_importance_sampling_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplerIsMode {
    /// Per-token weight clamped to [C_min, C_max].
    TokenTruncate,
    /// Per-token weight zeroed outside [C_min, C_max].
    TokenMask,
    /// Per-sequence weight clamped to [C_min, C_max].
    SequenceTruncate,
    /// Per-sequence weight zeroed outside [C_min, C_max] (TRL default).
    #[default]
    SequenceMask,
}

/// KL estimator of the reference penalty (Schulman's k1/k2/k3; verl names accepted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// log π − log π_ref.
    #[serde(alias = "kl")]
    K1,
    /// ½ (log π − log π_ref)².
    #[serde(alias = "mse")]
    K2,
    /// e^{log π_ref − log π} − (log π_ref − log π) − 1 (TRL's only estimator). Unclamped, as
    /// TRL; verl's `low_var_kl` also clamps the value to [−10, 10] (same below that).
    #[default]
    #[serde(alias = "low_var_kl")]
    K3,
    /// \|log π − log π_ref\| (verl `abs`).
    Abs,
    /// k3's value with k2's gradient (straight-through; verl `k3+`).
    #[serde(rename = "k3+", alias = "low_var_kl+")]
    K3Plus,
    /// k1's value with k2's gradient (straight-through; verl `k1+`).
    #[serde(rename = "k1+", alias = "kl+")]
    K1Plus,
}

/// verl's `loss_agg_mode`; when set in [`RlvrConfig::loss_agg_mode`] it replaces the
/// aggregation implied by `loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LossAggMode {
    /// Σ mℓ / global active tokens.
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Σ_i Σ_t mℓ / global sequences.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Σ_i (Σ_t mℓ / (Σ_t m + 1e-8)) / global sequences.
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Σ_i Σ_t mℓ / global sequences / `loss_scale_factor` (default: T) (verl 0.9).
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
}

/// Knobs of the RLVR channel. Keys follow TRL's `GRPOConfig` where TRL has the option;
/// defaults are TRL's (`trl` main, 1.10.0.dev0, `grpo_config.py`) unless noted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlvrConfig {
    /// Aggregation / surrogate family. TRL default `dapo`.
    pub loss_type: LossType,
    /// Lower clip ε (and upper when `epsilon_high` is unset). TRL default 0.2.
    pub epsilon: f64,
    /// Upper clip ε_high (DAPO clip-higher; the IS cap for `cispo`). TRL default: `epsilon`.
    pub epsilon_high: Option<f64>,
    /// Two-sided clipping cap δ on the unclipped ratio (INTELLECT-2). TRL default none.
    pub delta: Option<f64>,
    /// verl's dual-clip PPO for negative advantages. Not in TRL; default off.
    pub dual_clip: bool,
    /// verl's `clip_ratio_c` (dual-clip bound, > 1). verl default 3.0.
    pub clip_ratio_c: f64,
    /// `token` or `sequence` (GSPO). TRL default `token`.
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// KL coefficient β. TRL default 0.0 (then no reference log-probs are needed).
    pub beta: f64,
    /// KL estimator. TRL uses k3 only; default k3.
    pub kl_estimator: KlEstimator,
    /// Multiply the KL term by the ratio r (TRL `use_bias_correction_kl`). Default false.
    pub use_bias_correction_kl: bool,
    /// Entropy bonus coefficient: loss −= coef · mean entropy. TRL default 0.0.
    pub entropy_coef: f64,
    /// Train only on tokens whose entropy is in the top quantile. TRL default 1.0 (all).
    pub top_entropy_quantile: f64,
    /// Drop truncated completions from the loss. TRL default false.
    pub mask_truncated_completions: bool,
    /// The constant of `dr_grpo`. TRL default 512.
    pub max_completion_length: usize,
    /// SAPO τ+ for positive advantages. TRL default 1.0.
    pub sapo_temperature_pos: f64,
    /// SAPO τ− for non-positive advantages. TRL default 1.05.
    pub sapo_temperature_neg: f64,
    /// VESPO k for A ≥ 0. TRL default 2.0.
    pub vespo_k_pos: f64,
    /// VESPO λ for A ≥ 0. TRL default 3.0.
    pub vespo_lambda_pos: f64,
    /// VESPO k for A < 0. TRL default 3.0.
    pub vespo_k_neg: f64,
    /// VESPO λ for A < 0. TRL default 2.0.
    pub vespo_lambda_neg: f64,
    /// DPPO mask: drop A<0 tokens whose probability fell by more than this. PRIME-RL default 0.2.
    pub dppo_mask_low: f64,
    /// DPPO mask: drop A>0 tokens whose probability rose by more than this. PRIME-RL default 0.2.
    pub dppo_mask_high: f64,
    /// DPPO advantage temperature. PRIME-RL default 1.0.
    pub adv_tau: f64,
    /// DPPO squared-log-ratio KL coefficient. PRIME-RL default 1e-3.
    pub kl_tau: f64,
    /// Apply the sampler/trainer mismatch correction when `sampler_logprobs` are given.
    /// TRL default true (`vllm_importance_sampling_correction`).
    #[serde(alias = "vllm_importance_sampling_correction")]
    pub sampler_importance_sampling_correction: bool,
    /// Token/sequence × truncate/mask. TRL default `sequence_mask`.
    #[serde(alias = "vllm_importance_sampling_mode")]
    pub sampler_importance_sampling_mode: SamplerIsMode,
    /// C_min. TRL default none.
    #[serde(alias = "vllm_importance_sampling_clip_min")]
    pub sampler_importance_sampling_clip_min: Option<f64>,
    /// C_max. TRL default 3.0.
    #[serde(
        alias = "vllm_importance_sampling_clip_max",
        alias = "vllm_importance_sampling_cap",
        alias = "sampler_importance_sampling_cap"
    )]
    pub sampler_importance_sampling_clip_max: Option<f64>,
    /// verl aggregation override (`token-mean`, `seq-mean-token-sum`, ...). Default none.
    pub loss_agg_mode: Option<LossAggMode>,
    /// Divisor of verl's `seq-mean-token-sum-norm` (default: T of the micro-batch).
    pub loss_scale_factor: Option<f64>,
    /// Aggregation of the policy-gradient term only (the KL term keeps `loss_agg_mode`). verl's
    /// `sapo` always uses `seq-mean-token-mean`. Default none (= `loss_agg_mode`).
    pub policy_loss_agg_mode: Option<LossAggMode>,
    /// Entropy-bonus normaliser. Default `micro_batch_mean` (TRL 1.16).
    pub entropy_normalization: EntropyNormalization,
    /// Clamp the token log-ratio log π − log π_old to [−c, c] before exp (no gradient outside).
    /// TRL none (default); verl `vanilla`, `sapo`, `cispo`: 20.
    pub log_ratio_clamp: Option<f64>,
    /// Upper clamp of GSPO's sequence log-ratio (no gradient above). TRL none (default); verl 10.
    pub sequence_log_ratio_max: Option<f64>,
    /// Gradient path of the GSPO ratio. TRL `sequence` (default); verl `token`.
    pub sequence_ratio_gradient: SequenceRatioGradient,
    /// Clamp the per-token KL estimate to [−c, c] (no gradient outside). TRL none (default);
    /// verl `low_var_kl`/`k3`: 10.
    pub kl_clamp: Option<f64>,
    /// CISPO weight clipping. TRL `upper_cap` (default); verl `two_sided`.
    pub cispo_clip_mode: CispoClipMode,
    /// TRL's off-policy sequence mask (DeepSeek-V3.2): drop tokens with A < 0 of sequences
    /// whose mean (log μ − log π) over the mask exceeds this (μ = sampler, else old log-probs).
    /// Default none.
    pub off_policy_mask_threshold: Option<f64>,
    /// verl `clip_cov_ratio`: at most max(⌊ratio·N_active⌋, 1) tokens lose their gradient.
    /// verl default 2e-4.
    pub clip_cov_ratio: f64,
    /// verl `clip_cov_lb`. Default 1.0.
    pub clip_cov_lb: f64,
    /// verl `clip_cov_ub`. Default 5.0.
    pub clip_cov_ub: f64,
    /// verl `kl_cov_ratio`: the top max(⌊ratio·N_active⌋, 1) tokens get the \|log r\| penalty.
    /// verl default 2e-4.
    pub kl_cov_ratio: f64,
    /// verl `ppo_kl_coef` of `kl_cov`. Default 1.0.
    pub ppo_kl_coef: f64,
}

impl Default for RlvrConfig {
    fn default() -> Self {
        Self {
            loss_type: LossType::Dapo,
            epsilon: 0.2,
            epsilon_high: None,
            delta: None,
            dual_clip: false,
            clip_ratio_c: 3.0,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            beta: 0.0,
            kl_estimator: KlEstimator::K3,
            use_bias_correction_kl: false,
            entropy_coef: 0.0,
            top_entropy_quantile: 1.0,
            mask_truncated_completions: false,
            max_completion_length: 512,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            vespo_k_pos: 2.0,
            vespo_lambda_pos: 3.0,
            vespo_k_neg: 3.0,
            vespo_lambda_neg: 2.0,
            dppo_mask_low: 0.2,
            dppo_mask_high: 0.2,
            adv_tau: 1.0,
            kl_tau: 1e-3,
            sampler_importance_sampling_correction: true,
            sampler_importance_sampling_mode: SamplerIsMode::SequenceMask,
            sampler_importance_sampling_clip_min: None,
            sampler_importance_sampling_clip_max: Some(3.0),
            loss_agg_mode: None,
            loss_scale_factor: None,
            policy_loss_agg_mode: None,
            entropy_normalization: EntropyNormalization::MicroBatchMean,
            log_ratio_clamp: None,
            sequence_log_ratio_max: None,
            sequence_ratio_gradient: SequenceRatioGradient::Sequence,
            kl_clamp: None,
            cispo_clip_mode: CispoClipMode::UpperCap,
            off_policy_mask_threshold: None,
            clip_cov_ratio: 2e-4,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 2e-4,
            ppo_kl_coef: 1.0,
        }
    }
}

impl RlvrConfig {
    /// ε_high, falling back to ε.
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }

    /// Check ranges; errors name the key.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &'static str, message: String| Err(LossError::Config { key, message });
        if !(self.epsilon >= 0.0) {
            return bad("epsilon", format!("must be >= 0, got {}", self.epsilon));
        }
        if !(self.epsilon_high() >= 0.0) {
            return bad(
                "epsilon_high",
                format!("must be >= 0, got {}", self.epsilon_high()),
            );
        }
        if self.dual_clip && !(self.clip_ratio_c > 1.0) {
            return bad(
                "clip_ratio_c",
                format!("must be > 1, got {}", self.clip_ratio_c),
            );
        }
        if !(self.top_entropy_quantile > 0.0 && self.top_entropy_quantile <= 1.0) {
            return bad(
                "top_entropy_quantile",
                format!("must be in (0, 1], got {}", self.top_entropy_quantile),
            );
        }
        if self.loss_type == LossType::DrGrpo && self.max_completion_length == 0 {
            return bad("max_completion_length", "must be > 0 for dr_grpo".into());
        }
        // Every other number: finite, and in its range. NaN fails each `!(x >= lo)` test, where
        // `x < lo` would let it through to a loss that is NaN every step.
        let at_least = |key: &'static str, x: f64, lo: f64| -> Result<()> {
            if !(x >= lo && x.is_finite()) {
                return bad(key, format!("must be finite and >= {lo}, got {x}"));
            }
            Ok(())
        };
        let above = |key: &'static str, x: f64| -> Result<()> {
            if !(x > 0.0 && x.is_finite()) {
                return bad(key, format!("must be finite and > 0, got {x}"));
            }
            Ok(())
        };
        above("sapo_temperature_pos", self.sapo_temperature_pos)?;
        above("sapo_temperature_neg", self.sapo_temperature_neg)?;
        at_least("beta", self.beta, 0.0)?;
        at_least("entropy_coef", self.entropy_coef, 0.0)?;
        at_least("kl_tau", self.kl_tau, 0.0)?;
        above("adv_tau", self.adv_tau)?;
        at_least("dppo_mask_low", self.dppo_mask_low, 0.0)?;
        at_least("dppo_mask_high", self.dppo_mask_high, 0.0)?;
        above("vespo_k_pos", self.vespo_k_pos)?;
        above("vespo_lambda_pos", self.vespo_lambda_pos)?;
        above("vespo_k_neg", self.vespo_k_neg)?;
        above("vespo_lambda_neg", self.vespo_lambda_neg)?;
        if let Some(f) = self.loss_scale_factor {
            above("loss_scale_factor", f)?;
        }
        // The clip bounds: ε and ε_high finite (∞ would switch clipping off unasked), δ > 1 (a
        // cap on the ratio below 1 clips every token that gained probability).
        at_least("epsilon", self.epsilon, 0.0)?;
        at_least("epsilon_high", self.epsilon_high(), 0.0)?;
        if let Some(d) = self.delta {
            if !(d > 1.0 && d.is_finite()) {
                return bad("delta", format!("must be finite and > 1, got {d}"));
            }
        }
        if self.dual_clip && !self.clip_ratio_c.is_finite() {
            return bad(
                "clip_ratio_c",
                format!("must be finite, got {}", self.clip_ratio_c),
            );
        }
        // Clamps to [−c, c]: c > 0.
        for (key, c) in [
            ("log_ratio_clamp", self.log_ratio_clamp),
            ("kl_clamp", self.kl_clamp),
        ] {
            if let Some(c) = c {
                above(key, c)?;
            }
        }
        for (key, x) in [
            ("sequence_log_ratio_max", self.sequence_log_ratio_max),
            ("off_policy_mask_threshold", self.off_policy_mask_threshold),
        ] {
            if let Some(x) = x {
                if !x.is_finite() {
                    return bad(key, format!("must be finite, got {x}"));
                }
            }
        }
        for (key, x) in [
            ("clip_cov_ratio", self.clip_cov_ratio),
            ("kl_cov_ratio", self.kl_cov_ratio),
        ] {
            if !(0.0..=1.0).contains(&x) {
                return bad(key, format!("must be in [0, 1], got {x}"));
            }
        }
        if !(self.clip_cov_lb.is_finite()
            && self.clip_cov_ub.is_finite()
            && self.clip_cov_lb < self.clip_cov_ub)
        {
            return bad(
                "clip_cov_lb",
                format!(
                    "clip_cov_lb = {} and clip_cov_ub = {} must be finite with lb < ub",
                    self.clip_cov_lb, self.clip_cov_ub
                ),
            );
        }
        at_least("ppo_kl_coef", self.ppo_kl_coef, 0.0)?;
        let (lo, hi) = (
            self.sampler_importance_sampling_clip_min,
            self.sampler_importance_sampling_clip_max,
        );
        if let Some(lo) = lo {
            at_least("sampler_importance_sampling_clip_min", lo, 0.0)?;
        }
        if let Some(hi) = hi {
            above("sampler_importance_sampling_clip_max", hi)?;
            if let Some(lo) = lo {
                if lo > hi {
                    return bad(
                        "sampler_importance_sampling_clip_min",
                        format!("{lo} is above sampler_importance_sampling_clip_max = {hi}"),
                    );
                }
            }
        }
        Ok(())
    }

    pub(crate) fn uses_global_tokens(&self) -> bool {
        matches!(
            self.loss_type,
            LossType::Dapo
                | LossType::Cispo
                | LossType::Vespo
                | LossType::Dppo
                | LossType::Gpg
                | LossType::ClipCov
                | LossType::KlCov
        )
    }
}

/// Metrics of one RLVR loss evaluation (local micro-batch values, TRL's definitions).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RlvrMetrics {
    /// The returned loss (policy loss − entropy bonus).
    pub loss: f64,
    /// The policy part (incl. the KL term), before the entropy bonus.
    pub policy_loss: f64,
    /// Active tokens in this micro-batch (after truncation masking).
    pub active_tokens: f64,
    /// Fraction of active tokens with r < 1−ε and A < 0 (sequence level: of sequences).
    pub clip_ratio_low: f64,
    /// Fraction with r > 1+ε_high and A > 0.
    pub clip_ratio_high: f64,
    /// Either of the two.
    pub clip_ratio_region: f64,
    /// Masked mean of the ratio r.
    pub mean_ratio: f64,
    /// `cispo`: fraction of tokens with r > ε_high and A > 0.
    pub cispo_clip_ratio: Option<f64>,
    /// Mean KL estimate to the reference (when β ≠ 0).
    pub kl: Option<f64>,
    /// Masked mean entropy (when entropies are given).
    pub entropy: Option<f64>,
    /// Fraction of active tokens dropped by `top_entropy_quantile`.
    pub entropy_masked_fraction: Option<f64>,
    /// Mean sampler IS weight (over active tokens, or sequences at sequence level).
    pub is_weight_mean: Option<f64>,
    /// Min sampler IS weight.
    pub is_weight_min: Option<f64>,
    /// Max sampler IS weight.
    pub is_weight_max: Option<f64>,
    /// Fraction of IS weights outside [C_min, C_max] (truncated or masked).
    pub is_weight_clipped_fraction: Option<f64>,
    /// `dppo`: fraction of active tokens masked by the trust region.
    pub dppo_masked_fraction: Option<f64>,
    /// `dppo`: masked with A < 0 (probability fell too much).
    pub dppo_masked_low: Option<f64>,
    /// `dppo`: masked with A > 0 (probability rose too much).
    pub dppo_masked_high: Option<f64>,
    /// Sampler/trainer mismatch (when sampler log-probs are given): mean of r − log r − 1 with
    /// r = π_old/μ over active tokens (k3 estimate of KL(μ‖π_old)), π_old being the trainer's
    /// recomputed log-probs before this step's updates.
    pub mismatch_kl: Option<f64>,
    /// Sampler/trainer mismatch: max |log π_old − log μ| over active tokens (0 when the
    /// sampler's log-probs equal the trainer's bitwise).
    pub mismatch_max_abs: Option<f64>,
    /// `vespo`: mean of the gamma weights φ over sequences.
    pub vespo_phi_mean: Option<f64>,
}
