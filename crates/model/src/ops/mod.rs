//! Training ops with a backward: RMSNorm, RoPE, SwiGLU and causal grouped-query attention
//! over variable-length packed rows; and the LM head's softmax algebra as single row passes
//! ([`head_row_stats`], [`head_logits_grad`], used inside `chunked_logprobs`' custom op).
//!
//! candle 0.11's fused `rms_norm`, `rope` and `softmax_last_dim` have no backward, so the
//! training forward used to compose each from a dozen differentiable tensor ops, each a pass
//! over memory with its own saved activations. Each op here is one candle `CustomOp` whose
//! CPU forward and backward are single fused passes (f32 and f64); attention is computed
//! flash-attention style (online softmax over key tiles, only the per-row log-sum-exp kept,
//! scores recomputed tile by tile in the backward), so no `[heads, T, T]` tensor exists.
//!
//! Every public op dispatches: on the CPU with f32/f64 tensors, and (built with `--features
//! cuda`) on CUDA with f32/bf16 tensors, it runs its custom op (CUDA kernels in `kernels.cu` and
//! `attention_kernels.cu`, launched by `cuda.rs` and `attention_cuda.rs`; the CPU kernels are
//! their twins, tested in CI); elsewhere the differentiable composition (`*_composed`), which
//! is also the reference the tests compare against. On CUDA the transformer's padded training
//! batch still attends with [`masked_softmax`]; its packed (`padding_free`) batch uses the
//! varlen attention kernel, which holds no `[heads, T, T]` tensor. The rollout engine's decode
//! attention over a paged KV cache ([`paged_decode_attention`], inference only) has a CPU
//! kernel, a CUDA kernel (`decode_kernels.cu`, launched by `decode_cuda.rs`) and a gathering
//! composition elsewhere. Deterministic mode's batch-invariant product and attention
//! ([`linear_rows_invariant`], [`attend_one_rows_invariant`], inference only) have a CPU body
//! and a CUDA kernel (`rows_invariant_kernels.cuh`, launched by `rows_invariant_cuda.rs`).

mod adamw;
mod add_into;
mod attend_one;
mod attention;
mod attention_cpu;
#[cfg(feature = "cuda")]
mod attention_cuda;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod decode_cuda;
mod decode_gemm;
mod decode_plan;
mod embedding;
mod head_softmax;
mod kv_write;
mod linear;
mod linear_rows;
mod masked_softmax;
pub(crate) mod paged_attention;
mod qkv_bias_rope;
mod rms_norm;
pub(crate) mod rope;
#[cfg(feature = "cuda")]
mod rows_invariant_cuda;
#[cfg(feature = "cuda")]
mod softmax_cuda;
mod swiglu;

pub use adamw::{adamw_update, AdamWStep};
pub(crate) use add_into::add_into;
pub use attend_one::attend_one_rows_invariant;
pub use attention::{causal_attention_varlen, causal_attention_varlen_composed, check_cu_seqlens};
#[cfg(feature = "cuda")]
pub(crate) use decode_cuda::sample_inverse_cdf as sample_inverse_cdf_cuda;
pub use decode_gemm::{
    decode_gemm_on, decode_product, decode_product_serves, decode_qkv_into_cache,
    decode_qkv_serves, input_normed, DecodeEpilogue, InputNorm, SplitCounters,
    DECODE_PRODUCT_MAX_ROWS,
};
pub use embedding::{embedding, embedding_of_ids};
pub(crate) use head_softmax::row_sums;
pub use head_softmax::{
    head_logits_grad, head_logits_grad_composed, head_row_stats, head_row_stats_composed,
};
pub use kv_write::{write_kv_slots, KvSlots};
pub use linear::linear;
pub use linear_rows::linear_rows_invariant;
pub use masked_softmax::{masked_softmax, masked_softmax_composed};
pub use paged_attention::{paged_decode_attention, paged_decode_attention_composed, PagedLayout};
pub use qkv_bias_rope::{qkv_bias_rope, QkvHeads};
pub use rms_norm::{add_rms_norm, rms_norm, rms_norm_composed};
pub use rope::{rope, rope_composed, rope_to_heads};
pub use swiglu::{swiglu, swiglu_composed, swiglu_packed};

use candle_core::{DType, Device, Layout, Storage, Tensor, WithDType};

