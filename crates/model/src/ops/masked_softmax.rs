//! Attention's softmax over the last axis with an additive mask, `p = softmax(s + m)`, with a
//! backward: one pass over the scores in each direction, computed in f32 (f64 for f64) from
//! scores in the activations' dtype, instead of the composition's f32 copy, mask add, max,
//! subtract, exp, sum and divide (each a full `[B, H, T, Tk]` tensor kept for the backward).
//!
//! Backward: `∂s = p ⊙ (∂p − Σⱼ ∂pⱼ·pⱼ)` per row; the mask gets no gradient.

use super::{kernels_apply, layout_slice, par_rows, work_dtype, Real};
use anyhow::{bail, Context, Result};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, D};

/// `softmax(scores + mask)` over the last axis. `scores` is `[B, …, R·T, Tk]`: rows ordered
/// with the query position innermost (query heads of a group may be stacked along the row
/// axis, R of them); `mask`, if any, is `[B or 1, T, Tk]` (0 = attend, −∞ = masked), the same
/// for every row of one batch entry with the same query position. The result has the
/// scores' dtype. The custom op where the kernels apply, else
/// [`masked_softmax_composed`]. Differentiable with respect to `scores`.
pub fn masked_softmax(scores: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let dims = scores.dims();
    if dims.len() < 3 {
        bail!("masked_softmax: scores must be [B, .., T, Tk], got {dims:?}");
    }
    let (b, rows_t, tk) = (dims[0], dims[dims.len() - 2], dims[dims.len() - 1]);
    let (mask_batches, t) = match mask {
        None => (1, rows_t),
        Some(m) => {
            let (mb, mt, mtk) = m
                .dims3()
                .context("masked_softmax: mask must be [B or 1, T, Tk]")?;
            if mt == 0 || rows_t % mt != 0 || mtk != tk || !(mb == 1 || mb == b) {
                bail!(
                    "masked_softmax: mask {:?} does not fit scores {dims:?}",
                    m.dims()
                );
            }
            (mb, mt)
        }
    };
    if !kernels_apply(scores) {
        return masked_softmax_composed(scores, mask);
    }
    let work = work_dtype(scores.dtype());
    let op = MaskedSoftmax {
        mask: mask.map(|m| m.to_dtype(work)?.contiguous()).transpose()?,
        t,
        rows_per_batch: scores.elem_count() / (b * tk).max(1),
        mask_batches,
    };
    Ok(scores.contiguous()?.apply_op1(op)?)
}

/// The same from differentiable candle ops, in f32 (f64 for f64) and cast back: the
/// reference of the tests.
pub fn masked_softmax_composed(scores: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let dtype = scores.dtype();
    let work = work_dtype(dtype);
    let dims = scores.dims().to_vec();
    let (b, tk) = (dims[0], dims[dims.len() - 1]);
    let s = scores.to_dtype(work)?;
    let s = match mask {
        Some(m) => {
            let t = m.dim(1)?;
            let mid = scores.elem_count() / (b * t * tk).max(1);
            s.reshape((b, mid, t, tk))?
                .broadcast_add(&m.to_dtype(work)?.unsqueeze(1)?)?
                .reshape(dims.as_slice())?
        }
        None => s,
    };
    let max = s.max_keepdim(D::Minus1)?.detach();
    let e = s.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?
        .to_dtype(dtype)?)
}

struct MaskedSoftmax {
    /// `[mask_batches, t, tk]` in the working dtype (f32, or f64 for f64 scores).
    mask: Option<Tensor>,
    t: usize,
    rows_per_batch: usize,
    mask_batches: usize,
}

impl MaskedSoftmax {
    fn fwd_typed<T: Real>(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<CpuStorage> {
        let tk = l.shape().dims().last().copied().unwrap_or(1);
        let s = layout_slice::<T>(s, l, "masked_softmax")?;
        let mask_storage = self.mask.as_ref().map(|m| m.storage_and_layout());
        let mask: Option<&[T]> = match &mask_storage {
            Some((g, ml)) => {
                let candle_core::Storage::Cpu(ms) = &**g else {
                    candle_core::bail!("masked_softmax: the CPU kernel got a non-CPU mask")
                };
                Some(layout_slice::<T>(ms, ml, "masked_softmax mask")?)
            }
            None => None,
        };
        let mut out = vec![T::zero(); s.len()];
        par_rows(&mut out, tk, |row, p| {
            let sr = &s[row * tk..(row + 1) * tk];
            let mr = mask.map(|m| {
                let b = if self.mask_batches > 1 {
                    row / self.rows_per_batch
                } else {
                    0
                };
                let at = (b * self.t + row % self.t) * tk;
                &m[at..at + tk]
            });
            let v = |j: usize| sr[j] + mr.map_or(T::zero(), |m| m[j]);
            let mut max = T::NEG_INFINITY;
            for j in 0..tk {
                if v(j) > max {
                    max = v(j);
                }
            }
            let mut z = T::zero();
            for (j, p) in p.iter_mut().enumerate() {
                *p = (v(j) - max).exp();
                z += *p;
            }
            for p in p.iter_mut() {
                *p /= z;
            }
        });
        Ok(T::to_cpu_storage_owned(out))
    }
}

impl CustomOp1 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax-with-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(_) => self.fwd_typed::<f32>(s, l)?,
            CpuStorage::F64(_) => self.fwd_typed::<f64>(s, l)?,
            _ => candle_core::bail!("masked_softmax kernel: scores must be f32 or f64"),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let shape = super::softmax_cuda::MaskShape {
            t: self.t,
            rows_per_batch: self.rows_per_batch,
            mask_batches: self.mask_batches,
        };
        let p = super::softmax_cuda::masked_softmax_fwd((s, l), self.mask.as_ref(), &shape)?;
        Ok((p, l.shape().clone()))
    }

    fn bwd(&self, _s: &Tensor, p: &Tensor, dp: &Tensor) -> candle_core::Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if p.device().is_cuda() {
            return Ok(Some(super::softmax_cuda::masked_softmax_bwd(p, dp)?));
        }
        // The CPU twin of the CUDA backward kernel (f32/f64 on the CPU).
        let dot = (dp * p)?.sum_keepdim(D::Minus1)?;
        Ok(Some((p * dp.broadcast_sub(&dot)?)?))
    }
}
