//! Per-token pieces of the RLVR loss: the sampler IS weights and VESPO (TRL), DPPO (PRIME-RL),
//! the KL term, the off-policy sequence mask (TRL) and verl's `clip_cov`, `kl_cov`, `geo_mean`.
use super::{
    clamp_const, masked_mean, KlEstimator, LossType, RlvrConfig, RlvrMetrics, SamplerIsMode,
};
use crate::inputs::LossInputs;
use crate::util::{const2, host2};
use crate::{LossError, Result};
use candle_core::Tensor;

/// The sampler/trainer mismatch on the active tokens (mask `m` > 0): `(max |log π − log μ|,
/// mean of r − log r − 1)` with r = π/μ (the k3 estimate of KL(μ‖π), tokens being drawn from
/// μ); `(0, 0)` when no token is active.
pub(super) fn sampler_mismatch(
    trainer_h: &[Vec<f64>],
    sampler_h: &[Vec<f64>],
    m: &[Vec<f64>],
) -> (f64, f64) {
    let mut max_abs = 0f64;
    let mut k3 = vec![vec![0.0; m.first().map_or(0, |r| r.len())]; m.len()];
    for (i, row) in m.iter().enumerate() {
        for (j, &w) in row.iter().enumerate() {
            if w > 0.0 {
                let d = trainer_h[i][j] - sampler_h[i][j];
                max_abs = max_abs.max(d.abs());
                k3[i][j] = d.exp() - d - 1.0;
            }
        }
    }
    (max_abs, masked_mean(&k3, m))
}

/// TRL's `vllm_importance_sampling_*` weights w = exp(log π_old − log μ) (token or sequence),
/// truncated or masked to [C_min, C_max]; `None` without sampler log-probs or when disabled.
pub(super) fn sampler_is_weights(
    inputs: &LossInputs,
    cfg: &RlvrConfig,
    old_h: &[Vec<f64>],
    m: &[Vec<f64>],
    metrics: &mut RlvrMetrics,
) -> Result<Option<Vec<Vec<f64>>>> {
    let (b, t) = inputs.dims()?;
    Ok(match (&inputs.sampler_logprobs, cfg.loss_type) {
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
                    .zip(m)
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
                masked_mean(&clipped, m)
            });
            Some(w)
        }
        _ => None,
    })
}