/// Whether the custom kernels handle tensors of `dtype` on `device`: the CPU with f32/f64,
/// and CUDA with f32/bf16 when built with `--features cuda`.
pub fn kernels_apply_to(device: &Device, dtype: DType) -> bool {
    match device {
        Device::Cpu => matches!(dtype, DType::F32 | DType::F64),
        Device::Cuda(_) => cfg!(feature = "cuda") && matches!(dtype, DType::F32 | DType::BF16),
        _ => false,
    }
}

/// The contiguous element range of an in-place op's operand, or an error naming the op and
/// the operand.
pub(super) fn contiguous_range(
    l: &Layout,
    op: &str,
    what: &str,
) -> candle_core::Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => candle_core::bail!("{op}: the {what} must be contiguous"),
    }
}

/// [`kernels_apply_to`] for `t`'s device and dtype.
pub fn kernels_apply(t: &Tensor) -> bool {
    kernels_apply_to(t.device(), t.dtype())
}

/// The dtype reductions and softmaxes are computed in for activations of `dtype`: f64 for
/// f64, f32 otherwise (bf16/f16 activations are widened, as transformers does).
pub(crate) fn work_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Whether the CPU kernels handle `t` (ops without a CUDA kernel, e.g. paged decode attention).
pub fn cpu_kernels_apply(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// The float element types the kernels are written for (f32, f64).
pub(crate) trait Real: WithDType + std::ops::Neg<Output = Self> {
    /// `e^self`.
    fn exp(self) -> Self;
    /// `√self`.
    fn sqrt(self) -> Self;
    /// `ln self`.
    fn ln(self) -> Self;
    /// −∞ (the score of a masked key).
    const NEG_INFINITY: Self;
}

impl Real for f32 {
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
}

impl Real for f64 {
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
}

/// The contiguous elements of a CPU storage under `layout` (the ops make their inputs
/// contiguous before applying themselves, so anything else is a caller bug, reported).
pub(crate) fn layout_slice<'a, T: WithDType>(
    s: &'a candle_core::CpuStorage,
    layout: &Layout,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    let Some((a, b)) = layout.contiguous_offsets() else {
        candle_core::bail!("{what}: expected a contiguous tensor")
    };
    Ok(&s.as_slice::<T>()?[a..b])
}

/// Runs `f` on the contiguous CPU elements of `t` (used by the backward passes, which get
/// tensors rather than storages).
pub(crate) fn with_slice<T: WithDType, R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&[T]) -> R,
) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(s) = &*storage else {
        candle_core::bail!("{what}: the CPU kernel got a non-CPU tensor")
    };
    Ok(f(layout_slice(s, layout, what)?))
}

/// `Σ aᵢbᵢ` in eight independent lanes, so the compiler vectorises it.
#[inline]
pub(crate) fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut lanes = [T::zero(); 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut s = T::zero();
    for (x, y) in ra.iter().zip(rb) {
        s += *x * *y;
    }
    for l in lanes {
        s += l;
    }
    s
}

/// `f(i)` for `i in 0..n` on candle's CPU thread count (scoped threads, tasks dealt round
/// robin), results in index order. Small `n` or one thread runs inline.
pub(crate) fn par_map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let threads = candle_core::utils::get_num_threads().clamp(1, n.max(1));
    if threads <= 1 {
        return (0..n).map(f).collect();
    }
    let f = &f;
    let mut parts: Vec<Vec<(usize, R)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || (t..n).step_by(threads).map(|i| (i, f(i))).collect()))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a kernel thread panicked"))
            .collect()
    });
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for part in parts.drain(..) {
        for (i, r) in part {
            out[i] = Some(r);
        }
    }
    out.into_iter()
        .map(|r| r.expect("every index was computed"))
        .collect()
}

/// Applies `f(row_index, row)` to each `row_len`-sized row of `out`, rows split into one
/// contiguous block per thread (element-wise kernels; below ~64k elements inline).
pub(crate) fn par_rows<T: Send>(out: &mut [T], row_len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let rows = out.len() / row_len.max(1);
    let threads = if out.len() < 1 << 16 {
        1
    } else {
        candle_core::utils::get_num_threads().clamp(1, rows.max(1))
    };
    if threads <= 1 || row_len == 0 {
        for (i, row) in out.chunks_mut(row_len.max(1)).enumerate() {
            f(i, row);
        }
        return;
    }
    let per = rows.div_ceil(threads);
    let f = &f;
    std::thread::scope(|s| {
        for (t, block) in out.chunks_mut(per * row_len).enumerate() {
            s.spawn(move || {
                for (i, row) in block.chunks_mut(row_len).enumerate() {
                    f(t * per + i, row);
                }
            });
        }
    });
}
