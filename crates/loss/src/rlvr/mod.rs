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
use crate::util::{const1, const2, host2, masked_sum, sigmoid};
use crate::{LossError, Result};
use candle_core::{DType, Tensor};
mod config;
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

/// `x·g + c` with host gates: the value `x` where `lo ≤ x_h ≤ hi`, else the bound as a constant
/// (zero gradient outside, as torch.clamp).
pub(crate) fn clamp_const(
    x: &Tensor,
    x_h: &[Vec<f64>],
    lo: f64,
    hi: f64,
) -> Result<(Tensor, Vec<Vec<f64>>)> {
    let g: Vec<Vec<f64>> = x_h
        .iter()
        .map(|r| {
            r.iter()
                .map(|&v| f64::from(u8::from(v >= lo && v <= hi)))
                .collect()
        })
        .collect();
    let c: Vec<Vec<f64>> = x_h
        .iter()
        .map(|r| {
            r.iter()
                .map(|&v| {
                    if v < lo {
                        lo
                    } else if v > hi {
                        hi
                    } else {
                        0.0
                    }
                })
                .collect()
        })
        .collect();
    let h = x_h
        .iter()
        .map(|r| r.iter().map(|v| v.clamp(lo, hi)).collect())
        .collect();
    Ok((((x * const2(&g, x)?)? + const2(&c, x)?)?, h))
}

