//! The LM head fused with log-softmax, token gathers, entropy and top-K, chunked over tokens
//! so that no `[N, vocab]` tensor larger than one chunk exists, forward or backward.
//!
//! [`head_logprobs`] takes final hidden states `[N, H]` and the LM-head weight `[V, H]` (the
//! embedding itself when tied) and returns, per token row, the log-probs at given ids (the
//! targets, a teacher's recorded top-K), the entropy, and optionally the row's own top-K ids
//! with their log-probs, all of `log softmax(h·Wᵀ / T)`. The values are computed chunk by
//! chunk without a graph; a [`CustomOp3`] attaches them to `hidden` and `weight` and its
//! backward recomputes each chunk's logits to form
//! `∂z = Σₖ Gₖ(δ_{idₖ} − p) − E·p·(log p + H)` (G: gradients of the gathered log-probs,
//! E: of the entropy H), then `∂h = ∂z·W / T` and `∂W += ∂zᵀ·h / T`.
//!
//! Work precision is f32 (f64 for f64 inputs, for gradient checks); the returned log-probs
//! are in that precision and the gradients are cast back to the inputs' dtypes.

use crate::ops::{
    head_logits_grad, head_logits_grad_composed, head_row_stats, head_row_stats_composed,
    work_dtype,
};
use anyhow::{bail, Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor, D};

/// Upper bound on the elements of one chunk's `[rows, vocab]` logits on the CPU (64 MiB in
/// f32); the backward holds a few tensors of this size at once.
pub const DEFAULT_CHUNK_ELEMENTS: usize = 1 << 24;
/// The same bound on a GPU (512 MiB in f32): with Qwen's 151,936-token vocabulary a chunk is
/// 883 rows, so the head's matrix products stay large enough to run near the card's rate.
pub const DEFAULT_GPU_CHUNK_ELEMENTS: usize = 1 << 27;

/// What [`head_logprobs`] computes besides the gathered log-probs and the entropy.
#[derive(Debug, Clone, Copy)]
pub struct HeadOptions {
    /// Logits are divided by this (the sampler's temperature); must be > 0.
    pub temperature: f64,
    /// Also select each row's `top_k` most likely ids (0 = none).
    pub top_k: usize,
    /// Upper bound on one chunk's `rows × vocab` elements; 0 = the device's default
    /// ([`DEFAULT_CHUNK_ELEMENTS`] on the CPU, [`DEFAULT_GPU_CHUNK_ELEMENTS`] elsewhere).
    pub chunk_elements: usize,
}

impl Default for HeadOptions {
    fn default() -> Self {
        HeadOptions {
            temperature: 1.0,
            top_k: 0,
            chunk_elements: 0,
        }
    }
}

/// Per-row results of [`head_logprobs`]; every float tensor is differentiable with respect to
/// the hidden states and the LM-head weight.
#[derive(Debug, Clone)]
pub struct HeadLogprobs {
    /// `[N, K]` log-probs at the requested ids.
    pub at_ids: Tensor,
    /// `[N]` entropy of each row's distribution.
    pub entropy: Tensor,
    /// `[N, top_k]` u32 ids of each row's most likely tokens, most likely first (not
    /// differentiable: a selection). `None` when `top_k == 0`.
    pub topk_ids: Option<Tensor>,
    /// `[N, top_k]` log-probs at `topk_ids`.
    pub topk_logprobs: Option<Tensor>,
}

/// Rows per chunk for a vocabulary of `v` under `chunk_elements`.
fn chunk_rows(v: usize, chunk_elements: usize) -> usize {
    (chunk_elements / v.max(1)).max(1)
}

/// One chunk's logits `h·Wᵀ` `[c, V]` in the weights' dtype (bf16 on the matrix units for a
/// bf16 model, as transformers computes bf16 logits), without a graph; the softmax algebra
/// runs in f32 (f64 for f64) inside the fused row kernels ([`head_row_stats`]).
fn chunk_logits(h: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(h.matmul(&w.t()?)?)
}

