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
    check_tables("rope", x, n, d, cos, sin)?;
    match kernel_op(x, cos, sin, RopeLayout::Tokens)? {
        Some(y) => Ok(y),
        None => rope_composed(x, cos, sin),
    }
}

/// RoPE of `x` `[B, T, H, D]` with `cos`/`sin` `[B·T, D/2]`, returned in attention's layout
/// `[B, H, T, D]`: the rotation and the transpose as one op (one graph node, one pass) where
/// the kernels apply; else [`rope`], then the transpose.
pub fn rope_to_heads(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, t, h, d) = x
        .dims4()
        .context("rope_to_heads: x must be [batch, tokens, heads, head_dim]")?;
    check_tables("rope_to_heads", x, b * t, d, cos, sin)?;
    match kernel_op(x, cos, sin, RopeLayout::ToHeads)? {
        Some(y) => Ok(y),
        None => {
            let y = rope(&x.reshape((b * t, h, d))?, cos, sin)?;
            Ok(y.reshape((b, t, h, d))?.transpose(1, 2)?.contiguous()?)
        }
    }
}

/// `head_dim` `d` is even and `cos`, `sin` are `[n, d/2]`.
fn check_tables(
    what: &str,
    x: &Tensor,
    n: usize,
    d: usize,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<()> {
    if !d.is_multiple_of(2) {
        bail!("{what}: head_dim {d} is odd");
    }
    for (name, t) in [("cos", cos), ("sin", sin)] {
        if t.dims() != [n, d / 2] {
            bail!(
                "{what}: {name} has shape {:?}, expected [{n}, {}] for x {:?}",
                t.dims(),
                d / 2,
                x.dims()
            );
        }
    }
    Ok(())
}

/// The custom op in `layout` where the kernels apply (tables in x's dtype); `None` elsewhere.
fn kernel_op(x: &Tensor, cos: &Tensor, sin: &Tensor, layout: RopeLayout) -> Result<Option<Tensor>> {
    if !(kernels_apply(x) && cos.dtype() == x.dtype() && sin.dtype() == x.dtype()) {
        return Ok(None);
    }
    Ok(Some(x.contiguous()?.apply_op1(RopeOp {
        cos: cos.detach().contiguous()?,
        sin: sin.detach().contiguous()?,
        inverse: false,
        layout,
    })?))
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
    layout: RopeLayout,
}

/// What the op reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RopeLayout {
    /// `[N, H, D]` in and out.
    Tokens,
    /// `[B, T, H, D]` in, `[B, H, T, D]` out.
    ToHeads,
    /// `[B, H, T, D]` in, `[B, T, H, D]` out: the backward of `ToHeads`.
    FromHeads,
}

impl RopeLayout {
    /// The layout of the backward (the same map run the other way).
    fn reversed(self) -> Self {
        match self {
            RopeLayout::Tokens => RopeLayout::Tokens,
            RopeLayout::ToHeads => RopeLayout::FromHeads,
            RopeLayout::FromHeads => RopeLayout::ToHeads,
        }
    }

    /// `(N, H, D, T)` of an input of shape `dims` (T = 0 for token-major) and the output's
    /// shape.
    pub(crate) fn dims(
        self,
        dims: &[usize],
    ) -> candle_core::Result<((usize, usize, usize, usize), Shape)> {
        let bad = || candle_core::Error::Msg(format!("rope: input of shape {dims:?} for {self:?}"));
        Ok(match (self, dims) {
            (RopeLayout::Tokens, &[n, h, d]) => ((n, h, d, 0), Shape::from((n, h, d))),
            (RopeLayout::ToHeads, &[b, t, h, d]) => ((b * t, h, d, t), Shape::from((b, h, t, d))),
            (RopeLayout::FromHeads, &[b, h, t, d]) => ((b * t, h, d, t), Shape::from((b, t, h, d))),
            _ => return Err(bad()),
        })
    }

    /// The kernel's `heads_major`: which side is `[B, H, T, D]` (0 none, 1 the input, 2 the
    /// output).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn heads_major(self) -> i32 {
        match self {
            RopeLayout::Tokens => 0,
            RopeLayout::FromHeads => 1,
            RopeLayout::ToHeads => 2,
        }
    }
}

/// The rotation of `n` tokens × `heads` head vectors; `t_len` tokens per batch row where
/// `layout` puts one side in `[B, H, T, D]`. One output head vector per parallel row.
#[allow(clippy::too_many_arguments)]
fn rotate<T: Real>(
    x: &[T],
    cos: &[T],
    sin: &[T],
    heads: usize,
    d: usize,
    t_len: usize,
    layout: RopeLayout,
    inv: bool,
) -> Vec<T> {
    let half = d / 2;
    let h = heads;
    let t_len = t_len.max(1);
    let tokens_base = |tok: usize, head: usize| (tok * h + head) * d;
    let heads_base =
        |tok: usize, head: usize| (((tok / t_len) * h + head) * t_len + tok % t_len) * d;
    let mut out = vec![T::zero(); x.len()];
    par_rows(&mut out, d, |vec, o| {
        // This output vector's token and head.
        let (tok, head) = match layout {
            RopeLayout::ToHeads => {
                let (plane, tt) = (vec / t_len, vec % t_len);
                ((plane / h) * t_len + tt, plane % h)
            }
            RopeLayout::Tokens | RopeLayout::FromHeads => (vec / h, vec % h),
        };
        let xb = match layout {
            RopeLayout::FromHeads => heads_base(tok, head),
            RopeLayout::Tokens | RopeLayout::ToHeads => tokens_base(tok, head),
        };
        let xh = &x[xb..xb + d];
        let (c, sn) = (
            &cos[tok * half..(tok + 1) * half],
            &sin[tok * half..(tok + 1) * half],
        );
        let (o1, o2) = o.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (xh[i], xh[i + half]);
            let s = if inv { -sn[i] } else { sn[i] };
            o1[i] = x1 * c[i] - x2 * s;
            o2[i] = x2 * c[i] + x1 * s;
        }
    });
    out
}

impl RopeOp {
    fn fwd_typed<T: Real>(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<CpuStorage> {
        let ((_, heads, d, t_len), _) = self.layout.dims(l.dims())?;
        let xs = layout_slice::<T>(x, l, "rope")?;
        let out = with_slice::<T, _>(&self.cos, "rope", |c| {
            with_slice::<T, _>(&self.sin, "rope", |s| {
                rotate(xs, c, s, heads, d, t_len, self.layout, self.inverse)
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
        Ok((out, self.layout.dims(l.dims())?.1))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::rope((x, l), &self.cos, &self.sin, self.inverse, self.layout)?;
        Ok((y, self.layout.dims(l.dims())?.1))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if !matches!(dy.dtype(), DType::F32 | DType::F64 | DType::BF16) {
            candle_core::bail!("rope kernel: unsupported gradient dtype {:?}", dy.dtype());
        }
        let inverse = RopeOp {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            inverse: !self.inverse,
            layout: self.layout.reversed(),
        };
        Ok(Some(dy.contiguous()?.apply_op1(inverse)?))
    }
}
