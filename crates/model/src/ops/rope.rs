//! Rotary position embedding (rotate-half layout) with a backward.
//!
//! Per pair `(x₁, x₂)` = (element `i`, element `i + D/2`) of a head vector:
//! `r₁ = x₁·cos − x₂·sin`, `r₂ = x₂·cos + x₁·sin`. The map is a rotation, so its backward is
//! the rotation by the opposite angle (`sin` negated), computed by the same kernel.

use super::{kernels_apply, layout_slice, par_rows, with_slice, Real};
use anyhow::{bail, Context, Result};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};

/// RoPE of `x` `[N, H, D]` (N tokens, H heads) with `cos`, `sin` `[N, D/2]` (each token's
/// angles): the custom op (CPU f32/f64, CUDA f32/bf16; tables in x's dtype), else
/// [`rope_composed`].
/// Differentiable with respect to `x` (the tables are constants).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (n, _h, d) = x
        .dims3()
        .context("rope: x must be [tokens, heads, head_dim]")?;
    if d % 2 != 0 {
        bail!("rope: head_dim {d} is odd");
    }
    for (name, t) in [("cos", cos), ("sin", sin)] {
        if t.dims() != [n, d / 2] {
            bail!(
                "rope: {name} has shape {:?}, expected [{n}, {}] for x {:?}",
                t.dims(),
                d / 2,
                x.dims()
            );
        }
    }
    if kernels_apply(x) && cos.dtype() == x.dtype() && sin.dtype() == x.dtype() {
        Ok(x.contiguous()?.apply_op1(RopeOp {
            cos: cos.detach().contiguous()?,
            sin: sin.detach().contiguous()?,
            inverse: false,
        })?)
    } else {
        rope_composed(x, cos, sin)
    }
}

/// RoPE from differentiable candle ops. `x` `[N, H, D]` with `cos`/`sin` `[N, D/2]`, or
/// `x` `[B, H, T, D]` with `cos`/`sin` `[B, T, D/2]` (the tables broadcast over heads).
pub fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let cos = cos.unsqueeze(1)?;
    let sin = sin.unsqueeze(1)?;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Ok(Tensor::cat(&[&r1, &r2], D::Minus1)?)
}

/// The rotation by the tables' angles, or by their opposites when `inverse` (the backward).
struct RopeOp {
    cos: Tensor,
    sin: Tensor,
    inverse: bool,
}

fn rotate<T: Real>(x: &[T], cos: &[T], sin: &[T], heads: usize, d: usize, inv: bool) -> Vec<T> {
    let half = d / 2;
    let mut out = vec![T::zero(); x.len()];
    // One row = one token's H head vectors.
    par_rows(&mut out, heads * d, |n, row| {
        let (c, s) = (
            &cos[n * half..(n + 1) * half],
            &sin[n * half..(n + 1) * half],
        );
        let xr = &x[n * heads * d..(n + 1) * heads * d];
        for (o, xh) in row.chunks_mut(d).zip(xr.chunks(d)) {
            let (o1, o2) = o.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (xh[i], xh[i + half]);
                let sn = if inv { -s[i] } else { s[i] };
                o1[i] = x1 * c[i] - x2 * sn;
                o2[i] = x2 * c[i] + x1 * sn;
            }
        }
    });
    out
}

impl RopeOp {
    fn fwd_typed<T: Real>(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<CpuStorage> {
        let (_, heads, d) = l.shape().dims3()?;
        let xs = layout_slice::<T>(x, l, "rope")?;
        let out = with_slice::<T, _>(&self.cos, "rope", |c| {
            with_slice::<T, _>(&self.sin, "rope", |s| {
                rotate(xs, c, s, heads, d, self.inverse)
            })
        })??;
        Ok(T::to_cpu_storage_owned(out))
    }
}

impl CustomOp1 for RopeOp {
    fn name(&self) -> &'static str {
        "rope-with-backward"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match x {
            CpuStorage::F32(_) => self.fwd_typed::<f32>(x, l)?,
            CpuStorage::F64(_) => self.fwd_typed::<f64>(x, l)?,
            _ => candle_core::bail!("rope kernel: x must be f32 or f64"),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::rope((x, l), &self.cos, &self.sin, self.inverse)?;
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if !matches!(dy.dtype(), DType::F32 | DType::F64 | DType::BF16) {
            candle_core::bail!("rope kernel: unsupported gradient dtype {:?}", dy.dtype());
        }
        let inverse = RopeOp {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            inverse: !self.inverse,
        };
        Ok(Some(dy.contiguous()?.apply_op1(inverse)?))
    }
}
