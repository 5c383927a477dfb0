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
//! | `gpg`, `clip_cov`, `kl_cov` | verl's (see [`LossType`]) | Σ mℓ / global active tokens |
//! | `geo_mean` | verl's GMPO (see [`LossType`]) | mean over the B rows |
//!
//! Advantages may be `[B]` or per token `[B, T]`. Options where TRL, verl and PRIME-RL differ
//! (entropy normalisation, KL and log-ratio clamps, GSPO gradient path, CISPO clipping, policy
//! aggregation) are fields of [`RlvrConfig`] with TRL's value as the default.
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
use crate::util::{clamp_const, masked_mean_value, masked_sum, select, sigmoid, value};
use crate::{LossError, Result};
use candle_core::Tensor;
mod config;
mod gates;
mod terms;
pub use config::*;

/// Aggregate a per-token loss ℓ `[B, T]` with a verl `loss_agg_mode` (verl `agg_loss`) and the
/// step's normaliser; `mask` m is the 0/1 loss mask `[B, T]`:
/// `token-mean` Σ mℓ / N_tok(global); `seq-mean-token-sum` Σ_i Σ_t mℓ / N_seq(global);
/// `seq-mean-token-mean` Σ_i (Σ_t mℓ / (Σ_t m + 1e-8)) / N_seq(global);
/// `seq-mean-token-sum-norm` Σ mℓ / N_seq(global) / `loss_scale_factor` (default T).
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
            ((masked.sum_all()? / scale.global_sequences.max(1.0))?
                / loss_scale_factor.unwrap_or(t as f64))?
        }
    })
}

