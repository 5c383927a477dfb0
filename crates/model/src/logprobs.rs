//! Per-token log-probabilities, entropies and top-K from logits, computed in f32 (in f64
//! when the logits are f64, for gradient checks) and differentiable, without materialising
//! a full log-softmax copy beyond what the log-sum-exp needs. Temperature is the caller's:
//! pass `logits / T` for the tempered distribution (the sampler's log-prob is
//! `log softmax(logits / T)`).

use anyhow::{Context, Result};
use candle_core::{DType, Tensor, D};

/// The logits in the working precision: f64 stays f64, everything else becomes f32.
fn to_work_dtype(logits: &Tensor) -> Result<Tensor> {
    Ok(if logits.dtype() == DType::F64 {
        logits.clone()
    } else {
        logits.to_dtype(DType::F32)?
    })
}

/// `logsumexp(logits)` over the last dim, `[..]` f32 (the max is detached, which does not
/// change the gradient of the result).
pub fn logsumexp(logits: &Tensor) -> Result<Tensor> {
    let logits = to_work_dtype(logits)?;
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let lse = logits
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        .add(&max)?;
    Ok(lse.squeeze(D::Minus1)?)
}

/// `log p(target)` = `logits[target] − logsumexp(logits)`: logits `[.., V]`, targets `[..]`
/// u32 → `[..]` f32. Differentiable w.r.t. the logits.
pub fn token_logprobs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = to_work_dtype(logits)?;
    let picked = logits
        .contiguous()?
        .gather(&targets.unsqueeze(D::Minus1)?.contiguous()?, D::Minus1)
        .context("gathering target logits (targets must be u32 with the logits' leading shape)")?
        .squeeze(D::Minus1)?;
    Ok((picked - logsumexp(&logits)?)?)
}

/// Entropy of softmax(logits) per position: `lse − Σ p·logits`, `[..]` f32, differentiable.
pub fn token_entropy(logits: &Tensor) -> Result<Tensor> {
    let logits = to_work_dtype(logits)?;
    let lse = logsumexp(&logits)?;
    let p = logits.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?.exp()?;
    let expected = (p * &logits)?.sum(D::Minus1)?;
    Ok((lse - expected)?)
}

/// Full log-softmax over the last dim in f32 (differentiable).
pub fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    let logits = to_work_dtype(logits)?;
    let lse = logsumexp(&logits)?;
    Ok(logits.broadcast_sub(&lse.unsqueeze(D::Minus1)?)?)
}

/// The `k` most likely tokens per position: `(ids [.., k] u32, logprobs [.., k] f32)`,
/// sorted by decreasing probability. The log-probs are differentiable w.r.t. the logits
/// (the selection is not), for the distillation channel.
pub fn topk_logprobs(logits: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    let logits = to_work_dtype(logits)?.contiguous()?;
    let v = logits.dim(D::Minus1)?;
    let k = k.min(v);
    let order = logits.detach().arg_sort_last_dim(false)?;
    let ids = order.narrow(D::Minus1, 0, k)?.contiguous()?;
    let picked = logits.gather(&ids, D::Minus1)?;
    let lse = logsumexp(&logits)?.unsqueeze(D::Minus1)?;
    Ok((ids, picked.broadcast_sub(&lse)?))
}
