//! Per-token pieces of the RLVR loss: VESPO's weights (TRL), DPPO (PRIME-RL), the KL term and
//! verl's `clip_cov`, `kl_cov`, `geo_mean`. Their clip and selection decisions come from
//! [`super::gates`], as tensors on the inputs' device.
use super::gates::{clip_cov_gates, dppo_gates, geo_mean_gates, kl_cov_selection};
use super::{KlEstimator, RlvrConfig, RlvrMetrics};
use crate::inputs::LossInputs;
use crate::util::{clamp_const, gate, keep_or, masked_mean_value, select};
use crate::{LossError, Result};
use candle_core::Tensor;

/// TRL's `get_gamma_weights` per token (φ detached, `[B, T]`):
/// log w_i = clamp(Σ_t m·clamp(log r, ±20) plus Σ_t clamp(log w_IS), log 1e-8, 20),
/// φ = exp(λ + k·log w − λ·w) with (k, λ) by the sign of the token's advantage (0 where not
/// finite).
pub(super) fn vespo_phi(
    cfg: &RlvrConfig,
    lp: &Tensor,
    old: &Tensor,
    m: &Tensor,
    adv: &Tensor,
    is_weights: Option<&Tensor>,
) -> Result<Tensor> {
    let lower = (1e-8f64).ln();
    let mut s = ((lp.detach() - old)?.clamp(-20.0, 20.0)? * m)?.sum_keepdim(1)?;
    if let Some(w) = is_weights {
        s = (s + w.log()?.clamp(lower, 20.0)?.sum_keepdim(1)?)?;
    }
    let log_w = s.clamp(lower, 20.0)?;
    let w = log_w.exp()?;
    let pos = adv.ge(0.0)?;
    let k = select(&pos, cfg.vespo_k_pos, cfg.vespo_k_neg, adv)?;
    let lam = select(
        &pos,
        cfg.vespo_lambda_pos.max(1e-4),
        cfg.vespo_lambda_neg.max(1e-4),
        adv,
    )?;
    let p = ((&lam + k.broadcast_mul(&log_w)?)? - lam.broadcast_mul(&w)?)?.exp()?;
    keep_or(&p.lt(f64::INFINITY)?, &p, 0.0)
}

/// PRIME-RL `default_loss_fn` per token: −keep·τ_A·A·exp(log π − log μ) + τ_KL·(log π − log μ)².
pub(super) fn dppo_per_token(
    inputs: &LossInputs,
    cfg: &RlvrConfig,
    lp: &Tensor,
    old_t: &Tensor,
    m: &Tensor,
    adv: &Tensor,
    metrics: &mut RlvrMetrics,
) -> Result<Tensor> {
    // PRIME-RL: the ratio is against the inference (sampler) log-probs.
    let inf_t = match &inputs.sampler_logprobs {
        Some(s) => s.detach().to_dtype(lp.dtype())?,
        None => old_t.clone(),
    };
    let (keep, masked, low, high) = dppo_gates(lp, &inf_t, m, adv, cfg)?;
    metrics.dppo_masked_fraction = Some(masked_mean_value(&masked, m)?);
    metrics.dppo_masked_low = Some(masked_mean_value(&low, m)?);
    metrics.dppo_masked_high = Some(masked_mean_value(&high, m)?);
    let lr = (lp - &inf_t)?;
    let pg = ((keep * (adv * cfg.adv_tau)?)? * lr.exp()?)?;
    Ok(((lr.sqr()? * cfg.kl_tau)? - pg)?)
}