/// TRL's `get_gamma_weights` per token (φ detached):
/// log w_i = clamp(Σ_t m·clamp(log r, ±20) plus Σ_t clamp(log w_IS), log 1e-8, 20),
/// φ = exp(λ + k·log w − λ·w) with (k, λ) by the sign of the token's advantage.
pub(super) fn vespo_phi(
    cfg: &RlvrConfig,
    lp_h: &[Vec<f64>],
    old_h: &[Vec<f64>],
    m: &[Vec<f64>],
    adv: &[Vec<f64>],
    is_weights: Option<&[Vec<f64>]>,
) -> Vec<Vec<f64>> {
    let lower = (1e-8f64).ln();
    let t = m.first().map_or(0, |r| r.len());
    (0..m.len())
        .map(|i| {
            let mut s: f64 = (0..t)
                .map(|j| (lp_h[i][j] - old_h[i][j]).clamp(-20.0, 20.0) * m[i][j])
                .sum();
            if let Some(w) = is_weights {
                s += w[i].iter().map(|x| x.ln().clamp(lower, 20.0)).sum::<f64>();
            }
            let log_w = s.clamp(lower, 20.0);
            let w = log_w.exp();
            (0..t)
                .map(|j| {
                    let (k, lam) = if adv[i][j] >= 0.0 {
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
                .collect()
        })
        .collect()
}

/// PRIME-RL `default_loss_fn` per token: −keep·τ_A·A·exp(log π − log μ) + τ_KL·(log π − log μ)².
#[allow(clippy::too_many_arguments)]
pub(super) fn dppo_per_token(
    inputs: &LossInputs,
    cfg: &RlvrConfig,
    lp: &Tensor,
    old_t: &Tensor,
    lp_h: &[Vec<f64>],
    m: &[Vec<f64>],
    adv: &[Vec<f64>],
    adv_t: &Tensor,
    metrics: &mut RlvrMetrics,
) -> Result<Tensor> {
    let (b, t) = (m.len(), m.first().map_or(0, |r| r.len()));
    // PRIME-RL: the ratio is against the inference (sampler) log-probs.
    let inf_t = match &inputs.sampler_logprobs {
        Some(s) => s.detach().to_dtype(lp.dtype())?,
        None => old_t.clone(),
    };
    let inf_h = host2(&inf_t)?;
    let mut keep = vec![vec![0.0; t]; b];
    let mut masked = vec![vec![0.0; t]; b];
    let (mut mlow, mut mhigh) = (vec![vec![0.0; t]; b], vec![vec![0.0; t]; b]);
    for i in 0..b {
        for j in 0..t {
            let a = adv[i][j];
            let d = lp_h[i][j].exp() - inf_h[i][j].exp();
            let inv_high = d > cfg.dppo_mask_high;
            let inv_low = d < -cfg.dppo_mask_low;
            let is_m = if a > 0.0 { inv_high } else { inv_low };
            masked[i][j] = f64::from(u8::from(is_m));
            keep[i][j] = if is_m { 0.0 } else { m[i][j] };
            mlow[i][j] = f64::from(u8::from(a < 0.0 && inv_low));
            mhigh[i][j] = f64::from(u8::from(a > 0.0 && inv_high));
        }
    }
    metrics.dppo_masked_fraction = Some(masked_mean(&masked, m));
    metrics.dppo_masked_low = Some(masked_mean(&mlow, m));
    metrics.dppo_masked_high = Some(masked_mean(&mhigh, m));
    let lr = (lp - &inf_t)?;
    let pg = ((const2(&keep, lp)? * (adv_t * cfg.adv_tau)?)? * lr.exp()?)?;
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
    let diff_h = host2(&diff)?;
    let k2 = || -> Result<Tensor> { Ok((diff.sqr()? * 0.5)?) };
    let k3 = || -> Result<Tensor> {
        let d = (&r - lp)?;
        let d = match cfg.kl_clamp {
            // verl's low_var_kl also clamps log π_ref − log π to [−20, 20] first.
            Some(_) => clamp_const(&d, &host2(&d)?, -20.0, 20.0)?.0,
            None => d,
        };
        let k = ((d.exp()? - &d)? - 1.0)?;
        Ok(match cfg.kl_clamp {
            Some(c) => clamp_const(&k, &host2(&k)?, -c, c)?.0,
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
            let sg: Vec<Vec<f64>> = diff_h
                .iter()
                .map(|r| {
                    r.iter()
                        .map(|x| x.signum() * f64::from(u8::from(*x != 0.0)))
                        .collect()
                })
                .collect();
            (&diff * const2(&sg, lp)?)?
        }
        KlEstimator::K3Plus => straight_through(k3()?)?,
        KlEstimator::K1Plus => straight_through(diff.clone())?,
    };
    if cfg.use_bias_correction_kl {
        kl = (kl * coef1)?;
    }
    Ok(kl)
}

/// TRL `get_off_policy_mask` per token: keep iff A ≥ 0 or mean_t m·(log μ − log π) ≤ threshold.
pub(super) fn off_policy_mask(
    inputs: &LossInputs,
    lp_h: &[Vec<f64>],
    old_h: &[Vec<f64>],
    m: &[Vec<f64>],
    adv: &[Vec<f64>],
    thr: f64,
) -> Result<Vec<Vec<f64>>> {
    let s_h = match &inputs.sampler_logprobs {
        Some(s) => host2(s)?,
        None => old_h.to_vec(),
    };
    Ok((0..m.len())
        .map(|i| {
            let n: f64 = m[i].iter().sum();
            let kl: f64 = (0..m[i].len())
                .map(|j| (s_h[i][j] - lp_h[i][j]) * m[i][j])
                .sum::<f64>()
                / n.max(1.0);
            adv[i]
                .iter()
                .map(|&a| f64::from(u8::from(a >= 0.0 || kl <= thr)))
                .collect()
        })
        .collect())
}

/// `g·r + c` coefficients of max(−A·r, −A·clip(r)) (the PPO surrogate's chosen branch).
fn ppo_branch(r: f64, a: f64, lo: f64, hi: f64) -> (f64, f64) {
    let v2 = r.clamp(lo, hi);
    if -a * r >= -a * v2 || (r >= lo && r <= hi) {
        (1.0, 0.0)
    } else {
        (0.0, v2)
    }
}

/// verl `compute_policy_loss_clip_cov` per token. Where more tokens qualify than
/// max(⌊ratio·N⌋, 1), verl picks them at random (`torch.randperm`); this takes the first ones
/// in row-major order.
#[allow(clippy::too_many_arguments)]
pub(super) fn clip_cov_per_token(
    cfg: &RlvrConfig,
    lp: &Tensor,
    coef1: &Tensor,
    coef1_h: &[Vec<f64>],
    lp_h: &[Vec<f64>],
    m: &[Vec<f64>],
    adv: &[Vec<f64>],
    adv_t: &Tensor,
) -> Result<Tensor> {
    let (b, t) = (m.len(), m.first().map_or(0, |r| r.len()));
    let (lo, hi) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high());
    let n: f64 = m.iter().flatten().sum();
    let mean = |x: &[Vec<f64>]| -> f64 {
        x.iter()
            .flatten()
            .zip(m.iter().flatten())
            .map(|(v, w)| v * w)
            .sum::<f64>()
            / (n + 1e-8)
    };
    let (ma, ml) = (mean(adv), mean(lp_h));
    let clip_num = ((cfg.clip_cov_ratio * n) as usize).max(1);
    let (mut g, mut c, mut corr) = (
        vec![vec![0.0; t]; b],
        vec![vec![0.0; t]; b],
        vec![vec![1.0; t]; b],
    );
    let mut taken = 0;
    for i in 0..b {
        for j in 0..t {
            let (r, a) = (coef1_h[i][j], adv[i][j]);
            let (gg, cc) = ppo_branch(r, a, lo, hi);
            g[i][j] = gg;
            c[i][j] = cc;
            let by_origin = -a * r.clamp(lo, hi) > -a * r && m[i][j] > 0.0;
            let cov = (a - ma) * (lp_h[i][j] - ml);
            if m[i][j] > 0.0
                && !by_origin
                && cov > cfg.clip_cov_lb
                && cov < cfg.clip_cov_ub
                && taken < clip_num
            {
                corr[i][j] = 0.0;
                taken += 1;
            }
        }
    }
    let coef = ((coef1 * const2(&g, lp)?)? + const2(&c, lp)?)?;
    Ok(((coef * adv_t)?.neg()? * const2(&corr, lp)?)?)
}

/// verl `compute_policy_loss_kl_cov` per token: −A·r, plus `ppo_kl_coef`·\|log r\| on the top
/// max(⌊ratio·N⌋, 1) active tokens by (A − mean A)(log π − mean log π).
#[allow(clippy::too_many_arguments)]
pub(super) fn kl_cov_per_token(
    cfg: &RlvrConfig,
    lp: &Tensor,
    coef1: &Tensor,
    lr_h: &[Vec<f64>],
    log_ratio: &Tensor,
    lp_h: &[Vec<f64>],
    m: &[Vec<f64>],
    adv: &[Vec<f64>],
    adv_t: &Tensor,
) -> Result<Tensor> {
    let (b, t) = (m.len(), m.first().map_or(0, |r| r.len()));
    let valid: Vec<(usize, usize)> = (0..b)
        .flat_map(|i| (0..t).map(move |j| (i, j)))
        .filter(|&(i, j)| m[i][j] > 0.0)
        .collect();
    let mut sel = vec![vec![0.0; t]; b];
    if !valid.is_empty() {
        let nv = valid.len() as f64;
        let ma = valid.iter().map(|&(i, j)| adv[i][j]).sum::<f64>() / nv;
        let ml = valid.iter().map(|&(i, j)| lp_h[i][j]).sum::<f64>() / nv;
        let mut cov: Vec<(f64, (usize, usize))> = valid
            .iter()
            .map(|&(i, j)| ((adv[i][j] - ma) * (lp_h[i][j] - ml), (i, j)))
            .collect();
        cov.sort_by(|x, y| y.0.total_cmp(&x.0));
        let k = ((nv * cfg.kl_cov_ratio) as usize).max(1);
        for &(_, (i, j)) in cov.iter().take(k) {
            sel[i][j] =
                cfg.ppo_kl_coef * lr_h[i][j].signum() * f64::from(u8::from(lr_h[i][j] != 0.0));
        }
    }
    Ok(((coef1 * adv_t)?.neg()? + (log_ratio * const2(&sel, lp)?)?)?)
}

/// verl `compute_policy_loss_geo_mean` (GMPO): −mean_i Ā_i·exp(Σ_t m·x_t / (Σ_t m + 1e-8)),
/// x = sgn(A)·min(sgn(A)·log r, sgn(A)·clamp(log r, −ε, ε_high)), Ā_i = Σ_t m·A / (Σ_t m + 1e-8);
/// the mean runs over all B rows (a plain mean, no accumulation scaling).
pub(super) fn geo_mean_loss(
    cfg: &RlvrConfig,
    lp: &Tensor,
    log_ratio: &Tensor,
    lr_h: &[Vec<f64>],
    m: &[Vec<f64>],
    adv: &[Vec<f64>],
) -> Result<Tensor> {
    let (b, t) = (m.len(), m.first().map_or(0, |r| r.len()));
    let (lo, hi) = (-cfg.epsilon, cfg.epsilon_high());
    let (mut g, mut c) = (vec![vec![0.0; t]; b], vec![vec![0.0; t]; b]);
    for i in 0..b {
        for j in 0..t {
            let (x, a) = (lr_h[i][j], adv[i][j]);
            let xc = x.clamp(lo, hi);
            if a > 0.0 {
                if x <= xc {
                    g[i][j] = 1.0
                } else {
                    c[i][j] = xc
                }
            } else if a < 0.0 {
                if x >= xc {
                    g[i][j] = 1.0
                } else {
                    c[i][j] = xc
                }
            }
        }
    }
    let x = ((log_ratio * const2(&g, lp)?)? + const2(&c, lp)?)?;
    let mask_t = const2(m, lp)?;
    let lens: Vec<f64> = m.iter().map(|r| r.iter().sum::<f64>() + 1e-8).collect();
    let abar: Vec<f64> = (0..b)
        .map(|i| -(0..t).map(|j| adv[i][j] * m[i][j]).sum::<f64>() / lens[i])
        .collect();
    let lens_t = crate::util::const1(&lens, lp)?;
    let ratio = ((x * mask_t)?.sum(1)? / lens_t)?.exp()?;
    Ok((ratio * crate::util::const1(&abar, lp)?)?.mean_all()?)
}