/// The `k` largest entries of each row of `[c, V]` logits (the same as of the log-probs), as `[c, k]` u32 ids in
/// decreasing order. On the CPU a size-k scan per row; elsewhere `k` rounds of a row argmax
/// that then masks the winner, on the device (candle's device sort needs shared memory for
/// a whole row, which a 151,936-wide vocabulary exceeds).
fn topk_rows(logp: &Tensor, k: usize) -> Result<Tensor> {
    if !matches!(logp.device(), Device::Cpu) {
        return topk_by_argmax(logp, k);
    }
    topk_by_scan(logp, k)
}

/// [`topk_rows`] as `k` device passes of argmax-then-mask.
fn topk_by_argmax(logp: &Tensor, k: usize) -> Result<Tensor> {
    let mut rest = logp.clone();
    let mut picks = Vec::with_capacity(k);
    let neg_inf = Tensor::new(f32::NEG_INFINITY, logp.device())?
        .to_dtype(logp.dtype())?
        .broadcast_as(logp.shape())?;
    let cols = Tensor::arange(0u32, logp.dim(1)? as u32, logp.device())?.unsqueeze(0)?;
    for _ in 0..k {
        let best = rest.argmax_keepdim(D::Minus1)?;
        let hit = cols.broadcast_eq(&best)?;
        rest = hit.where_cond(&neg_inf, &rest)?;
        picks.push(best);
    }
    Ok(Tensor::cat(&picks, 1)?)
}

/// [`topk_rows`] on the host: one size-k scan per row.
fn topk_by_scan(logp: &Tensor, k: usize) -> Result<Tensor> {
    let rows: Vec<Vec<f32>> = logp.to_dtype(DType::F32)?.to_vec2()?;
    let mut out = Vec::with_capacity(rows.len() * k);
    for row in &rows {
        // `best` stays sorted in decreasing order; a value enters only if it beats the k-th.
        let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
        for (i, &x) in row.iter().enumerate() {
            if best.len() == k && !(x > best[k - 1].0) {
                continue;
            }
            let at = best.partition_point(|&(y, _)| y >= x);
            best.insert(at, (x, i as u32));
            best.truncate(k);
        }
        out.extend(best.iter().map(|&(_, i)| i));
    }
    Ok(Tensor::from_vec(out, (rows.len(), k), logp.device())?)
}

/// Log-probs at `ids` `[N, K]` (u32), entropy and optionally the own top-K of
/// `log softmax(hidden·weightᵀ / T)`, with `hidden` `[N, H]` and `weight` `[V, H]`, chunked
/// over rows (see the module doc). Gradients reach `hidden` and `weight`.
pub fn head_logprobs(
    hidden: &Tensor,
    weight: &Tensor,
    ids: &Tensor,
    opts: &HeadOptions,
) -> Result<HeadLogprobs> {
    head_logprobs_with(hidden, weight, ids, opts, true)
}

