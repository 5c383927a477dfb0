//! Causal grouped-query attention over variable-length packed rows, with a backward.
//!
//! Tokens of several sequences are packed along one axis, `[N, heads, head_dim]`, with
//! cumulative offsets `cu_seqlens` (`[0, n₁, n₁+n₂, …, N]`): token `i` of a segment attends to
//! tokens `0..=i` of its own segment only. Query head `h` uses key/value head `h / (Hq/Hkv)`.
//!
//! The CPU kernel ([`super::attention_cpu`]) and the CUDA kernels (`varlen_attn_*` in
//! `attention_kernels.cu`, launched by `attention_cuda.rs`) are flash-attention style: the
//! forward keeps only each query row's log-sum-exp, the backward recomputes scores tile by
//! tile; no `[heads, N, N]` tensor exists either way.

use super::{attention_cpu, kernels_apply, layout_slice, with_slice};
use anyhow::{bail, Context, Result};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use std::sync::Mutex;

/// Checks `cu_seqlens` for `n` packed tokens: starts at 0, never decreases, ends at `n`.
pub fn check_cu_seqlens(cu_seqlens: &[usize], n: usize) -> Result<()> {
    match (cu_seqlens.first(), cu_seqlens.last()) {
        (Some(0), Some(&last)) if last == n => {}
        _ => bail!("cu_seqlens must start at 0 and end at the token count {n}, got {cu_seqlens:?}"),
    }
    if let Some(w) = cu_seqlens.windows(2).find(|w| w[1] < w[0]) {
        bail!("cu_seqlens must not decrease, got {} then {}", w[0], w[1]);
    }
    Ok(())
}

