//! The trace-replay channel: DPO-family preference losses on (chosen = passing teacher trace,
//! rejected = failing on-policy rollout of the same prompt) pairs, and token-level forward KL
//! to the teachers' recorded top-K distributions on the teacher traces.
//!
//! DPO (TRL `DPOTrainer._compute_loss`): with h_c = log π(c) − log π_ref(c),
//! h_r = log π(r) − log π_ref(r) (sequence sums), Δ = h_c − h_r:
//!
//! | `loss_type` | per-pair loss |
//! |---|---|
//! | `sigmoid` | −log σ(βΔ) |
//! | `hinge` | max(0, 1 − βΔ) |
//! | `ipo` | (h_c/\|c\| − h_r/\|r\| − 1/(2β))² (TRL's length-normalised IPO) |
//!
//! Teacher KL: per token KL(T‖S) = Σ_k p_T,k (log p_T,k − log p_S,k) over the teacher's
//! recorded top-K ids plus the tail bucket (or the renormalised top-K); per-sample weight w
//! (by teacher name); aggregated per `kl_loss_agg_mode`: Σ_i w_i (Σ_t m_it KL_it / max(1, Σ_t
//! m_it)) / B (TRL 1.16 SDPO's teacher-server path, default) or Σ_i w_i Σ_t m_it KL_it /
//! Σ_it m_it (`token-mean`).
use crate::divergence::{
    add_tail, divergence_per_token, DistillationAgg, HintDivergence, HintSupport,
};
pub use crate::inputs::{DpoInputs, ReplayInputs, TeacherKlInputs};
use crate::util::{check_shape, const1, gate, logsumexp_last, row_column, select, value};
use crate::{LossError, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// DPO loss variant (TRL names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DpoLossType {
    /// −log σ(βΔ). TRL default.
    #[default]
    Sigmoid,
    /// (Δ_avg − 1/(2β))².
    Ipo,
    /// max(0, 1 − βΔ).
    Hinge,
}

/// DPO knobs (TRL `DPOConfig` names and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DpoConfig {
    /// Variant. TRL default `sigmoid`.
    pub loss_type: DpoLossType,
    /// β. TRL default 0.1.
    pub beta: f64,
}

impl DpoConfig {
    /// Check ranges: β finite and > 0 (NaN fails); errors name the key.
    pub fn validate(&self) -> Result<()> {
        if !(self.beta > 0.0 && self.beta.is_finite()) {
            return Err(LossError::Config {
                key: "beta",
                message: format!("must be finite and > 0, got {}", self.beta),
            });
        }
        Ok(())
    }
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self {
            loss_type: DpoLossType::Sigmoid,
            beta: 0.1,
        }
    }
}

/// DPO metrics (TRL's `rewards/*`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DpoMetrics {
    /// Loss value.
    pub loss: f64,
    /// Mean β·h_c.
    pub chosen_reward: f64,
    /// Mean β·h_r.
    pub rejected_reward: f64,
    /// Fraction of pairs with β·h_c > β·h_r.
    pub reward_accuracy: f64,
    /// Mean β·(h_c − h_r).
    pub reward_margin: f64,
    /// Number of pairs.
    pub pairs: f64,
}

/// Σ_t m·log π per sequence: `[B, T]`, `[B, T]` → `[B]` (keeps the gradient).
pub fn sequence_logprobs(per_token_logprobs: &Tensor, loss_mask: &Tensor) -> Result<Tensor> {
    Ok((per_token_logprobs * loss_mask.to_dtype(per_token_logprobs.dtype())?.detach())?.sum(1)?)
}

