//! The per-token gates of the RLVR loss: which tokens a clip, mask or selection keeps, and
//! the sampler importance-sampling weights. Every gate is a `[B, T]` tensor decided by
//! comparisons on detached tensors on the inputs' device; only single numbers (metrics,
//! counts, an order statistic) are read back. The loss multiplies these constants into the
//! differentiable terms (see `terms` and the channel in `mod.rs`).
//!
//! Conventions: `m` is the float `[B, T]` effective loss mask, `adv` the `[B, T]` advantages,
//! both in the trainer log-probs' dtype; returned gates are floats of that dtype unless named
//! `*_cond` (0/1 `u8`).
use super::{CispoClipMode, LossType, RlvrConfig, RlvrMetrics, SamplerIsMode};
use crate::inputs::LossInputs;
use crate::util::{
    and, ceil_in_dtype, full_like, gate, inclusive_cumsum, keep_or, kth_smallest,
    masked_mean_value, not, or, select, value,
};
use crate::{LossError, Result};
use candle_core::{DType, Tensor};

/// The chosen branch of the clipped surrogate −min(r̃·A, clip(r, 1−ε, 1+ε_high)·A) per token,
/// with r̃ = min(r, δ) and verl's dual clip: coefficient `g·r + c` (g ∈ {0, 1}, c the bound
/// when clipped), and the clip indicators of the metrics.
pub(crate) struct ClipGates {
    /// 1 where the gradient flows through r.
    pub g: Tensor,
    /// The constant coefficient where it does not (0 where `g` = 1).
    pub c: Tensor,
    /// 1 where r < 1 − ε and A < 0.
    pub low: Tensor,
    /// 1 where r > 1 + ε_high and A > 0.
    pub high: Tensor,
}

/// [`ClipGates`] of the ratio value `r` (detached) and the advantages.
pub(crate) fn ppo_clip_gates(r: &Tensor, adv: &Tensor, cfg: &RlvrConfig) -> Result<ClipGates> {
    let r = r.detach();
    let (lo, hi) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high());
    let (g1, v1) = match cfg.delta {
        Some(d) => {
            let over = r.gt(d)?;
            (select(&over, 0.0, 1.0, &r)?, keep_or(&not(&over)?, &r, d)?)
        }
        None => (full_like(&r, 1.0)?, r.clone()),
    };
    let v2 = r.clamp(lo, hi)?;
    let g2 = gate(&and(&r.ge(lo)?, &r.le(hi)?)?, &r)?;
    let first = (&v1 * adv)?.le(&(&v2 * adv)?)?;
    let mut g = first.where_cond(&g1, &g2)?;
    let mut v = first.where_cond(&v1, &v2)?;
    if cfg.dual_clip {
        let dual = and(&adv.lt(0.0)?, &v.gt(cfg.clip_ratio_c)?)?;
        g = keep_or(&not(&dual)?, &g, 0.0)?;
        v = keep_or(&not(&dual)?, &v, cfg.clip_ratio_c)?;
    }
    let c = keep_or(&g.le(0.0)?, &v, 0.0)?;
    Ok(ClipGates {
        g,
        c,
        low: gate(&and(&r.lt(lo)?, &adv.lt(0.0)?)?, &r)?,
        high: gate(&and(&r.gt(hi)?, &adv.gt(0.0)?)?, &r)?,
    })
}

/// CISPO's detached IS weight (min(r, ε_high), or clip(r, 1−ε, 1+ε_high) two-sided) and its
/// clip indicator (r > ε_high and A > 0).
pub(crate) fn cispo_weight(r: &Tensor, adv: &Tensor, cfg: &RlvrConfig) -> Result<(Tensor, Tensor)> {
    let r = r.detach();
    let eps_high = cfg.epsilon_high();
    let capped = match cfg.cispo_clip_mode {
        CispoClipMode::UpperCap => r.minimum(eps_high)?,
        CispoClipMode::TwoSided => r.clamp(1.0 - cfg.epsilon, 1.0 + eps_high)?,
    };
    let clipped = gate(&and(&r.gt(eps_high)?, &adv.gt(0.0)?)?, &r)?;
    Ok((capped, clipped))
}