/// The RLVR loss of one micro-batch: `(scalar loss, metrics)`,
/// `L = agg(w_IS · keep_H · keep_OPSM · ℓ(r, A) + β·KL) − entropy_coef · agg_H(H)`, with the
/// per-token surrogate ℓ and the aggregation of `cfg.loss_type` (table in the module docs), w_IS
/// the sampler/trainer correction, keep_H the top-entropy mask and keep_OPSM the off-policy
/// sequence mask. Advantages may be `[B]` or per token `[B, T]`. `scale` spans the whole
/// optimizer step (see [`LossScale`]); for a step of one micro-batch use [`LossScale::local`].
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
    let dt = lp.dtype();
    let mask_t = inputs
        .effective_mask(cfg.mask_truncated_completions)?
        .to_dtype(dt)?;
    let adv_t = inputs.advantage_tensor()?.to_dtype(dt)?;
    let seq_len = mask_t.sum(1)?;
    let old_t = match &inputs.old_logprobs {
        Some(o) => o.detach().to_dtype(dt)?,
        None => lp.detach(),
    };
    let seq_level = cfg.importance_sampling_level == ImportanceSamplingLevel::Sequence;
    let mut metrics = RlvrMetrics {
        active_tokens: value(&seq_len.sum_all()?)?,
        ..Default::default()
    };

    // Ratio r (tensor with gradient).
    let raw_lr = (lp - &old_t)?;
    let log_ratio = match cfg.log_ratio_clamp {
        Some(c) => clamp_const(&raw_lr, -c, c)?,
        None => raw_lr.clone(),
    };
    let coef1 = if seq_level {
        let lens = seq_len.maximum(1.0)?.unsqueeze(1)?;
        let lw = match cfg.sequence_ratio_gradient {
            SequenceRatioGradient::Sequence => (&raw_lr * &mask_t)?
                .sum_keepdim(1)?
                .broadcast_div(&lens)?
                .broadcast_as((b, t))?
                .contiguous()?,
            SequenceRatioGradient::Token => {
                let s = (raw_lr.detach() * &mask_t)?
                    .sum_keepdim(1)?
                    .broadcast_div(&lens)?;
                (lp - lp.detach())?.broadcast_add(&s)?
            }
        };
        let lw = match cfg.sequence_log_ratio_max {
            Some(mx) => clamp_const(&lw, f64::NEG_INFINITY, mx)?,
            None => lw,
        };
        lw.exp()?
    } else {
        log_ratio.exp()?
    };
    // Metric helper: token level → masked mean; sequence level → mean over sequences.
    let level_mean = |x: &Tensor| -> Result<f64> {
        if seq_level {
            if t == 0 {
                return Ok(0.0);
            }
            Ok(value(&x.narrow(1, 0, 1)?.sum_all()?)? / (b.max(1) as f64))
        } else {
            masked_mean_value(x, &mask_t)
        }
    };
    metrics.mean_ratio = level_mean(&coef1.detach())?;

    // Always measured when the sampler's log-probs are known: the same log π_old − log μ the
    // importance-sampling correction below weights by.
    if let Some(smp) = &inputs.sampler_logprobs {
        let smp = smp.detach().to_dtype(dt)?;
        let (max_abs, kl) = gates::sampler_mismatch(&old_t, &smp, &mask_t)?;
        metrics.mismatch_max_abs = Some(max_abs);
        metrics.mismatch_kl = Some(kl);
    }
    let is_weights = gates::sampler_is_weights(inputs, cfg, &old_t, &mask_t, &mut metrics)?;

    // Top-entropy mask.
    let entropy_mask: Option<Tensor> = if cfg.top_entropy_quantile < 1.0 {
        let h = inputs
            .entropies
            .as_ref()
            .ok_or_else(|| LossError::Missing {
                field: "entropies",
                reason: "top_entropy_quantile < 1 masks tokens by entropy".into(),
            })?;
        let em = gates::high_entropy_mask(h, &mask_t, cfg.top_entropy_quantile)?;
        metrics.entropy_masked_fraction = Some(1.0 - masked_mean_value(&em, &mask_t)?);
        Some(em)
    } else {
        None
    };
    if let Some(h) = &inputs.entropies {
        metrics.entropy = Some(masked_mean_value(&h.detach().to_dtype(dt)?, &mask_t)?);
    }

    // Per-token surrogate (geo_mean yields its sequence-mean scalar directly).
    let mut pg_scalar: Option<Tensor> = None;
    let mut per_token = match cfg.loss_type {
        LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo | LossType::Luspo => {
            // −min(r̃·A, clip(r)·A) with r̃ = min(r, δ); each token's chosen coefficient is
            // g·r + c with g ∈ {0, 1} and c a constant (the clip bound when clipped).
            let cg = gates::ppo_clip_gates(&coef1, &adv_t, cfg)?;
            let region = cg.low.maximum(&cg.high)?;
            metrics.clip_ratio_low = level_mean(&cg.low)?;
            metrics.clip_ratio_high = level_mean(&cg.high)?;
            metrics.clip_ratio_region = level_mean(&region)?;
            let coef = ((&coef1 * &cg.g)? + &cg.c)?;
            (coef * &adv_t)?.neg()?
        }
        LossType::Cispo => {
            let (capped, clipped) = gates::cispo_weight(&coef1, &adv_t, cfg)?;
            metrics.cispo_clip_ratio = Some(level_mean(&clipped)?);
            ((capped * &adv_t)? * lp)?.neg()?
        }
        LossType::Sapo => {
            let tau_t = select(
                &adv_t.gt(0.0)?,
                cfg.sapo_temperature_pos,
                cfg.sapo_temperature_neg,
                lp,
            )?;
            let gate = sigmoid(&((&coef1 - 1.0)? * &tau_t)?)?;
            let soft = ((gate * 4.0)? / &tau_t)?;
            (soft * &adv_t)?.neg()?
        }
        LossType::Vespo => {
            let phi = terms::vespo_phi(cfg, lp, &old_t, &mask_t, &adv_t, is_weights.as_ref())?;
            if t > 0 {
                metrics.vespo_phi_mean =
                    Some(value(&phi.narrow(1, 0, 1)?.sum_all()?)? / b.max(1) as f64);
            }
            ((phi * &adv_t)? * lp)?.neg()?
        }
        LossType::Dppo => {
            terms::dppo_per_token(inputs, cfg, lp, &old_t, &mask_t, &adv_t, &mut metrics)?
        }
        LossType::Gpg => (lp * &adv_t)?.neg()?,
        LossType::ClipCov => terms::clip_cov_per_token(cfg, lp, &coef1, &mask_t, &adv_t)?,
        LossType::KlCov => terms::kl_cov_per_token(cfg, lp, &coef1, &log_ratio, &mask_t, &adv_t)?,
        LossType::GeoMean => {
            pg_scalar = Some(terms::geo_mean_loss(cfg, &log_ratio, &mask_t, &adv_t)?);
            lp.zeros_like()?
        }
    };

    if let Some(thr) = cfg.off_policy_mask_threshold {
        let behaviour = match &inputs.sampler_logprobs {
            Some(s) => s.detach().to_dtype(dt)?,
            None => old_t.clone(),
        };
        let keep = gates::off_policy_mask(&behaviour, lp, &mask_t, &adv_t, thr)?;
        per_token = (per_token * keep)?;
    }
    if let Some(em) = &entropy_mask {
        per_token = (per_token * em)?;
    }
    if let Some(w) = &is_weights {
        if cfg.loss_type != LossType::Vespo {
            per_token = (per_token * w)?;
        }
    }
    let kl = if cfg.beta != 0.0 {
        let kl = terms::kl_term(inputs, cfg, lp, &coef1)?;
        metrics.kl = Some(masked_mean_value(&kl, &mask_t)?);
        Some((kl * cfg.beta)?)
    } else {
        None
    };

    // Aggregation.
    let nmb = scale.num_micro_batches.max(1.0);
    let aggregate = |x: &Tensor, mode: Option<LossAggMode>| -> Result<Tensor> {
        if let Some(mode) = mode {
            return agg_loss(x, &mask_t, mode, scale, cfg.loss_scale_factor);
        }
        Ok(match cfg.loss_type {
            LossType::Grpo | LossType::Sapo => {
                let lens_t = seq_len.maximum(1.0)?;
                (((x * &mask_t)?.sum(1)? / lens_t)?.mean_all()? / nmb)?
            }
            LossType::Bnpo => {
                let c = seq_len.sum_all()?.maximum(1.0)?;
                ((masked_sum(x, &mask_t)? / c)? / nmb)?
            }
            LossType::DrGrpo => {
                let d = (b * cfg.max_completion_length) as f64;
                ((masked_sum(x, &mask_t)? / d)? / nmb)?
            }
            LossType::Luspo => ((masked_sum(x, &mask_t)? / b.max(1) as f64)? / nmb)?,
            _ => (masked_sum(x, &mask_t)? / scale.global_active_tokens.max(1.0))?,
        })
    };
    let loss = match (pg_scalar, cfg.policy_loss_agg_mode) {
        (Some(pg), _) => match &kl {
            Some(k) => (pg + aggregate(k, cfg.loss_agg_mode)?)?,
            None => pg,
        },
        (None, Some(pmode)) => {
            let pg = aggregate(&per_token, Some(pmode))?;
            match &kl {
                Some(k) => (pg + aggregate(k, cfg.loss_agg_mode)?)?,
                None => pg,
            }
        }
        (None, None) => {
            let x = match &kl {
                Some(k) => (per_token + k)?,
                None => per_token,
            };
            aggregate(&x, cfg.loss_agg_mode)?
        }
    };
    metrics.policy_loss = value(&loss)?;

    let loss = if cfg.entropy_coef != 0.0 {
        let h = inputs
            .entropies
            .as_ref()
            .ok_or_else(|| LossError::Missing {
                field: "entropies",
                reason: format!("entropy_coef = {} adds an entropy bonus", cfg.entropy_coef),
            })?;
        let h = h.to_dtype(dt)?;
        let eff_t = match &entropy_mask {
            Some(em) => (&mask_t * em)?,
            None => mask_t.clone(),
        };
        let local_mean = || -> Result<Tensor> {
            let c = eff_t.sum_all()?.maximum(1.0)?;
            Ok(((masked_sum(&h, &eff_t)? / c)? / nmb)?)
        };
        let bonus = if let Some(mode) = cfg.loss_agg_mode {
            agg_loss(&h, &eff_t, mode, scale, cfg.loss_scale_factor)?
        } else {
            match cfg.entropy_normalization {
                EntropyNormalization::MicroBatchMean => local_mean()?,
                EntropyNormalization::PolicyNormalizer if cfg.uses_global_tokens() => {
                    (masked_sum(&h, &eff_t)? / scale.global_active_tokens.max(1.0))?
                }
                EntropyNormalization::PolicyNormalizer => local_mean()?,
            }
        };
        (loss - (bonus * cfg.entropy_coef)?)?
    } else {
        loss
    };
    metrics.loss = value(&loss)?;
    Ok((loss, metrics))
}