/// The DPO loss, mean over pairs: `(scalar, metrics)` (TRL `DPOTrainer`), with
/// h_c = log π(c) − log π_ref(c), h_r likewise, Δ = h_c − h_r:
/// `sigmoid` −log σ(βΔ); `hinge` max(0, 1 − βΔ); `ipo` (h_c/|c| − h_r/|r| − 1/(2β))².
/// Reference sums are detached.
pub fn dpo_loss(inputs: &DpoInputs, cfg: &DpoConfig) -> Result<(Tensor, DpoMetrics)> {
    let p = inputs
        .policy_chosen_logps
        .dims1()
        .map_err(|_| LossError::Shape {
            tensor: "policy_chosen_logps",
            expected: "[P]".into(),
            got: inputs.policy_chosen_logps.dims().to_vec(),
        })?;
    check_shape(&inputs.policy_rejected_logps, "policy_rejected_logps", &[p])?;
    check_shape(&inputs.ref_chosen_logps, "ref_chosen_logps", &[p])?;
    check_shape(&inputs.ref_rejected_logps, "ref_rejected_logps", &[p])?;
    cfg.validate()?;
    let pc = &inputs.policy_chosen_logps;
    let dt = pc.dtype();
    let h_c = (pc - inputs.ref_chosen_logps.detach().to_dtype(dt)?)?;
    let h_r = (&inputs.policy_rejected_logps.to_dtype(dt)?
        - inputs.ref_rejected_logps.detach().to_dtype(dt)?)?;
    let beta = cfg.beta;
    let per_pair = match cfg.loss_type {
        DpoLossType::Sigmoid => {
            // −log σ(x) = relu(−x) + log(1 + e^{−|x|}), the branch chosen by a detached
            // comparison.
            let x = ((&h_c - &h_r)? * beta)?;
            let xd = x.detach();
            let sign = select(&xd.ge(0.0)?, 1.0, -1.0, &xd)?;
            let neg = gate(&xd.lt(0.0)?, &xd)?;
            let abs = (&x * sign)?;
            let relu_neg = (x.neg()? * neg)?;
            (relu_neg + (abs.neg()?.exp()? + 1.0)?.log()?)?
        }
        DpoLossType::Hinge => {
            let z = (((&h_c - &h_r)? * beta)?.neg()? + 1.0)?;
            let on = gate(&z.detach().gt(0.0)?, &z)?;
            (z * on)?
        }
        DpoLossType::Ipo => {
            let n = |v: &[usize], field: &'static str| -> Result<Vec<f64>> {
                if v.len() != p {
                    return Err(LossError::Input {
                        field,
                        message: format!("{} lengths for {p} pairs", v.len()),
                    });
                }
                Ok(v.iter().map(|&l| (l as f64).max(1.0)).collect())
            };
            let lc = const1(&n(&inputs.chosen_lengths, "chosen_lengths")?, pc)?;
            let lr = const1(&n(&inputs.rejected_lengths, "rejected_lengths")?, pc)?;
            (((&h_c / lc)? - (&h_r / lr)?)? - 1.0 / (2.0 * beta))?.sqr()?
        }
    };
    let loss = per_pair.mean_all()?;
    let (rc, rr) = ((h_c.detach() * beta)?, (h_r.detach() * beta)?);
    let pf = p.max(1) as f64;
    let metrics = DpoMetrics {
        loss: value(&loss)?,
        chosen_reward: value(&rc.sum_all()?)? / pf,
        rejected_reward: value(&rr.sum_all()?)? / pf,
        reward_accuracy: value(&rc.gt(&rr)?.to_dtype(DType::F64)?.sum_all()?)? / pf,
        reward_margin: value(&(&rc - &rr)?.sum_all()?)? / pf,
        pairs: p as f64,
    };
    Ok((loss, metrics))
}

/// Teacher-KL metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TeacherKlMetrics {
    /// Loss value.
    pub loss: f64,
    /// Unweighted mean per-token KL(T‖S).
    pub kl_mean: f64,
    /// Active tokens.
    pub tokens: f64,
    /// Per-teacher unweighted mean KL.
    pub per_teacher_kl: BTreeMap<String, f64>,
}