/// TRL's `get_high_entropy_mask`: 1 where the token is active and its entropy is at least the
/// `1 − top_quantile` quantile (linear interpolation, torch.quantile's default) of the active
/// tokens' entropies; all 0 when no token is active.
pub(crate) fn high_entropy_mask(h: &Tensor, m: &Tensor, top_quantile: f64) -> Result<Tensor> {
    let h = h.detach().to_dtype(m.dtype())?;
    let active = m.gt(0.0)?;
    let n = value(&active.to_dtype(DType::F64)?.sum_all()?)? as usize;
    if n == 0 {
        return Ok(m.zeros_like()?);
    }
    let pos = (1.0 - top_quantile) * (n - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    let v_lo = kth_smallest(&h, &active, lo)?;
    let v_hi = if hi == lo {
        v_lo
    } else {
        kth_smallest(&h, &active, hi)?
    };
    let thr = v_lo + (v_hi - v_lo) * (pos - lo as f64);
    let above = (&h * m)?.ge(ceil_in_dtype(thr, h.dtype()))?;
    gate(&and(&active, &above)?, m)
}

/// TRL `get_off_policy_mask` per token: keep iff A ≥ 0 or the row's
/// mean_t m·(log μ − log π) ≤ `threshold` (μ the sampler's log-probs, else π_old).
pub(crate) fn off_policy_mask(
    behaviour: &Tensor,
    lp: &Tensor,
    m: &Tensor,
    adv: &Tensor,
    threshold: f64,
) -> Result<Tensor> {
    let n = m.sum_keepdim(1)?.maximum(1.0)?;
    let kl = ((behaviour - lp.detach())? * m)?
        .sum_keepdim(1)?
        .broadcast_div(&n)?;
    let close = kl.le(threshold)?.broadcast_as(adv.shape())?;
    gate(&or(&adv.ge(0.0)?, &close)?, m)
}

/// The sampler/trainer mismatch on the active tokens: `(max |log π_old − log μ|, mean of
/// r − log r − 1)` with r = π_old/μ (the k3 estimate of KL(μ‖π), tokens being drawn from μ);
/// `(0, 0)` when no token is active.
pub(crate) fn sampler_mismatch(old: &Tensor, sampler: &Tensor, m: &Tensor) -> Result<(f64, f64)> {
    if m.elem_count() == 0 {
        return Ok((0.0, 0.0));
    }
    // A metric only: computed in f64 whatever the inputs' dtype.
    let active = m.gt(0.0)?;
    let m = m.to_dtype(DType::F64)?;
    let d = (old.to_dtype(DType::F64)? - sampler.to_dtype(DType::F64)?)?;
    let max_abs = value(&keep_or(&active, &d.abs()?, 0.0)?.max_all()?)?.max(0.0);
    let k3 = keep_or(&active, &((d.exp()? - &d)? - 1.0)?, 0.0)?;
    Ok((max_abs, masked_mean_value(&k3, &m)?))
}

/// TRL's `vllm_importance_sampling_*` weights w = exp(log π_old − log μ) (token or sequence,
/// broadcast over the row), truncated or masked to [C_min, C_max]; `None` without sampler
/// log-probs or when disabled. Fills the `is_weight_*` metrics.
pub(crate) fn sampler_is_weights(
    inputs: &LossInputs,
    cfg: &RlvrConfig,
    old: &Tensor,
    m: &Tensor,
    metrics: &mut RlvrMetrics,
) -> Result<Option<Tensor>> {
    let (b, t) = inputs.dims()?;
    let s = match (&inputs.sampler_logprobs, cfg.loss_type) {
        (Some(s), lt) if cfg.sampler_importance_sampling_correction && lt != LossType::Dppo => {
            s.detach().to_dtype(old.dtype())?
        }
        _ => return Ok(None),
    };
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
    let diffs = ((old - &s)? * m)?;
    let raw = if seq_mode {
        diffs
            .sum_keepdim(1)?
            .exp()?
            .broadcast_as((b, t))?
            .contiguous()?
    } else {
        diffs.exp()?
    };
    let outside = or(&raw.lt(lo)?, &raw.gt(hi)?)?;
    let w = if mask_mode {
        keep_or(&not(&outside)?, &raw, 0.0)?
    } else {
        raw.maximum(lo)?.minimum(hi)?
    };
    let outside = gate(&outside, &w)?;
    if seq_mode {
        if b > 0 && t > 0 {
            let first = w.narrow(1, 0, 1)?;
            metrics.is_weight_mean = Some(value(&first.sum_all()?)? / b as f64);
            metrics.is_weight_min = Some(value(&first.min_all()?)?);
            metrics.is_weight_max = Some(value(&first.max_all()?)?);
        }
        metrics.is_weight_clipped_fraction = Some(if b > 0 && t > 0 {
            value(&outside.narrow(1, 0, 1)?.sum_all()?)? / b as f64
        } else {
            0.0
        });
    } else {
        let active = m.gt(0.0)?;
        let n = value(&active.to_dtype(DType::F64)?.sum_all()?)?;
        if n > 0.0 {
            metrics.is_weight_mean = Some(value(&keep_or(&active, &w, 0.0)?.sum_all()?)? / n);
            metrics.is_weight_min = Some(value(&keep_or(&active, &w, f64::INFINITY)?.min_all()?)?);
            metrics.is_weight_max =
                Some(value(&keep_or(&active, &w, f64::NEG_INFINITY)?.max_all()?)?);
        }
        metrics.is_weight_clipped_fraction = Some(masked_mean_value(&outside, m)?);
    }
    Ok(Some(w))
}

/// PRIME-RL's DPPO probability-difference mask: a token is masked when A > 0 and
/// π − π_inf > `dppo_mask_high`, or A ≤ 0 and π − π_inf < −`dppo_mask_low`. Returns
/// `(keep = m where not masked, masked, masked_low (A < 0), masked_high (A > 0))`.
pub(crate) fn dppo_gates(
    lp: &Tensor,
    inference: &Tensor,
    m: &Tensor,
    adv: &Tensor,
    cfg: &RlvrConfig,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let d = (lp.detach().exp()? - inference.exp()?)?;
    let inv_high = d.gt(cfg.dppo_mask_high)?;
    let inv_low = d.lt(-cfg.dppo_mask_low)?;
    let pos = adv.gt(0.0)?;
    let masked = pos.where_cond(&inv_high, &inv_low)?;
    let keep = keep_or(&not(&masked)?, m, 0.0)?;
    Ok((
        keep,
        gate(&masked, m)?,
        gate(&and(&adv.lt(0.0)?, &inv_low)?, m)?,
        gate(&and(&pos, &inv_high)?, m)?,
    ))
}

/// The first `limit` set entries of the `u8` condition `cond`, in row-major order (the rest
/// cleared).
fn first_in_row_major(cond: &Tensor, limit: f64) -> Result<Tensor> {
    let counts = inclusive_cumsum(&cond.flatten_all()?.to_dtype(DType::F32)?)?;
    and(cond, &counts.le(limit)?.reshape(cond.shape())?)
}

/// verl `compute_policy_loss_clip_cov`'s gates: the PPO branch (`g·r + c` of
/// max(−A·r, −A·clip(r))) and `corr`, 0 on the tokens that lose their gradient: active, not
/// clipped by the original rule, covariance (A − mean A)(log π − mean log π) in
/// (`clip_cov_lb`, `clip_cov_ub`), at most max(⌊ratio·N⌋, 1) of them. Where more qualify,
/// verl picks them at random (`torch.randperm`); this takes the first ones in row-major order.
pub(crate) fn clip_cov_gates(
    r: &Tensor,
    lp: &Tensor,
    m: &Tensor,
    adv: &Tensor,
    cfg: &RlvrConfig,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (r, lp) = (r.detach(), lp.detach());
    let (lo, hi) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high());
    let n = m.sum_all()?;
    let n_val = value(&n)?;
    let denom = (n + 1e-8)?;
    let ma = ((adv * m)?.sum_all()? / &denom)?;
    let ml = ((&lp * m)?.sum_all()? / &denom)?;
    let v2 = r.clamp(lo, hi)?;
    let neg_a = adv.neg()?;
    let unclipped = (&neg_a * &r)?;
    let clipped = (&neg_a * &v2)?;
    let g = or(&unclipped.ge(&clipped)?, &and(&r.ge(lo)?, &r.le(hi)?)?)?;
    let c = keep_or(&not(&g)?, &v2, 0.0)?;
    let active = m.gt(0.0)?;
    let by_origin = and(&clipped.gt(&unclipped)?, &active)?;
    let cov = (adv.broadcast_sub(&ma)? * lp.broadcast_sub(&ml)?)?;
    let qualifies = and(
        &and(&active, &not(&by_origin)?)?,
        &and(&cov.gt(cfg.clip_cov_lb)?, &cov.lt(cfg.clip_cov_ub)?)?,
    )?;
    let clip_num = ((cfg.clip_cov_ratio * n_val) as usize).max(1);
    let taken = first_in_row_major(&qualifies, clip_num as f64)?;
    Ok((gate(&g, m)?, c, select(&taken, 0.0, 1.0, m)?))
}

