//! The RLVR channel: the clipped policy-gradient family of TRL's `GRPOTrainer._compute_loss`,
//! verl's `core_algos.py` and PRIME-RL's `loss.py`.
//!
//! Notation (per completion token t of sample i): `π` trainer log-prob (with gradient),
//! `π_old` old log-prob, `μ` sampler log-prob, `A_i` advantage, `m_it` loss mask,
//! `r = exp(log π − log π_old)` (token level) or
//! `r_i = exp(Σ_t m(log π − log π_old) / Σ_t m)` (sequence level, GSPO; gradient flows through
//! every token of the sequence).
//!
//! | `loss_type` | per-token loss ℓ | aggregation |
//! |---|---|---|
//! | `grpo` | −min(r·A, clip(r, 1−ε, 1+ε_high)·A) | mean_i (Σ_t mℓ / Σ_t m), ÷ micro-batches |
//! | `bnpo` | same | Σ mℓ / Σ m (local), ÷ micro-batches |
//! | `dr_grpo` | same | Σ mℓ / (B · max_completion_length), ÷ micro-batches |
//! | `dapo` | same | Σ mℓ / global active tokens |
//! | `luspo` | same (sequence level) | (1/B) Σ_i \|o_i\|·ℓ_i, ÷ micro-batches |
//! | `cispo` | −sg(min(r, ε_high))·A·log π | Σ mℓ / global active tokens |
//! | `sapo` | −σ(τ(r−1))·(4/τ)·A, τ = τ+ if A>0 else τ− | as `grpo` |
//! | `vespo` | −sg(φ(w_i))·A·log π, φ(w)=e^λ w^k e^{−λw}, w_i = Π_t r·(IS) | Σ mℓ / global active tokens |
//! | `dppo` | −keep·τ_A·A·exp(log π − log μ) + τ_KL·(log π − log μ)² | Σ mℓ / global active tokens |
//!
//! `delta` (INTELLECT-2) caps the unclipped term: r → min(r, δ) before the min. verl's
//! dual clip (`dual_clip`, `clip_ratio_c` = 3) bounds the loss of negative-advantage tokens by
//! −A·c. The KL term β·k(π, π_ref) (k1 = log π − log π_ref, k2 = ½(log π − log π_ref)²,
//! k3 = e^{log π_ref − log π} − (log π_ref − log π) − 1) is added per token before
//! aggregation (TRL). The entropy bonus subtracts `entropy_coef` × the mean entropy.
//! The sampler correction multiplies ℓ by w = exp(log π_old − log μ) (token) or
//! exp(Σ_t m(log π_old − log μ)) (sequence), truncated to [C_min, C_max] or zeroed outside
//! (TRL `vllm_importance_sampling_*`).
use crate::inputs::{LossInputs, LossScale};
use crate::util::{const2, host1, host2, masked_sum, sigmoid};
use crate::{LossError, Result};
use candle_core::{DType, Tensor};
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
    /// Σ mℓ / `loss_scale_factor` (default: T).
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
        if self.sapo_temperature_pos <= 0.0 || self.sapo_temperature_neg <= 0.0 {
            return bad("sapo_temperature_pos/neg", "must be > 0".into());
        }
        Ok(())
    }

    fn uses_global_tokens(&self) -> bool {
        matches!(
            self.loss_type,
            LossType::Dapo | LossType::Cispo | LossType::Vespo | LossType::Dppo
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
    /// `dppo`: mean mismatch KL (r − log r − 1 with r = π/μ) over active tokens.
    pub mismatch_kl: Option<f64>,
    /// `vespo`: mean of the gamma weights φ over sequences.
    pub vespo_phi_mean: Option<f64>,
}

/// Aggregate a per-token loss ℓ `[B, T]` with a verl `loss_agg_mode` (verl `agg_loss`) and the
/// step's normaliser; `mask` m is the 0/1 loss mask `[B, T]`:
/// `token-mean` Σ mℓ / N_tok(global); `seq-mean-token-sum` Σ_i Σ_t mℓ / N_seq(global);
/// `seq-mean-token-mean` Σ_i (Σ_t mℓ / (Σ_t m + 1e-8)) / N_seq(global);
/// `seq-mean-token-sum-norm` Σ mℓ / `loss_scale_factor` (default T).
pub fn agg_loss(
    per_token: &Tensor,
    mask: &Tensor,
    mode: LossAggMode,
    scale: &LossScale,
    loss_scale_factor: Option<f64>,
) -> Result<Tensor> {
    let (_, t) = mask.dims2()?;
    let masked = (per_token * mask)?;
    Ok(match mode {
        LossAggMode::TokenMean => (masked.sum_all()? / scale.global_active_tokens.max(1.0))?,
        LossAggMode::SeqMeanTokenSum => (masked.sum_all()? / scale.global_sequences.max(1.0))?,
        LossAggMode::SeqMeanTokenMean => {
            let len = (mask.sum(1)? + 1e-8)?;
            ((masked.sum(1)? / len)?.sum_all()? / scale.global_sequences.max(1.0))?
        }
        LossAggMode::SeqMeanTokenSumNorm => {
            (masked.sum_all()? / loss_scale_factor.unwrap_or(t as f64))?
        }
    })
}

/// Linear-interpolation quantile (torch.quantile's default) of a non-empty sorted slice.
fn quantile_sorted(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// TRL's `get_high_entropy_mask`: 1 where the token is active and its entropy is at least
/// the `1 − top_entropy_quantile` quantile of the active tokens' entropies.
fn high_entropy_mask(h: &[Vec<f64>], m: &[Vec<f64>], top_quantile: f64) -> Vec<Vec<f64>> {
    let mut active: Vec<f64> = h
        .iter()
        .zip(m)
        .flat_map(|(hr, mr)| {
            hr.iter()
                .zip(mr)
                .filter(|(_, &mm)| mm > 0.0)
                .map(|(&x, _)| x)
        })
        .collect();
    if active.is_empty() {
        return m.iter().map(|r| vec![0.0; r.len()]).collect();
    }
    active.sort_by(f64::total_cmp);
    let thr = quantile_sorted(&active, 1.0 - top_quantile);
    h.iter()
        .zip(m)
        .map(|(hr, mr)| {
            hr.iter()
                .zip(mr)
                .map(|(&x, &mm)| if mm > 0.0 && x * mm >= thr { 1.0 } else { 0.0 })
                .collect()
        })
        .collect()
}

/// Masked mean of host values (TRL's `global_masked_mean`, local).
fn masked_mean(x: &[Vec<f64>], m: &[Vec<f64>]) -> f64 {
    let (mut s, mut c) = (0.0, 0.0);
    for (xr, mr) in x.iter().zip(m) {
        for (&v, &mm) in xr.iter().zip(mr) {
            s += v * mm;
            c += mm;
        }
    }
    s / c.max(1.0)
}

/// The RLVR loss of one micro-batch: `(scalar loss, metrics)`,
/// `L = agg(w_IS · keep_H · ℓ(r, A) + β·KL) − entropy_coef · agg_H(H)`, with the per-token
/// surrogate ℓ and the aggregation of `cfg.loss_type` (table in the module docs), w_IS the
/// sampler/trainer correction and keep_H the top-entropy mask. `scale` spans the whole optimizer step (see [`LossScale`]); for a step of one
/// micro-batch use [`LossScale::local`].
///
/// Gradient flows only through `trainer_logprobs` (and `entropies` for the entropy bonus);
/// old, sampler and reference log-probs are detached.
pub fn rlvr_loss(
    inputs: &LossInputs,
    cfg: &RlvrConfig,
    scale: &LossScale,
) -> Result<(Tensor, RlvrMetrics)> {
    let (b, t) = inputs.validate()?;
    cfg.validate()?;
    let lp = &inputs.trainer_logprobs;
    let m = inputs.effective_mask(cfg.mask_truncated_completions)?;
    let mask_t = const2(&m, lp)?;
    let adv = host1(&inputs.advantages)?;
    let adv_rows: Vec<Vec<f64>> = adv.iter().map(|&a| vec![a; t]).collect();
    let adv_t = const2(&adv_rows, lp)?;
    let seq_len: Vec<f64> = m.iter().map(|r| r.iter().sum()).collect();
    let old_t = match &inputs.old_logprobs {
        Some(o) => o.detach().to_dtype(lp.dtype())?,
        None => lp.detach(),
    };
    let lp_h = host2(lp)?;
    let old_h = host2(&old_t)?;
    let eps_low = cfg.epsilon;
    let eps_high = cfg.epsilon_high();
    let seq_level = cfg.importance_sampling_level == ImportanceSamplingLevel::Sequence;
    let mut metrics = RlvrMetrics {
        active_tokens: seq_len.iter().sum(),
        ..Default::default()
    };

    // Ratio r (tensor with gradient) and its host value.
    let log_ratio = (lp - &old_t)?;
    let (coef1, coef1_h): (Tensor, Vec<Vec<f64>>) = if seq_level {
        let lens: Vec<f64> = seq_len.iter().map(|l| l.max(1.0)).collect();
        let lens_t = crate::util::const1(&lens, lp)?.unsqueeze(1)?;
        let lw = (&log_ratio * &mask_t)?
            .sum_keepdim(1)?
            .broadcast_div(&lens_t)?;
        let host: Vec<Vec<f64>> = (0..b)
            .map(|i| {
                let s: f64 = (0..t).map(|j| (lp_h[i][j] - old_h[i][j]) * m[i][j]).sum();
                vec![(s / lens[i]).exp(); t]
            })
            .collect();
        (lw.exp()?.broadcast_as((b, t))?.contiguous()?, host)
    } else {
        let host = (0..b)
            .map(|i| (0..t).map(|j| (lp_h[i][j] - old_h[i][j]).exp()).collect())
            .collect();
        (log_ratio.exp()?, host)
    };
    // Metric helper: token level → masked mean; sequence level → mean over sequences.
    let level_mean = |x: &[Vec<f64>]| -> f64 {
        if seq_level {
            x.iter().map(|r| r[0]).sum::<f64>() / (b.max(1) as f64)
        } else {
            masked_mean(x, &m)
        }
    };
    metrics.mean_ratio = level_mean(&coef1_h);

    // Sampler/trainer mismatch weights (host constants).
    let is_weights: Option<Vec<Vec<f64>>> = match (&inputs.sampler_logprobs, cfg.loss_type) {
        (Some(s), lt) if cfg.sampler_importance_sampling_correction && lt != LossType::Dppo => {
            let s_h = host2(s)?;
            let mode = cfg.sampler_importance_sampling_mode;
            let seq_mode = matches!(
                mode,
                SamplerIsMode::SequenceMask | SamplerIsMode::SequenceTruncate
            );
            if cfg.loss_type == LossType::Vespo && seq_mode {
                return Err(LossError::Config {
                    key: "sampler_importance_sampling_mode",
                    message: "vespo needs token_truncate or token_mask (as TRL)".into(),
                });
            }
            let lo = cfg
                .sampler_importance_sampling_clip_min
                .unwrap_or(f64::NEG_INFINITY);
            let hi = cfg
                .sampler_importance_sampling_clip_max
                .unwrap_or(f64::INFINITY);
            let mask_mode = matches!(mode, SamplerIsMode::SequenceMask | SamplerIsMode::TokenMask);
            let mut clipped = Vec::new();
            let w: Vec<Vec<f64>> = (0..b)
                .map(|i| {
                    let diffs: Vec<f64> = (0..t)
                        .map(|j| (old_h[i][j] - s_h[i][j]) * m[i][j])
                        .collect();
                    let raw: Vec<f64> = if seq_mode {
                        vec![diffs.iter().sum::<f64>().exp(); t]
                    } else {
                        diffs.iter().map(|d| d.exp()).collect()
                    };
                    let out_row: Vec<f64> = raw
                        .iter()
                        .map(|&x| if x < lo || x > hi { 1.0 } else { 0.0 })
                        .collect();
                    clipped.push(out_row);
                    raw.iter()
                        .map(|&x| {
                            if mask_mode {
                                if x < lo || x > hi {
                                    0.0
                                } else {
                                    x
                                }
                            } else {
                                x.max(lo).min(hi)
                            }
                        })
                        .collect()
                })
                .collect();
            let stat_level_seq = seq_mode;
            let sel: Vec<f64> = if stat_level_seq {
                w.iter().map(|r| r[0]).collect()
            } else {
                w.iter()
                    .zip(&m)
                    .flat_map(|(wr, mr)| {
                        wr.iter().zip(mr).filter(|(_, &x)| x > 0.0).map(|(&v, _)| v)
                    })
                    .collect()
            };
            if !sel.is_empty() {
                metrics.is_weight_mean = Some(sel.iter().sum::<f64>() / sel.len() as f64);
                metrics.is_weight_min = Some(sel.iter().copied().fold(f64::INFINITY, f64::min));
                metrics.is_weight_max = Some(sel.iter().copied().fold(f64::NEG_INFINITY, f64::max));
            }
            metrics.is_weight_clipped_fraction = Some(if stat_level_seq {
                clipped.iter().map(|r| r[0]).sum::<f64>() / b.max(1) as f64
            } else {
                masked_mean(&clipped, &m)
            });
            Some(w)
        }
        _ => None,
    };

    // Top-entropy mask.
    let ent_h = match &inputs.entropies {
        Some(e) => Some(host2(e)?),
        None => None,
    };
    let entropy_mask: Option<Vec<Vec<f64>>> = if cfg.top_entropy_quantile < 1.0 {
        let h = ent_h.as_ref().ok_or_else(|| LossError::Missing {
            field: "entropies",
            reason: "top_entropy_quantile < 1 masks tokens by entropy".into(),
        })?;
        let em = high_entropy_mask(h, &m, cfg.top_entropy_quantile);
        let kept = masked_mean(&em, &m);
        metrics.entropy_masked_fraction = Some(1.0 - kept);
        Some(em)
    } else {
        None
    };
    if let Some(h) = &ent_h {
        metrics.entropy = Some(masked_mean(h, &m));
    }

    // Per-token surrogate.
    let mut per_token = match cfg.loss_type {
        LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo | LossType::Luspo => {
            // −min(r̃·A, clip(r)·A) with r̃ = min(r, δ); each token's chosen coefficient is
            // g·r + c with g ∈ {0, 1} and c a constant (the clip bound when clipped).
            let mut g = vec![vec![0.0; t]; b];
            let mut c = vec![vec![0.0; t]; b];
            let (mut low, mut high) = (vec![vec![0.0; t]; b], vec![vec![0.0; t]; b]);
            for i in 0..b {
                let a = adv[i];
                for j in 0..t {
                    let r = coef1_h[i][j];
                    let (g1, v1) = match cfg.delta {
                        Some(d) if r > d => (0.0, d),
                        _ => (1.0, r),
                    };
                    let v2 = r.clamp(1.0 - eps_low, 1.0 + eps_high);
                    let g2 = if r >= 1.0 - eps_low && r <= 1.0 + eps_high {
                        1.0
                    } else {
                        0.0
                    };
                    let (mut gg, mut vv) = if v1 * a <= v2 * a { (g1, v1) } else { (g2, v2) };
                    if cfg.dual_clip && a < 0.0 && vv > cfg.clip_ratio_c {
                        gg = 0.0;
                        vv = cfg.clip_ratio_c;
                    }
                    g[i][j] = gg;
                    c[i][j] = if gg > 0.0 { 0.0 } else { vv };
                    low[i][j] = if r < 1.0 - eps_low && a < 0.0 {
                        1.0
                    } else {
                        0.0
                    };
                    high[i][j] = if r > 1.0 + eps_high && a > 0.0 {
                        1.0
                    } else {
                        0.0
                    };
                }
            }
            let region: Vec<Vec<f64>> = low
                .iter()
                .zip(&high)
                .map(|(l, h)| {
                    l.iter()
                        .zip(h)
                        .map(|(x, y): (&f64, &f64)| x.max(*y))
                        .collect()
                })
                .collect();
            metrics.clip_ratio_low = level_mean(&low);
            metrics.clip_ratio_high = level_mean(&high);
            metrics.clip_ratio_region = level_mean(&region);
            let coef = ((&coef1 * const2(&g, lp)?)? + const2(&c, lp)?)?;
            (coef * &adv_t)?.neg()?
        }
        LossType::Cispo => {
            let capped: Vec<Vec<f64>> = coef1_h
                .iter()
                .map(|r| r.iter().map(|x| x.min(eps_high)).collect())
                .collect();
            let clipped: Vec<Vec<f64>> = (0..b)
                .map(|i| {
                    (0..t)
                        .map(|j| {
                            if coef1_h[i][j] > eps_high && adv[i] > 0.0 {
                                1.0
                            } else {
                                0.0
                            }
                        })
                        .collect()
                })
                .collect();
            metrics.cispo_clip_ratio = Some(level_mean(&clipped));
            ((const2(&capped, lp)? * &adv_t)? * lp)?.neg()?
        }
        LossType::Sapo => {
            let taus: Vec<Vec<f64>> = adv
                .iter()
                .map(|&a| {
                    vec![
                        if a > 0.0 {
                            cfg.sapo_temperature_pos
                        } else {
                            cfg.sapo_temperature_neg
                        };
                        t
                    ]
                })
                .collect();
            let tau_t = const2(&taus, lp)?;
            let gate = sigmoid(&((&coef1 - 1.0)? * &tau_t)?)?;
            let soft = ((gate * 4.0)? / &tau_t)?;
            (soft * &adv_t)?.neg()?
        }
        LossType::Vespo => {
            let lower = (1e-8f64).ln();
            let phi: Vec<f64> = (0..b)
                .map(|i| {
                    let mut s: f64 = (0..t)
                        .map(|j| (lp_h[i][j] - old_h[i][j]).clamp(-20.0, 20.0) * m[i][j])
                        .sum();
                    if let Some(w) = &is_weights {
                        s += w[i].iter().map(|x| x.ln().clamp(lower, 20.0)).sum::<f64>();
                    }
                    let log_w = s.clamp(lower, 20.0);
                    let w = log_w.exp();
                    let (k, lam) = if adv[i] >= 0.0 {
                        (cfg.vespo_k_pos, cfg.vespo_lambda_pos)
                    } else {
                        (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
                    };
                    let lam = lam.max(1e-4);
                    let p = (lam + k * log_w - lam * w).exp();
                    if p.is_finite() {
                        p
                    } else {
                        0.0
                    }
                })
                .collect();
            metrics.vespo_phi_mean = Some(phi.iter().sum::<f64>() / b.max(1) as f64);
            let phi_rows: Vec<Vec<f64>> = phi.iter().map(|&p| vec![p; t]).collect();
            ((const2(&phi_rows, lp)? * &adv_t)? * lp)?.neg()?
        }
        LossType::Dppo => {
            // PRIME-RL: the ratio is against the inference (sampler) log-probs.
            let inf_t = match &inputs.sampler_logprobs {
                Some(s) => s.detach().to_dtype(lp.dtype())?,
                None => old_t.clone(),
            };
            let inf_h = host2(&inf_t)?;
            let mut keep = vec![vec![0.0; t]; b];
            let mut masked = vec![vec![0.0; t]; b];
            let (mut mlow, mut mhigh) = (vec![vec![0.0; t]; b], vec![vec![0.0; t]; b]);
            let mut mkl = vec![vec![0.0; t]; b];
            for i in 0..b {
                for j in 0..t {
                    let d = lp_h[i][j].exp() - inf_h[i][j].exp();
                    let inv_high = d > cfg.dppo_mask_high;
                    let inv_low = d < -cfg.dppo_mask_low;
                    let is_m = if adv[i] > 0.0 { inv_high } else { inv_low };
                    masked[i][j] = f64::from(u8::from(is_m));
                    keep[i][j] = if is_m { 0.0 } else { m[i][j] };
                    mlow[i][j] = f64::from(u8::from(adv[i] < 0.0 && inv_low));
                    mhigh[i][j] = f64::from(u8::from(adv[i] > 0.0 && inv_high));
                    let lr = lp_h[i][j] - inf_h[i][j];
                    mkl[i][j] = lr.exp() - lr - 1.0;
                }
            }
            metrics.dppo_masked_fraction = Some(masked_mean(&masked, &m));
            metrics.dppo_masked_low = Some(masked_mean(&mlow, &m));
            metrics.dppo_masked_high = Some(masked_mean(&mhigh, &m));
            metrics.mismatch_kl = Some(masked_mean(&mkl, &m));
            let lr = (lp - &inf_t)?;
            let pg = ((const2(&keep, lp)? * (&adv_t * cfg.adv_tau)?)? * lr.exp()?)?;
            ((lr.sqr()? * cfg.kl_tau)? - pg)?
        }
    };

    if let Some(em) = &entropy_mask {
        per_token = (per_token * const2(em, lp)?)?;
    }
    if let Some(w) = &is_weights {
        if cfg.loss_type != LossType::Vespo {
            per_token = (per_token * const2(w, lp)?)?;
        }
    }
    if cfg.beta != 0.0 {
        let r = inputs
            .ref_logprobs
            .as_ref()
            .ok_or_else(|| LossError::Missing {
                field: "ref_logprobs",
                reason: format!("beta = {} adds a KL penalty to the reference", cfg.beta),
            })?;
        let r = r.detach().to_dtype(lp.dtype())?;
        let mut kl = match cfg.kl_estimator {
            KlEstimator::K1 => (lp - &r)?,
            KlEstimator::K2 => ((lp - &r)?.sqr()? * 0.5)?,
            KlEstimator::K3 => {
                let d = (&r - lp)?;
                ((d.exp()? - &d)? - 1.0)?
            }
        };
        if cfg.use_bias_correction_kl {
            kl = (kl * &coef1)?;
        }
        let kl_h = host2(&kl)?;
        metrics.kl = Some(masked_mean(&kl_h, &m));
        per_token = (per_token + (kl * cfg.beta)?)?;
    }

    // Aggregation.
    let nmb = scale.num_micro_batches.max(1.0);
    let loss = if let Some(mode) = cfg.loss_agg_mode {
        agg_loss(&per_token, &mask_t, mode, scale, cfg.loss_scale_factor)?
    } else {
        match cfg.loss_type {
            LossType::Grpo | LossType::Sapo => {
                let lens: Vec<f64> = seq_len.iter().map(|l| l.max(1.0)).collect();
                let lens_t = crate::util::const1(&lens, lp)?;
                (((&per_token * &mask_t)?.sum(1)? / lens_t)?.mean_all()? / nmb)?
            }
            LossType::Bnpo => {
                let c: f64 = seq_len.iter().sum();
                ((masked_sum(&per_token, &mask_t)? / c.max(1.0))? / nmb)?
            }
            LossType::DrGrpo => {
                let d = (b * cfg.max_completion_length) as f64;
                ((masked_sum(&per_token, &mask_t)? / d)? / nmb)?
            }
            LossType::Luspo => ((masked_sum(&per_token, &mask_t)? / b.max(1) as f64)? / nmb)?,
            LossType::Dapo | LossType::Cispo | LossType::Vespo | LossType::Dppo => {
                (masked_sum(&per_token, &mask_t)? / scale.global_active_tokens.max(1.0))?
            }
        }
    };
    metrics.policy_loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;

    let loss = if cfg.entropy_coef != 0.0 {
        let h = inputs
            .entropies
            .as_ref()
            .ok_or_else(|| LossError::Missing {
                field: "entropies",
                reason: format!("entropy_coef = {} adds an entropy bonus", cfg.entropy_coef),
            })?;
        let h = h.to_dtype(lp.dtype())?;
        let eff: Vec<Vec<f64>> = match &entropy_mask {
            Some(em) => m
                .iter()
                .zip(em)
                .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x * y).collect())
                .collect(),
            None => m.clone(),
        };
        let eff_t = const2(&eff, lp)?;
        let bonus = if let Some(mode) = cfg.loss_agg_mode {
            agg_loss(&h, &eff_t, mode, scale, cfg.loss_scale_factor)?
        } else if cfg.uses_global_tokens() {
            (masked_sum(&h, &eff_t)? / scale.global_active_tokens.max(1.0))?
        } else {
            let c: f64 = eff.iter().flatten().sum();
            ((masked_sum(&h, &eff_t)? / c.max(1.0))? / nmb)?
        };
        (loss - (bonus * cfg.entropy_coef)?)?
    } else {
        loss
    };
    metrics.loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok((loss, metrics))
}
