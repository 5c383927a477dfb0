//! Per-token divergences between two log-prob distributions on a shared support, used by the
//! hint channel (student vs hinted self) and the replay channel's teacher KL (student vs
//! recorded teacher). A leaf module so both channels share one implementation without
//! depending on each other.
use crate::util::{gate, logsumexp_last};
use crate::{LossError, Result};
use candle_core::{Tensor, D};
use serde::{Deserialize, Serialize};

/// Divergence of the hint channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HintDivergence {
    /// KL(S‖T).
    ReverseKl,
    /// KL(T‖S).
    ForwardKl,
    /// Generalised Jensen–Shannon with mixing `alpha` (SDPO default 0.5).
    #[default]
    Jsd,
    /// sg(log π_S − log π_T)·log π_S on the sampled token only.
    SampledToken,
}

/// Support of the distributions compared per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HintSupport {
    /// Student's top-K ids plus one tail bucket log(1 − Σ_K p) (SDPO `distillation_add_tail`).
    #[default]
    TopkTail,
    /// Student's top-K ids, each side renormalised to sum to one.
    TopkRenormalized,
    /// The given log-probs are whole (small-vocabulary) distributions; used as they are.
    Full,
}

/// How a distillation loss (hint channel, replay teacher KL) averages its per-token terms over
/// one micro-batch of `B` rows with mask m.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum DistillationAgg {
    /// Σ_i (Σ_t m_it ℓ_it / max(1, Σ_t m_it)) / B: each row's token mean, averaged over all `B`
    /// rows (rows with no active token count as 0). TRL 1.16 `SDPOTrainer` (default).
    #[default]
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Σ_it m_it ℓ_it / max(1, Σ_it m_it). The verl-fork SDPO (`loss_agg_mode = token-mean`).
    #[serde(rename = "token-mean")]
    TokenMean,
}

impl DistillationAgg {
    /// Per-token weights `[B, T]` whose dot product with the per-token loss is the aggregate;
    /// `mask` is the (already hint/weight-applied) `[B, T]` float mask, on its device.
    pub(crate) fn weights(self, mask: &Tensor) -> Result<Tensor> {
        match self {
            DistillationAgg::TokenMean => {
                let n = mask.sum_all()?.maximum(1.0)?;
                Ok(mask.broadcast_div(&n)?)
            }
            DistillationAgg::SeqMeanTokenMean => {
                let b = mask.dim(0)?.max(1) as f64;
                let n = mask.sum_keepdim(1)?.maximum(1.0)?;
                Ok((mask.broadcast_div(&n)? / b)?)
            }
        }
    }
}

/// SDPO's `add_tail`: append log(1 − Σ exp(x)) with the sum clamped below 1.
pub(crate) fn add_tail(x: &Tensor) -> Result<Tensor> {
    let ls = logsumexp_last(x)?; // [B, T, 1]
                                 // Where log Σp > −1e-7 the clamp is active: the value becomes the constant −1e-7.
    let c = gate(&ls.detach().gt(-1e-7)?, &ls)?;
    let one_minus_c = (c.ones_like()? - &c)?;
    let ls = ((ls * one_minus_c)? + (c * -1e-7)?)?;
    let tail = (ls.exp()?.neg()? + 1.0)?.log()?;
    Ok(Tensor::cat(&[x, &tail], D::Minus1)?)
}

/// Renormalise log-probs over the last dim (log-softmax of log-probs).
pub(crate) fn renorm(x: &Tensor) -> Result<Tensor> {
    Ok(x.broadcast_sub(&logsumexp_last(x)?)?)
}

/// `kl_div(input, target, log_target=True)` summed over the last dim: Σ e^target (target − input).
fn kl_sum(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    Ok((target.exp()? * (target - input)?)?.sum(D::Minus1)?)
}

/// Per-token divergence `[B, T]` between student and teacher log-prob rows `[B, T, K']`
/// (already on the chosen support): forward KL Σ p_T(log p_T − log p_S), reverse KL
/// Σ p_S(log p_S − log p_T), JSD (1−α)·KL(S‖M) + α·KL(T‖M) with M = (1−α)S + αT.
/// `teacher` must be detached.
pub fn divergence_per_token(
    student: &Tensor,
    teacher: &Tensor,
    divergence: HintDivergence,
    alpha: f64,
) -> Result<Tensor> {
    match divergence {
        HintDivergence::ForwardKl => kl_sum(student, teacher),
        HintDivergence::ReverseKl => kl_sum(teacher, student),
        HintDivergence::Jsd => {
            let mix = ((student.exp()? * (1.0 - alpha))? + (teacher.exp()? * alpha)?)?.log()?;
            let kl_t = kl_sum(&mix, teacher)?;
            let kl_s = kl_sum(&mix, student)?;
            Ok(((kl_s * (1.0 - alpha))? + (kl_t * alpha)?)?)
        }
        HintDivergence::SampledToken => Err(LossError::Config {
            key: "divergence",
            message: "sampled_token has no distribution form".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn distillation_weights_are_the_mask_over_its_normaliser() {
        let m = Tensor::new(&[[1f64, 1., 0.], [0., 0., 0.], [1., 1., 1.]], &Device::Cpu).unwrap();
        let tok = DistillationAgg::TokenMean.weights(&m).unwrap();
        let seq = DistillationAgg::SeqMeanTokenMean.weights(&m).unwrap();
        let (t, s) = (tok.to_vec2::<f64>().unwrap(), seq.to_vec2::<f64>().unwrap());
        assert_eq!(t[0], vec![0.2, 0.2, 0.0]);
        assert_eq!(t[1], vec![0.0; 3]);
        assert_eq!(s[0], vec![0.5 / 3.0, 0.5 / 3.0, 0.0]);
        assert_eq!(s[1], vec![0.0; 3]);
        assert_eq!(s[2], vec![1.0 / 9.0; 3]);
    }

    #[test]
    fn add_tail_clamps_the_tail_where_the_top_k_holds_all_the_mass() {
        // Row 0: two tokens with 0.5 + 0.25 of the mass; row 1: the whole mass (tail clamped).
        let x = Tensor::new(
            &[[[0.5f64.ln(), 0.25f64.ln()], [0.0, f64::NEG_INFINITY]]],
            &Device::Cpu,
        )
        .unwrap();
        let y = add_tail(&x)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec3::<f64>()
            .unwrap();
        assert!((y[0][0][2] - 0.25f64.ln()).abs() < 1e-12);
        assert!((y[0][1][2] - (1.0 - (-1e-7f64).exp()).ln()).abs() < 1e-9);
    }
}