/// Token-level forward KL from the teachers' recorded top-K distributions, per token
/// `KL_it = Σ_k p_T,itk (log p_T,itk − log p_S,itk)`, aggregated by `agg` with per-row weights
/// w_i (`token-mean`: Σ_i w_i Σ_t m_it KL_it / Σ_it m_it; `seq-mean-token-mean`:
/// Σ_i w_i (Σ_t m_it KL_it / max(1, Σ_t m_it)) / B, TRL 1.16 SDPO), over the
/// teacher's top-K plus the tail bucket log(1 − Σ_K p) (`topk_tail`) or the renormalised
/// top-K (`topk_renormalized`); `teacher_weights` maps names to w_i (absent names weigh 1).
/// Teacher log-probs are detached.
pub fn teacher_kl_loss(
    inputs: &TeacherKlInputs,
    support: HintSupport,
    teacher_weights: &BTreeMap<String, f64>,
    agg: DistillationAgg,
) -> Result<(Tensor, TeacherKlMetrics)> {
    let s = &inputs.student_topk_logprobs;
    let dims = s.dims().to_vec();
    if dims.len() != 3 {
        return Err(LossError::Shape {
            tensor: "student_topk_logprobs",
            expected: "[B, T, K]".into(),
            got: dims,
        });
    }
    let (b, t) = (dims[0], dims[1]);
    check_shape(
        &inputs.teacher_topk_logprobs,
        "teacher_topk_logprobs",
        &dims,
    )?;
    check_shape(&inputs.loss_mask, "loss_mask", &[b, t])?;
    if inputs.teachers.len() != b {
        return Err(LossError::Input {
            field: "teachers",
            message: format!("{} names for a batch of {b}", inputs.teachers.len()),
        });
    }
    let te = inputs.teacher_topk_logprobs.detach().to_dtype(s.dtype())?;
    let (s2, t2) = match support {
        HintSupport::TopkTail => (add_tail(s)?, add_tail(&te)?),
        HintSupport::TopkRenormalized => (
            s.broadcast_sub(&logsumexp_last(s)?)?,
            te.broadcast_sub(&logsumexp_last(&te)?)?,
        ),
        HintSupport::Full => (s.clone(), te),
    };
    let kl = divergence_per_token(&s2, &t2, HintDivergence::ForwardKl, 0.0)?; // [B, T]
    let m = inputs.loss_mask.detach().to_dtype(kl.dtype())?;
    let w: Vec<f64> = inputs
        .teachers
        .iter()
        .map(|n| teacher_weights.get(n).copied().unwrap_or(1.0))
        .collect();
    let wm = agg.weights(&m)?.broadcast_mul(&row_column(&w, &m)?)?;
    let loss = (&kl * wm)?.sum_all()?;
    // Per-teacher sums: a one-hot [teachers, B] (host names) times the rows' [B, 2] sums of
    // m·KL and m, so only one number per teacher comes back.
    let names: Vec<&String> = {
        let mut v: Vec<&String> = inputs.teachers.iter().collect();
        v.sort();
        v.dedup();
        v
    };
    let mut onehot = vec![0f64; names.len() * b];
    for (i, n) in inputs.teachers.iter().enumerate() {
        let k = names.binary_search(&n).expect("every name is listed");
        onehot[k * b + i] = 1.0;
    }
    let onehot = Tensor::from_vec(onehot, (names.len(), b), m.device())?.to_dtype(m.dtype())?;
    let row_sums = Tensor::cat(&[(kl.detach() * &m)?.sum_keepdim(1)?, m.sum_keepdim(1)?], 1)?;
    let per: Vec<Vec<f64>> = onehot.matmul(&row_sums)?.to_dtype(DType::F64)?.to_vec2()?;
    let totals = row_sums.sum(0)?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    let (tot, n_tok) = (totals[0], totals[1]);
    let metrics = TeacherKlMetrics {
        loss: value(&loss)?,
        kl_mean: tot / n_tok.max(1.0),
        tokens: n_tok,
        per_teacher_kl: names
            .iter()
            .zip(&per)
            .map(|(k, r)| ((*k).clone(), r[0] / r[1].max(1.0)))
            .collect(),
    };
    Ok((loss, metrics))
}