/// verl `compute_policy_loss_kl_cov`'s selection: `ppo_kl_coef`·sgn(log r) on the top
/// max(⌊ratio·N⌋, 1) active tokens by covariance (A − mean A)(log π − mean log π) (ties in
/// row-major order, as a stable descending sort), 0 elsewhere.
pub(crate) fn kl_cov_selection(
    log_ratio: &Tensor,
    lp: &Tensor,
    m: &Tensor,
    adv: &Tensor,
    cfg: &RlvrConfig,
) -> Result<Tensor> {
    let lp = lp.detach();
    let valid = m.gt(0.0)?;
    let nv = value(&valid.to_dtype(DType::F64)?.sum_all()?)? as usize;
    if nv == 0 {
        return Ok(m.zeros_like()?);
    }
    let ma = (keep_or(&valid, adv, 0.0)?.sum_all()? / nv as f64)?;
    let ml = (keep_or(&valid, &lp, 0.0)?.sum_all()? / nv as f64)?;
    let cov = (adv.broadcast_sub(&ma)? * lp.broadcast_sub(&ml)?)?;
    let k = (((nv as f64) * cfg.kl_cov_ratio) as usize).clamp(1, nv);
    let thr = kth_smallest(&cov, &valid, nv - k)?;
    let above = and(&valid, &cov.gt(thr)?)?;
    let n_above = value(&above.to_dtype(DType::F64)?.sum_all()?)?;
    let ties = first_in_row_major(&and(&valid, &cov.eq(thr)?)?, k as f64 - n_above)?;
    let chosen = gate(&or(&above, &ties)?, m)?;
    let lr = log_ratio.detach();
    let sign = (gate(&lr.gt(0.0)?, m)? - gate(&lr.lt(0.0)?, m)?)?;
    Ok(((chosen * sign)? * cfg.ppo_kl_coef)?)
}

/// verl GMPO's sign-aware clip of log r per token as `g·x + c`: with x_c = clamp(x, −ε,
/// ε_high), A > 0 keeps x where x ≤ x_c, A < 0 where x ≥ x_c, else the constant x_c; A = 0
/// gives 0.
pub(crate) fn geo_mean_gates(
    log_ratio: &Tensor,
    adv: &Tensor,
    cfg: &RlvrConfig,
) -> Result<(Tensor, Tensor)> {
    let x = log_ratio.detach();
    let xc = x.clamp(-cfg.epsilon, cfg.epsilon_high())?;
    let (pos, neg) = (adv.gt(0.0)?, adv.lt(0.0)?);
    let g = or(&and(&pos, &x.le(&xc)?)?, &and(&neg, &x.ge(&xc)?)?)?;
    let bound = or(&and(&pos, &x.gt(&xc)?)?, &and(&neg, &x.lt(&xc)?)?)?;
    Ok((gate(&g, &x)?, keep_or(&bound, &xc, 0.0)?))
}

#[cfg(test)]
mod tests;
