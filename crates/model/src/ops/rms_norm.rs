//! RMSNorm over the last dimension, `y = x / √(mean(x²) + ε) · w`, with a backward.
//!
//! With `r = (mean(x²) + ε)^(-1/2)` per row and `g = ∂y·w`:
//! `∂x = r·g − x·r³·(Σ g·x)/D` and `∂w = Σ_rows ∂y·x·r`.

use super::{kernels_apply, layout_slice, par_map, par_rows, with_slice, work_dtype, Real};
use anyhow::{bail, Context, Result};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};

/// RMSNorm of `x` `[.., D]` with `weight` `[D]`: the custom op (CPU f32/f64, CUDA f32/bf16), else
/// [`rms_norm_composed`]. Differentiable with respect to both.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let d = x.dim(D::Minus1).context("rms_norm: x has no dimensions")?;
    if weight.dims() != [d] {
        bail!(
            "rms_norm: weight has shape {:?}, expected [{d}] (the last dimension of x {:?})",
            weight.dims(),
            x.dims()
        );
    }
    let fits = !x.device().is_cuda() || d <= CUDA_BWD_MAX_D;
    if kernels_apply(x)
        && fits
        && weight.dtype() == x.dtype()
        && weight.device().same_device(x.device())
    {
        Ok(x.contiguous()?
            .apply_op2(&weight.contiguous()?, RmsNormOp { eps })?)
    } else {
        rms_norm_composed(x, weight, eps)
    }
}

/// RMSNorm from differentiable candle ops, as transformers computes it: normalise in f32
/// (f64 for f64 input), cast back, then scale by the weight.
pub fn rms_norm_composed(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(work_dtype(dtype))?;
    let inv = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let normed = xf.broadcast_mul(&inv)?.to_dtype(dtype)?;
    Ok(normed.broadcast_mul(weight)?)
}

/// The most columns the CUDA backward takes (wider rows use [`rms_norm_composed`] there):
/// one warp's f32 column sums fill 48 KiB of shared memory (Qwen's widest hidden size is
/// 8,192).
pub(crate) const CUDA_BWD_MAX_D: usize = 12 * 1024;

struct RmsNormOp {
    eps: f64,
}

/// `1/√(mean(x²) + ε)` of one row.
#[inline]
fn inv_rms<T: Real>(row: &[T], eps: f64) -> T {
    let ms = super::dot(row, row) / T::from_f64(row.len() as f64);
    T::one() / (ms + T::from_f64(eps)).sqrt()
}

fn forward<T: Real>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let d = w.len();
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, d, |i, y| {
        let xr = &x[i * d..(i + 1) * d];
        let r = inv_rms(xr, eps);
        for ((y, &xv), &wv) in y.iter_mut().zip(xr).zip(w) {
            *y = xv * r * wv;
        }
    });
    out
}

/// `(∂x, ∂w)` for upstream gradient `dy`.
fn backward<T: Real>(x: &[T], w: &[T], dy: &[T], eps: f64) -> (Vec<T>, Vec<T>) {
    let d = w.len();
    let rows = x.len() / d.max(1);
    let blocks = candle_core::utils::get_num_threads().clamp(1, rows.max(1));
    let per = rows.div_ceil(blocks.max(1)).max(1);
    let parts = par_map(rows.div_ceil(per), |b| {
        let (r0, r1) = (b * per, ((b + 1) * per).min(rows));
        let mut dx = vec![T::zero(); (r1 - r0) * d];
        let mut dw = vec![T::zero(); d];
        for (i, dxr) in (r0..r1).zip(dx.chunks_mut(d)) {
            let xr = &x[i * d..(i + 1) * d];
            let gr = &dy[i * d..(i + 1) * d];
            let r = inv_rms(xr, eps);
            let mut gx = T::zero();
            for ((&g, &wv), &xv) in gr.iter().zip(w).zip(xr) {
                gx += g * wv * xv;
            }
            let c = r * r * r * gx / T::from_f64(d as f64);
            for k in 0..d {
                dxr[k] = r * gr[k] * w[k] - xr[k] * c;
                dw[k] += gr[k] * xr[k] * r;
            }
        }
        (dx, dw)
    });
    let mut dx = Vec::with_capacity(x.len());
    let mut dw = vec![T::zero(); d];
    for (px, pw) in parts {
        dx.extend_from_slice(&px);
        for (a, b) in dw.iter_mut().zip(pw) {
            *a += b;
        }
    }
    (dx, dw)
}

impl RmsNormOp {
    fn fwd_typed<T: Real>(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = layout_slice::<T>(x, lx, "rms_norm")?;
        let w = layout_slice::<T>(w, lw, "rms_norm")?;
        Ok((
            T::to_cpu_storage_owned(forward(x, w, self.eps)),
            lx.shape().clone(),
        ))
    }