/// [`head_logprobs`] with the softmax algebra in the fused row kernels (`fused`) or in the
/// candle compositions (`Transformer::training_kernels` off: the reference, and benchmarks).
pub fn head_logprobs_with(
    hidden: &Tensor,
    weight: &Tensor,
    ids: &Tensor,
    opts: &HeadOptions,
    fused: bool,
) -> Result<HeadLogprobs> {
    let (n, h) = hidden
        .dims2()
        .context("head_logprobs: hidden states must be [tokens, hidden]")?;
    let (v, hw) = weight
        .dims2()
        .context("head_logprobs: the LM-head weight must be [vocab, hidden]")?;
    if h != hw {
        bail!("head_logprobs: hidden size {h} but the LM-head weight is [{v}, {hw}]");
    }
    let (ni, k_ids) = ids
        .dims2()
        .context("head_logprobs: ids must be [tokens, K]")?;
    if ni != n || ids.dtype() != DType::U32 {
        bail!(
            "head_logprobs: ids must be u32 [{n}, K], got {:?} {:?}",
            ids.dtype(),
            ids.dims()
        );
    }
    if opts.temperature.is_nan() || opts.temperature <= 0.0 {
        bail!(
            "head_logprobs: temperature must be > 0, got {}",
            opts.temperature
        );
    }
    if n > 0 && k_ids > 0 {
        let max_id = ids.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        if max_id as usize >= v {
            bail!("head_logprobs: token id {max_id} is outside the vocabulary ({v})");
        }
    }
    let top_k = opts.top_k.min(v);
    let dt = work_dtype(hidden.dtype());
    let w = weight.detach().to_dtype(hidden.dtype())?;
    let hid = hidden.detach();
    let chunk_elements = match opts.chunk_elements {
        0 if hidden.device().is_cpu() => DEFAULT_CHUNK_ELEMENTS,
        0 => DEFAULT_GPU_CHUNK_ELEMENTS,
        e => e,
    };
    let rows = chunk_rows(v, chunk_elements);
    let mut values = Vec::new();
    let mut all_ids = Vec::new();
    let mut start = 0;
    let mut all_stats = Vec::new();
    while start < n {
        let c = rows.min(n - start);
        let z = chunk_logits(&hid.narrow(0, start, c)?, &w)?;
        let stats = if fused {
            head_row_stats(&z, opts.temperature)?
        } else {
            head_row_stats_composed(&z, opts.temperature)?
        };
        let lse = stats.narrow(1, 0, 1)?;
        let mut chunk_ids = ids.narrow(0, start, c)?.contiguous()?;
        if top_k > 0 {
            chunk_ids = Tensor::cat(&[&chunk_ids, &topk_rows(&z, top_k)?], 1)?;
        }
        // log p = z/T − lse at the ids: a gather of c × W logits, no [c, V] log-softmax.
        let gathered = if chunk_ids.dim(1)? > 0 {
            (z.gather(&chunk_ids, D::Minus1)?.to_dtype(dt)? * (1.0 / opts.temperature))?
                .broadcast_sub(&lse)?
        } else {
            Tensor::zeros((c, 0), dt, z.device())?
        };
        values.push(Tensor::cat(&[&gathered, &stats.narrow(1, 1, 1)?], 1)?);
        all_ids.push(chunk_ids);
        all_stats.push(stats);
        start += c;
    }
    let width = k_ids + top_k;
    let (values, all_ids, stats) = if n == 0 {
        (
            Tensor::zeros((0, width + 1), dt, hidden.device())?,
            Tensor::zeros((0, width), DType::U32, hidden.device())?,
            Tensor::zeros((0, 2), dt, hidden.device())?,
        )
    } else {
        // `cat` allocates a fresh contiguous buffer, which the op's forward copies as is.
        (
            Tensor::cat(&values, 0)?,
            Tensor::cat(&all_ids, 0)?,
            Tensor::cat(&all_stats, 0)?,
        )
    };
    let op = FusedHead {
        ids: all_ids.clone(),
        stats,
        temperature: opts.temperature,
        chunk_rows: rows,
        fused,
    };
    let out = hidden.apply_op3(weight, &values.detach(), op)?;
    Ok(HeadLogprobs {
        at_ids: out.narrow(1, 0, k_ids)?,
        entropy: out.narrow(1, width, 1)?.squeeze(1)?,
        topk_ids: (top_k > 0)
            .then(|| all_ids.narrow(1, k_ids, top_k))
            .transpose()?,
        topk_logprobs: (top_k > 0)
            .then(|| out.narrow(1, k_ids, top_k))
            .transpose()?,
    })
}

/// The op that attaches precomputed head values to `(hidden, weight)`: its forward returns
/// its third argument (the values, computed without a graph), its backward recomputes the
/// logits chunk by chunk.
struct FusedHead {
    /// `[N, W]` ids whose log-probs are the first `W` output columns (the last is entropy).
    ids: Tensor,
    /// `[N, 2]` the forward's `(lse, entropy)` per row (work dtype), reused by the backward.
    stats: Tensor,
    temperature: f64,
    chunk_rows: usize,
    /// The softmax algebra in the fused kernels, else the compositions.
    fused: bool,
}