/// The per-token KL estimate k(π, π_ref) (× r with `use_bias_correction_kl`).
pub(super) fn kl_term(
    inputs: &LossInputs,
    cfg: &RlvrConfig,
    lp: &Tensor,
    coef1: &Tensor,
) -> Result<Tensor> {
    let r = inputs
        .ref_logprobs
        .as_ref()
        .ok_or_else(|| LossError::Missing {
            field: "ref_logprobs",
            reason: format!("beta = {} adds a KL penalty to the reference", cfg.beta),
        })?;
    let r = r.detach().to_dtype(lp.dtype())?;
    let diff = (lp - &r)?;
    let k2 = || -> Result<Tensor> { Ok((diff.sqr()? * 0.5)?) };
    let k3 = || -> Result<Tensor> {
        let d = (&r - lp)?;
        let d = match cfg.kl_clamp {
            // verl's low_var_kl also clamps log π_ref − log π to [−20, 20] first.
            Some(_) => clamp_const(&d, -20.0, 20.0)?,
            None => d,
        };
        let k = ((d.exp()? - &d)? - 1.0)?;
        Ok(match cfg.kl_clamp {
            Some(c) => clamp_const(&k, -c, c)?,
            None => k,
        })
    };
    let straight_through = |v: Tensor| -> Result<Tensor> {
        let b = k2()?;
        Ok(((&b - b.detach())? + v.detach())?)
    };
    let mut kl = match cfg.kl_estimator {
        KlEstimator::K1 => diff.clone(),
        KlEstimator::K2 => k2()?,
        KlEstimator::K3 => k3()?,
        KlEstimator::Abs => {
            let d = diff.detach();
            let sign = (gate(&d.gt(0.0)?, &d)? - gate(&d.lt(0.0)?, &d)?)?;
            (&diff * sign)?
        }
        KlEstimator::K3Plus => straight_through(k3()?)?,
        KlEstimator::K1Plus => straight_through(diff.clone())?,
    };
    if cfg.use_bias_correction_kl {
        kl = (kl * coef1)?;
    }
    Ok(kl)
}

/// verl `compute_policy_loss_clip_cov` per token (gates: [`clip_cov_gates`]).
pub(super) fn clip_cov_per_token(
    cfg: &RlvrConfig,
    lp: &Tensor,
    coef1: &Tensor,
    m: &Tensor,
    adv: &Tensor,
) -> Result<Tensor> {
    let (g, c, corr) = clip_cov_gates(coef1, lp, m, adv, cfg)?;
    let coef = ((coef1 * g)? + c)?;
    Ok(((coef * adv)?.neg()? * corr)?)
}

/// verl `compute_policy_loss_kl_cov` per token: −A·r, plus `ppo_kl_coef`·\|log r\| on the top
/// max(⌊ratio·N⌋, 1) active tokens by (A − mean A)(log π − mean log π) ([`kl_cov_selection`]).
pub(super) fn kl_cov_per_token(
    cfg: &RlvrConfig,
    lp: &Tensor,
    coef1: &Tensor,
    log_ratio: &Tensor,
    m: &Tensor,
    adv: &Tensor,
) -> Result<Tensor> {
    let sel = kl_cov_selection(log_ratio, lp, m, adv, cfg)?;
    Ok(((coef1 * adv)?.neg()? + (log_ratio * sel)?)?)
}

/// verl `compute_policy_loss_geo_mean` (GMPO): −mean_i Ā_i·exp(Σ_t m·x_t / (Σ_t m + 1e-8)),
/// x = sgn(A)·min(sgn(A)·log r, sgn(A)·clamp(log r, −ε, ε_high)), Ā_i = Σ_t m·A / (Σ_t m + 1e-8);
/// the mean runs over all B rows (a plain mean, no accumulation scaling).
pub(super) fn geo_mean_loss(
    cfg: &RlvrConfig,
    log_ratio: &Tensor,
    m: &Tensor,
    adv: &Tensor,
) -> Result<Tensor> {
    let (g, c) = geo_mean_gates(log_ratio, adv, cfg)?;
    let x = ((log_ratio * g)? + c)?;
    let lens = (m.sum(1)? + 1e-8)?;
    let abar = ((adv * m)?.sum(1)?.neg()? / &lens)?;
    let ratio = ((x * m)?.sum(1)? / lens)?.exp()?;
    Ok((ratio * abar)?.mean_all()?)
}