/// Knobs of the replay channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplayConfig {
    /// DPO settings.
    pub dpo: DpoConfig,
    /// Weight of the DPO term inside the channel. Default 1.0.
    pub dpo_coef: f64,
    /// Weight of the teacher-KL term inside the channel. Default 1.0.
    pub kl_coef: f64,
    /// Support of the teacher KL: `topk_tail` (default) or `topk_renormalized`.
    pub support: HintSupport,
    /// Per-teacher weights by name (absent: 1.0).
    pub teacher_weights: BTreeMap<String, f64>,
    /// Aggregation of the teacher KL: `seq-mean-token-mean` (TRL 1.16 SDPO, default) or
    /// `token-mean`.
    pub kl_loss_agg_mode: DistillationAgg,
}

impl ReplayConfig {
    /// Check ranges (NaN fails every check); errors name the key: `dpo.beta` finite and > 0,
    /// `dpo_coef`, `kl_coef` and every teacher weight finite and >= 0 (0 = term off).
    pub fn validate(&self) -> Result<()> {
        self.dpo.validate().map_err(|e| match e {
            LossError::Config { message, .. } => LossError::Config {
                key: "dpo.beta",
                message,
            },
            e => e,
        })?;
        for (key, w) in [("dpo_coef", self.dpo_coef), ("kl_coef", self.kl_coef)] {
            if !(w >= 0.0 && w.is_finite()) {
                return Err(LossError::Config {
                    key,
                    message: format!("must be finite and >= 0, got {w}"),
                });
            }
        }
        if let Some((name, w)) = self
            .teacher_weights
            .iter()
            .find(|(_, w)| !(**w >= 0.0 && w.is_finite()))
        {
            return Err(LossError::Config {
                key: "teacher_weights",
                message: format!("teacher {name:?}: must be finite and >= 0, got {w}"),
            });
        }
        Ok(())
    }
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            dpo: DpoConfig::default(),
            dpo_coef: 1.0,
            kl_coef: 1.0,
            support: HintSupport::TopkTail,
            teacher_weights: BTreeMap::new(),
            kl_loss_agg_mode: DistillationAgg::default(),
        }
    }
}

/// Replay-channel metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReplayMetrics {
    /// Channel loss dpo_coef·L_dpo + kl_coef·L_kl.
    pub loss: f64,
    /// DPO metrics, when pairs were given.
    pub dpo: Option<DpoMetrics>,
    /// Teacher-KL metrics, when traces were given.
    pub teacher_kl: Option<TeacherKlMetrics>,
}

/// The replay channel: `dpo_coef·L_dpo + kl_coef·L_teacher_kl`.
pub fn replay_loss(inputs: &ReplayInputs, cfg: &ReplayConfig) -> Result<(Tensor, ReplayMetrics)> {
    let mut total: Option<Tensor> = None;
    let mut metrics = ReplayMetrics::default();
    if let Some(d) = &inputs.dpo {
        let (l, m) = dpo_loss(d, &cfg.dpo)?;
        total = Some((l * cfg.dpo_coef)?);
        metrics.dpo = Some(m);
    }
    if let Some(k) = &inputs.teacher_kl {
        let (l, m) = teacher_kl_loss(k, cfg.support, &cfg.teacher_weights, cfg.kl_loss_agg_mode)?;
        let l = (l * cfg.kl_coef)?;
        total = Some(match total {
            Some(t) => {
                let l = l.to_dtype(t.dtype())?;
                (t + l)?
            }
            None => l,
        });
        metrics.teacher_kl = Some(m);
    }
    let total = total.ok_or_else(|| LossError::Missing {
        field: "replay",
        reason: "the replay channel needs DPO pairs or teacher top-K traces".into(),
    })?;
    metrics.loss = value(&total)?;
    Ok((total, metrics))
}