/// The values tensor must be a whole contiguous buffer (it is fresh from `cat`).
fn check_whole(l: &Layout, len: usize) -> candle_core::Result<()> {
    if !l.is_contiguous() || l.start_offset() != 0 || l.shape().elem_count() != len {
        candle_core::bail!("fused LM head: the values tensor must be a fresh contiguous buffer")
    }
    Ok(())
}

impl CustomOp3 for FusedHead {
    fn name(&self) -> &'static str {
        "fused-lm-head-logprobs"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        values: &CpuStorage,
        l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let len = match values {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            _ => candle_core::bail!("fused LM head: values must be f32 or f64"),
        };
        check_whole(l, len)?;
        Ok((values.try_clone(l)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        values: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        check_whole(l, l.shape().elem_count())?;
        Ok((values.try_clone(l)?, l.shape().clone()))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        _values: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = self.ids.dim(0)?;
        let dt = work_dtype(hidden.dtype());
        // Products in the model's dtype (bf16 matrix units for bf16), the softmax algebra in
        // the fused row kernel, the weight gradient's accumulation over chunks in the work dtype.
        let mm = hidden.dtype();
        let w = weight.detach().to_dtype(mm)?;
        let hid = hidden.detach();
        let grad = grad_res.detach().to_dtype(dt)?;
        let msg = |e: anyhow::Error| candle_core::Error::Msg(format!("{e:#}"));
        // A frozen head (LoRA) gets no gradient: no products, no buffer.
        let mut dw = weight
            .track_op()
            .then(|| Tensor::zeros(w.shape(), dt, w.device()))
            .transpose()?;
        let mut dh = Vec::new();
        let mut start = 0;
        while start < n {
            let c = self.chunk_rows.min(n - start);
            let h_c = hid.narrow(0, start, c)?;
            let z = chunk_logits(&h_c, &w).map_err(msg)?;
            let logits_grad = if self.fused {
                head_logits_grad
            } else {
                head_logits_grad_composed
            };
            let dz = logits_grad(
                &z,
                &self.stats.narrow(0, start, c)?,
                &self.ids.narrow(0, start, c)?,
                &grad.narrow(0, start, c)?,
                self.temperature,
            )
            .map_err(msg)?;
            dh.push(dz.matmul(&w)?);
            if let Some(acc) = dw.as_mut() {
                crate::ops::add_into(acc, &dz.t()?.matmul(&h_c)?).map_err(msg)?;
            }
            start += c;
        }
        let dh = if n == 0 {
            hid.zeros_like()?
        } else {
            Tensor::cat(&dh, 0)?
        };
        Ok((
            Some(dh.to_dtype(hidden.dtype())?),
            dw.map(|g| g.to_dtype(weight.dtype())).transpose()?,
            None,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device top-K (argmax passes) selects what the host scan selects, in order.
    #[test]
    fn topk_by_argmax_equals_the_scan() {
        let v = 1000;
        let data: Vec<f32> = (0..7 * v)
            .map(|i| ((i as f32 * 0.618_034).fract() * 40.0).floor() / 3.0)
            .collect();
        let logp = Tensor::from_vec(data, (7, v), &Device::Cpu).unwrap();
        for k in [1, 5, 32] {
            let a = topk_by_argmax(&logp, k).unwrap().to_vec2::<u32>().unwrap();
            let b = topk_by_scan(&logp, k).unwrap().to_vec2::<u32>().unwrap();
            let vals = logp.to_vec2::<f32>().unwrap();
            for r in 0..7 {
                // Equal values may be picked in another order; the selected values agree.
                let va: Vec<f32> = a[r].iter().map(|&i| vals[r][i as usize]).collect();
                let vb: Vec<f32> = b[r].iter().map(|&i| vals[r][i as usize]).collect();
                assert_eq!(va, vb, "k {k} row {r}");
                let mut ids = a[r].clone();
                ids.sort();
                ids.dedup();
                assert_eq!(ids.len(), k, "k {k} row {r}: distinct ids");
            }
        }
    }
}