fn rows_of(v: &[f64], t: usize) -> Vec<Vec<f64>> {
    v.iter().map(|&x| vec![x; t]).collect()
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
    let m = inputs.effective_mask(cfg.mask_truncated_completions)?;
    let mask_t = const2(&m, lp)?;
    let adv = inputs.advantage_rows()?;
    let adv_t = const2(&adv, lp)?;
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
    let raw_lr = (lp - &old_t)?;
    let raw_lr_h: Vec<Vec<f64>> = (0..b)
        .map(|i| (0..t).map(|j| lp_h[i][j] - old_h[i][j]).collect())
        .collect();
    let (log_ratio, lr_h) = match cfg.log_ratio_clamp {
        Some(c) => clamp_const(&raw_lr, &raw_lr_h, -c, c)?,
        None => (raw_lr.clone(), raw_lr_h.clone()),
    };
    let (coef1, coef1_h): (Tensor, Vec<Vec<f64>>) = if seq_level {
        let lens: Vec<f64> = seq_len.iter().map(|l| l.max(1.0)).collect();
        let s: Vec<f64> = (0..b)
            .map(|i| (0..t).map(|j| raw_lr_h[i][j] * m[i][j]).sum::<f64>() / lens[i])
            .collect();
        let lw = match cfg.sequence_ratio_gradient {
            SequenceRatioGradient::Sequence => {
                let lens_t = const1(&lens, lp)?.unsqueeze(1)?;
                (&raw_lr * &mask_t)?
                    .sum_keepdim(1)?
                    .broadcast_div(&lens_t)?
                    .broadcast_as((b, t))?
                    .contiguous()?
            }
            SequenceRatioGradient::Token => ((lp - lp.detach())? + const2(&rows_of(&s, t), lp)?)?,
        };
        let s_rows = rows_of(&s, t);
        let (lw, lw_h) = match cfg.sequence_log_ratio_max {
            Some(mx) => clamp_const(&lw, &s_rows, f64::NEG_INFINITY, mx)?,
            None => (lw, s_rows),
        };
        let host = lw_h
            .iter()
            .map(|r| r.iter().map(|x| x.exp()).collect())
            .collect();
        (lw.exp()?, host)
    } else {
        let host = lr_h
            .iter()
            .map(|r| r.iter().map(|x| x.exp()).collect())
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

    // Always measured when the sampler's log-probs are known: the same log π_old − log μ the
    // importance-sampling correction below weights by.
    if let Some(smp) = &inputs.sampler_logprobs {
        let (max_abs, kl) = terms::sampler_mismatch(&old_h, &host2(smp)?, &m);
        metrics.mismatch_max_abs = Some(max_abs);
        metrics.mismatch_kl = Some(kl);
    }
    let is_weights = terms::sampler_is_weights(inputs, cfg, &old_h, &m, &mut metrics)?;

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

    // Per-token surrogate (geo_mean yields its sequence-mean scalar directly).
    let mut pg_scalar: Option<Tensor> = None;
    let mut per_token = match cfg.loss_type {
        LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo | LossType::Luspo => {
            // −min(r̃·A, clip(r)·A) with r̃ = min(r, δ); each token's chosen coefficient is
            // g·r + c with g ∈ {0, 1} and c a constant (the clip bound when clipped).
            let mut g = vec![vec![0.0; t]; b];
            let mut c = vec![vec![0.0; t]; b];
            let (mut low, mut high) = (vec![vec![0.0; t]; b], vec![vec![0.0; t]; b]);
            for i in 0..b {
                for j in 0..t {
                    let a = adv[i][j];
                    let r = coef1_h[i][j];
                    let (g1, v1) = match cfg.delta {
                        Some(d) if r > d => (0.0, d),
                        _ => (1.0, r),
                    };
                    let v2 = r.clamp(1.0 - eps_low, 1.0 + eps_high);
                    let g2 = f64::from(u8::from(r >= 1.0 - eps_low && r <= 1.0 + eps_high));
                    let (mut gg, mut vv) = if v1 * a <= v2 * a { (g1, v1) } else { (g2, v2) };
                    if cfg.dual_clip && a < 0.0 && vv > cfg.clip_ratio_c {
                        gg = 0.0;
                        vv = cfg.clip_ratio_c;
                    }
                    g[i][j] = gg;
                    c[i][j] = if gg > 0.0 { 0.0 } else { vv };
                    low[i][j] = f64::from(u8::from(r < 1.0 - eps_low && a < 0.0));
                    high[i][j] = f64::from(u8::from(r > 1.0 + eps_high && a > 0.0));
                }
            }
            let region: Vec<Vec<f64>> = low
                .iter()
                .zip(&high)
                .map(|(l, h)| l.iter().zip(h).map(|(x, y)| x.max(*y)).collect())
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
                .map(|r| {
                    r.iter()
                        .map(|&x| match cfg.cispo_clip_mode {
                            CispoClipMode::UpperCap => x.min(eps_high),
                            CispoClipMode::TwoSided => x.clamp(1.0 - eps_low, 1.0 + eps_high),
                        })
                        .collect()
                })
                .collect();
            let clipped: Vec<Vec<f64>> = (0..b)
                .map(|i| {
                    (0..t)
                        .map(|j| f64::from(u8::from(coef1_h[i][j] > eps_high && adv[i][j] > 0.0)))
                        .collect()
                })
                .collect();
            metrics.cispo_clip_ratio = Some(level_mean(&clipped));
            ((const2(&capped, lp)? * &adv_t)? * lp)?.neg()?
        }
        LossType::Sapo => {
            let taus: Vec<Vec<f64>> = adv
                .iter()
                .map(|r| {
                    r.iter()
                        .map(|&a| {
                            if a > 0.0 {
                                cfg.sapo_temperature_pos
                            } else {
                                cfg.sapo_temperature_neg
                            }
                        })
                        .collect()
                })
                .collect();
            let tau_t = const2(&taus, lp)?;
            let gate = sigmoid(&((&coef1 - 1.0)? * &tau_t)?)?;
            let soft = ((gate * 4.0)? / &tau_t)?;
            (soft * &adv_t)?.neg()?
        }
        LossType::Vespo => {
            let phi = terms::vespo_phi(cfg, &lp_h, &old_h, &m, &adv, is_weights.as_deref());
            let n_phi: f64 = phi.iter().map(|r| r[0]).sum();
            metrics.vespo_phi_mean = Some(n_phi / b.max(1) as f64);
            ((const2(&phi, lp)? * &adv_t)? * lp)?.neg()?
        }
        LossType::Dppo => terms::dppo_per_token(
            inputs,
            cfg,
            lp,
            &old_t,
            &lp_h,
            &m,
            &adv,
            &adv_t,
            &mut metrics,
        )?,
        LossType::Gpg => (lp * &adv_t)?.neg()?,
        LossType::ClipCov => {
            terms::clip_cov_per_token(cfg, lp, &coef1, &coef1_h, &lp_h, &m, &adv, &adv_t)?
        }
        LossType::KlCov => {
            terms::kl_cov_per_token(cfg, lp, &coef1, &lr_h, &log_ratio, &lp_h, &m, &adv, &adv_t)?
        }
        LossType::GeoMean => {
            pg_scalar = Some(terms::geo_mean_loss(cfg, lp, &log_ratio, &lr_h, &m, &adv)?);
            lp.zeros_like()?
        }
    };

    if let Some(thr) = cfg.off_policy_mask_threshold {
        let keep = terms::off_policy_mask(inputs, &lp_h, &old_h, &m, &adv, thr)?;
        per_token = (per_token * const2(&keep, lp)?)?;
    }
    if let Some(em) = &entropy_mask {
        per_token = (per_token * const2(em, lp)?)?;
    }
    if let Some(w) = &is_weights {
        if cfg.loss_type != LossType::Vespo {
            per_token = (per_token * const2(w, lp)?)?;
        }
    }
    let kl = if cfg.beta != 0.0 {
        let kl = terms::kl_term(inputs, cfg, lp, &coef1)?;
        metrics.kl = Some(masked_mean(&host2(&kl)?, &m));
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
                let lens: Vec<f64> = seq_len.iter().map(|l| l.max(1.0)).collect();
                let lens_t = const1(&lens, lp)?;
                (((x * &mask_t)?.sum(1)? / lens_t)?.mean_all()? / nmb)?
            }
            LossType::Bnpo => {
                let c: f64 = seq_len.iter().sum();
                ((masked_sum(x, &mask_t)? / c.max(1.0))? / nmb)?
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
        let local_mean = || -> Result<Tensor> {
            let c: f64 = eff.iter().flatten().sum();
            Ok(((masked_sum(&h, &eff_t)? / c.max(1.0))? / nmb)?)
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
    metrics.loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok((loss, metrics))
}