/// Shapes `(n, hq, hkv, d)` of valid attention inputs.
fn check_inputs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu: &[usize],
) -> Result<(usize, usize, usize, usize)> {
    let (n, hq, d) = q
        .dims3()
        .context("attention: q must be [tokens, heads, head_dim]")?;
    let (nk, hkv, dk) = k
        .dims3()
        .context("attention: k must be [tokens, kv_heads, head_dim]")?;
    if (nk, dk) != (n, d) || v.dims() != k.dims() {
        bail!(
            "attention: q {:?}, k {:?}, v {:?} disagree (k and v must be [{n}, kv_heads, {d}])",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if hkv == 0 || hq % hkv != 0 {
        bail!("attention: {hq} query heads are not a multiple of {hkv} key/value heads");
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!(
            "attention: q, k, v dtypes differ ({:?}, {:?}, {:?})",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    check_cu_seqlens(cu, n)?;
    Ok((n, hq, hkv, d))
}

/// Causal GQA attention of packed `q` `[N, Hq, D]`, `k`/`v` `[N, Hkv, D]` within the segments
/// of `cu_seqlens`, scores scaled by `scale` → `[N, Hq, D]`. The custom op on the CPU
/// (f32/f64) and on CUDA (f32/bf16, head_dim ≤ 256; `--features cuda`), else
/// [`causal_attention_varlen_composed`]. Differentiable in `q`, `k`, `v`.
pub fn causal_attention_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &[usize],
    scale: f64,
) -> Result<Tensor> {
    let (n, hq, hkv, d) = check_inputs(q, k, v, cu_seqlens)?;
    // The CUDA kernels' shared tiles are sized for head_dim ≤ 256.
    let kernel = kernels_apply(q) && (q.device().is_cpu() || d <= 256);
    if !kernel || n == 0 {
        return causal_attention_varlen_composed(q, k, v, cu_seqlens, scale);
    }
    let op = VarlenAttention {
        cu_seqlens: cu_seqlens.to_vec(),
        scale,
        n_rep: hq / hkv,
        lse: Mutex::new(None),
    };
    Ok(q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)?)
}

/// The same attention from differentiable candle ops, segment by segment (scores
/// `[Hkv, n_rep·L, L]` per segment of length L, causal mask, softmax, weighted sum).
pub fn causal_attention_varlen_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &[usize],
    scale: f64,
) -> Result<Tensor> {
    let (_, hq, hkv, d) = check_inputs(q, k, v, cu_seqlens)?;
    let n_rep = hq / hkv;
    let mut parts = Vec::new();
    for w in cu_seqlens.windows(2) {
        let (s, len) = (w[0], w[1] - w[0]);
        if len == 0 {
            continue;
        }
        // Query heads of one group stacked along the query axis, as in the transformer.
        let qs = q
            .narrow(0, s, len)?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((hkv, n_rep * len, d))?;
        let ks = k.narrow(0, s, len)?.transpose(0, 1)?.contiguous()?;
        let vs = v.narrow(0, s, len)?.transpose(0, 1)?.contiguous()?;
        let scores = (qs.matmul(&ks.t()?)? * scale)?.reshape((hkv, n_rep, len, len))?;
        let mask: Vec<f64> = (0..len * len)
            .map(|x| {
                if x % len > x / len {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (len, len), q.device())?.to_dtype(scores.dtype())?;
        let probs = candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, 3)?.reshape((
            hkv,
            n_rep * len,
            len,
        ))?;
        let out = probs.matmul(&vs)?.reshape((hq, len, d))?.transpose(0, 1)?;
        parts.push(out);
    }
    if parts.is_empty() {
        return Ok(q.zeros_like()?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// The op: its forward runs the tiled kernel and keeps the per-row log-sum-exp (`[N, Hq]`)
/// for its backward.
struct VarlenAttention {
    cu_seqlens: Vec<usize>,
    scale: f64,
    n_rep: usize,
    lse: Mutex<Option<SavedLse>>,
}

/// The forward's log-sum-exp per (token, query head), `[N, Hq]`, where its kernel left it.
enum SavedLse {
    /// The CPU kernel's, in f64.
    Cpu(Vec<f64>),
    /// The CUDA kernel's, an f32 tensor on the device.
    #[cfg(feature = "cuda")]
    Cuda(Tensor),
}

impl VarlenAttention {
    /// The kernels' shapes from `q`'s and `k`'s layouts (`[N, Hq, D]`, `[N, Hkv, D]`).
    fn dims(&self, q: &Layout, k: &Layout) -> candle_core::Result<attention_cpu::Dims> {
        let (n, hq, d) = q.shape().dims3()?;
        let (_, hkv, _) = k.shape().dims3()?;
        Ok(attention_cpu::Dims { n, hq, hkv, d })
    }

    #[allow(clippy::too_many_arguments)]
    fn fwd_typed<T: super::Real>(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<CpuStorage> {
        let dims = self.dims(lq, lk)?;
        let (out, lse) = attention_cpu::forward(
            layout_slice::<T>(q, lq, "attention")?,
            layout_slice::<T>(k, lk, "attention")?,
            layout_slice::<T>(v, lv, "attention")?,
            &dims,
            &self.cu_seqlens,
            self.scale,
        );
        *self.lse.lock().expect("lse lock") = Some(SavedLse::Cpu(lse));
        Ok(T::to_cpu_storage_owned(out))
    }

    fn bwd_typed<T: super::Real>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let guard = self.lse.lock().expect("lse lock");
        let Some(SavedLse::Cpu(lse)) = guard.as_ref() else {
            candle_core::bail!("attention backward: the CPU forward's log-sum-exp is missing")
        };
        let dims = self.dims(q.layout(), k.layout())?;
        let w = "attention backward";
        let (dq, dk, dv) = with_slice::<T, _>(q, w, |qs| {
            with_slice::<T, _>(k, w, |ks| {
                with_slice::<T, _>(v, w, |vs| {
                    with_slice::<T, _>(out, w, |os| {
                        with_slice::<T, _>(dout, w, |ds| {
                            let io = attention_cpu::BackwardInputs {
                                q: qs,
                                k: ks,
                                v: vs,
                                out: os,
                                dout: ds,
                                lse,
                            };
                            attention_cpu::backward(&io, &dims, &self.cu_seqlens, self.scale)
                        })
                    })
                })
            })
        })?????;
        Ok((
            Tensor::from_vec(dq, q.shape(), q.device())?,
            Tensor::from_vec(dk, k.shape(), k.device())?,
            Tensor::from_vec(dv, v.shape(), v.device())?,
        ))
    }
}

impl CustomOp3 for VarlenAttention {
    fn name(&self) -> &'static str {
        "causal-varlen-gqa-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        debug_assert_eq!(lq.shape().dims3()?.1, self.n_rep * lk.shape().dims3()?.1);
        let out = match (q, k, v) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                self.fwd_typed::<f32>(q, lq, k, lk, v, lv)?
            }
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
                self.fwd_typed::<f64>(q, lq, k, lk, v, lv)?
            }
            _ => candle_core::bail!("attention kernel: q, k, v must all be f32 or f64"),
        };
        Ok((out, lq.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let dims = self.dims(lq, lk)?;
        let (out, lse) = super::attention_cuda::varlen_attention_fwd(
            (q, lq),
            (k, lk),
            (v, lv),
            &dims,
            &self.cu_seqlens,
            self.scale,
        )?;
        *self.lse.lock().expect("lse lock") = Some(SavedLse::Cuda(lse));
        Ok((out, lq.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        dout: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() {
            let guard = self.lse.lock().expect("lse lock");
            let Some(SavedLse::Cuda(lse)) = guard.as_ref() else {
                candle_core::bail!("attention backward: the CUDA forward's log-sum-exp is missing")
            };
            let dims = self.dims(q.layout(), k.layout())?;
            let (dq, dk, dv) = super::attention_cuda::varlen_attention_bwd(
                q,
                k,
                v,
                res,
                dout,
                lse,
                &dims,
                &self.cu_seqlens,
                self.scale,
            )?;
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        let (dq, dk, dv) = match q.dtype() {
            DType::F32 => self.bwd_typed::<f32>(q, k, v, res, dout)?,
            DType::F64 => self.bwd_typed::<f64>(q, k, v, res, dout)?,
            other => candle_core::bail!("attention kernel: unsupported dtype {other:?}"),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