    fn bwd_typed<T: Real>(
        &self,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (dx, dw) = with_slice::<T, _>(x, "rms_norm backward", |xs| {
            with_slice::<T, _>(w, "rms_norm backward", |ws| {
                with_slice::<T, _>(dy, "rms_norm backward", |gs| backward(xs, ws, gs, self.eps))
            })
        })???;
        Ok((
            Tensor::from_vec(dx, x.shape(), x.device())?,
            Tensor::from_vec(dw, w.shape(), w.device())?,
        ))
    }
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "rms-norm-with-backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match (x, w) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => self.fwd_typed::<f32>(x, lx, w, lw),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => self.fwd_typed::<f64>(x, lx, w, lw),
            _ => candle_core::bail!("rms_norm kernel: x and weight must both be f32 or f64"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::rms_norm_fwd((x, lx), (w, lw), self.eps)?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let (dx, dw) = super::cuda::rms_norm_bwd(x, w, dy, self.eps)?;
            return Ok((Some(dx), Some(dw)));
        }
        let (dx, dw) = match x.dtype() {
            DType::F32 => self.bwd_typed::<f32>(x, w, dy)?,
            DType::F64 => self.bwd_typed::<f64>(x, w, dy)?,
            other => candle_core::bail!("rms_norm kernel: unsupported dtype {other:?}"),
        };
        Ok((Some(dx), Some(dw)))
    }
}

/// The decode step's residual add fused with the RMSNorm after it: `(s, rms_norm(s))` with
/// `s = x + delta` (rounded to the dtype first, as the unfused add would). One pass and one
/// launch instead of two. Inference only: the op has no backward (candle reports an error
/// rather than dropping a gradient); where the kernels do not apply it is the add and
/// [`rms_norm`].
pub fn add_rms_norm(
    x: &Tensor,
    delta: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    if x.dims() != delta.dims() {
        bail!(
            "add_rms_norm: x has shape {:?} but delta {:?}",
            x.dims(),
            delta.dims()
        );
    }
    let d = x
        .dim(D::Minus1)
        .context("add_rms_norm: x has no dimensions")?;
    if weight.dims() != [d] {
        bail!(
            "add_rms_norm: weight has shape {:?}, expected [{d}] (the last dimension of x {:?})",
            weight.dims(),
            x.dims()
        );
    }
    let same = |t: &Tensor| t.dtype() == x.dtype() && t.device().same_device(x.device());
    if kernels_apply(x) && same(delta) && same(weight) {
        // Both results in one buffer `[2, ..x]`: leading-axis halves stay contiguous.
        let both = x.contiguous()?.apply_op3(
            &delta.contiguous()?,
            &weight.contiguous()?,
            AddRmsNormOp { eps },
        )?;
        Ok((both.get(0)?, both.get(1)?))
    } else {
        let sum = (x + delta)?;
        let normed = rms_norm(&sum, weight, eps)?;
        Ok((sum, normed))
    }
}

struct AddRmsNormOp {
    eps: f64,
}

/// `[s | rms_norm(s)]` with `s = x + delta`, row by row.
fn add_forward<T: Real>(x: &[T], delta: &[T], w: &[T], eps: f64) -> Vec<T> {
    let d = w.len();
    let n = x.len();
    let mut out = vec![T::zero(); 2 * n];
    let (sums, normed) = out.split_at_mut(n);
    for ((s, &a), &b) in sums.iter_mut().zip(x).zip(delta) {
        *s = a + b;
    }
    let sums: &[T] = sums;
    par_rows(normed, d, |i, y| {
        let sr = &sums[i * d..(i + 1) * d];
        let r = inv_rms(sr, eps);
        for ((y, &sv), &wv) in y.iter_mut().zip(sr).zip(w) {
            *y = sv * r * wv;
        }
    });
    out
}

impl AddRmsNormOp {
    fn fwd_typed<T: Real>(
        &self,
        x: (&CpuStorage, &Layout),
        delta: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let xs = layout_slice::<T>(x.0, x.1, "add_rms_norm")?;
        let ds = layout_slice::<T>(delta.0, delta.1, "add_rms_norm")?;
        let ws = layout_slice::<T>(w.0, w.1, "add_rms_norm")?;
        Ok((
            T::to_cpu_storage_owned(add_forward(xs, ds, ws, self.eps)),
            stacked_shape(x.1),
        ))
    }
}

/// `[2, ..dims]`: the sum, then the normalised sum.
fn stacked_shape(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

impl CustomOp3 for AddRmsNormOp {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        delta: &CpuStorage,
        ld: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match (x, delta, w) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                self.fwd_typed::<f32>((x, lx), (delta, ld), (w, lw))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
                self.fwd_typed::<f64>((x, lx), (delta, ld), (w, lw))
            }
            _ => candle_core::bail!("add_rms_norm kernel: x, delta and weight must be f32 or f64"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        delta: &candle_core::CudaStorage,
        ld: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::add_rms_norm_fwd((x, lx), (delta, ld), (w, lw), self.eps)?;
        Ok((out, stacked_shape(lx)))
    }
}
