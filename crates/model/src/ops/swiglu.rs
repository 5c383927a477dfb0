//! SwiGLU gating `silu(gate) · up` with a backward.
//!
//! With `σ = 1/(1 + e^(−g))`: `∂gate = ∂y·up·σ·(1 + g·(1 − σ))`, `∂up = ∂y·g·σ`.

use super::{kernels_apply, layout_slice, par_rows, with_slice, Real};
use anyhow::{bail, Result};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

/// `silu(gate) · up` for two tensors of one shape: the custom op (CPU f32/f64, CUDA
/// f32/bf16), else
/// [`swiglu_composed`]. Differentiable with respect to both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!(
            "swiglu: gate {:?} and up {:?} must have one shape",
            gate.dims(),
            up.dims()
        );
    }
    if kernels_apply(gate) && up.dtype() == gate.dtype() {
        Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, SwigluOp)?)
    } else {
        swiglu_composed(gate, up)
    }
}

/// `silu(gate) · up` from the packed MLP projection `gate_up` `[.., 2·I]` (gate's `I` columns,
/// then up's: one product with the stacked weights) → `[.., I]`. The decode step's: one
/// launch, inference only (the kernel has no backward; candle reports an error rather than
/// dropping a gradient). Elsewhere the two halves through [`swiglu`].
pub fn swiglu_packed(gate_up: &Tensor) -> Result<Tensor> {
    let width = gate_up.dims().last().copied().unwrap_or(1);
    if width % 2 != 0 {
        bail!(
            "swiglu_packed: gate_up has shape {:?}, whose last axis is not [gate | up] (odd or none)",
            gate_up.dims()
        );
    }
    let inter = width / 2;
    if !kernels_apply(gate_up) {
        let axis = gate_up.rank() - 1;
        return swiglu(
            &gate_up.narrow(axis, 0, inter)?,
            &gate_up.narrow(axis, inter, inter)?,
        );
    }
    Ok(gate_up.contiguous()?.apply_op1(SwigluPackedOp)?)
}

/// `silu(gate) · up` from candle ops (candle's `silu` has a backward).
pub fn swiglu_composed(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok((candle_nn::ops::silu(gate)? * up)?)
}

struct SwigluOp;

/// Rows the element-wise loops are split into for threading.
const ROW: usize = 4096;

#[inline]
fn sigmoid<T: Real>(g: T) -> T {
    T::one() / (T::one() + (-g).exp())
}

fn forward<T: Real>(g: &[T], u: &[T]) -> Vec<T> {
    let mut out = vec![T::zero(); g.len()];
    par_rows(&mut out, ROW, |r, y| {
        let base = r * ROW;
        for (k, y) in y.iter_mut().enumerate() {
            let gv = g[base + k];
            *y = gv * sigmoid(gv) * u[base + k];
        }
    });
    out
}

/// [`forward`] on packed rows `[gate | up]` of `2·inter`.
fn forward_packed<T: Real>(gate_up: &[T], inter: usize) -> Vec<T> {
    let mut out = vec![T::zero(); gate_up.len() / 2];
    par_rows(&mut out, inter.max(1), |r, y| {
        let row = &gate_up[2 * inter * r..2 * inter * (r + 1)];
        let (g, u) = row.split_at(inter);
        for (k, y) in y.iter_mut().enumerate() {
            *y = g[k] * sigmoid(g[k]) * u[k];
        }
    });
    out
}

struct SwigluPackedOp;

/// `I` and the output shape `[.., I]` of packed rows `[.., 2·I]` (`swiglu_packed` checked the
/// rank and the even width).
fn packed_output(l: &Layout) -> (usize, Shape) {
    let mut dims = l.shape().dims().to_vec();
    let last = dims.last_mut().expect("rank ≥ 1");
    *last /= 2;
    (*last, Shape::from(dims))
}

impl CustomOp1 for SwigluPackedOp {
    fn name(&self) -> &'static str {
        "swiglu-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (inter, shape) = packed_output(l);
        let out = match s {
            CpuStorage::F32(_) => {
                CpuStorage::F32(forward_packed(layout_slice(s, l, "swiglu_packed")?, inter))
            }
            CpuStorage::F64(_) => {
                CpuStorage::F64(forward_packed(layout_slice(s, l, "swiglu_packed")?, inter))
            }
            _ => candle_core::bail!("swiglu_packed kernel: f32 or f64 on the CPU"),
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (inter, shape) = packed_output(l);
        let y = super::cuda::swiglu_packed_fwd((s, l), inter)?;
        Ok((y, shape))
    }
}

/// `[∂gate | ∂up]` concatenated (one buffer, split by the caller).
fn backward<T: Real>(g: &[T], u: &[T], dy: &[T]) -> Vec<T> {
    let n = g.len();
    let mut out = vec![T::zero(); 2 * n];
    let (dg, du) = out.split_at_mut(n);
    par_rows(dg, ROW, |r, dg| {
        let base = r * ROW;
        for (k, d) in dg.iter_mut().enumerate() {
            let (gv, s) = (g[base + k], sigmoid(g[base + k]));
            *d = dy[base + k] * u[base + k] * s * (T::one() + gv * (T::one() - s));
        }
    });
    par_rows(du, ROW, |r, du| {
        let base = r * ROW;
        for (k, d) in du.iter_mut().enumerate() {
            let gv = g[base + k];
            *d = dy[base + k] * gv * sigmoid(gv);
        }
    });
    out
}

impl SwigluOp {
    fn bwd_typed<T: Real>(
        g: &Tensor,
        u: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let both = with_slice::<T, _>(g, "swiglu backward", |gs| {
            with_slice::<T, _>(u, "swiglu backward", |us| {
                with_slice::<T, _>(dy, "swiglu backward", |ds| backward(gs, us, ds))
            })
        })???;
        let n = g.elem_count();
        let both = Tensor::from_vec(both, 2 * n, g.device())?;
        Ok((
            both.narrow(0, 0, n)?.reshape(g.shape())?,
            both.narrow(0, n, n)?.reshape(u.shape())?,
        ))
    }
}

impl CustomOp2 for SwigluOp {
    fn name(&self) -> &'static str {
        "swiglu-with-backward"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        lg: &Layout,
        u: &CpuStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = match (g, u) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(forward(
                layout_slice::<f32>(g, lg, "swiglu")?,
                layout_slice::<f32>(u, lu, "swiglu")?,
            )),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(forward(
                layout_slice::<f64>(g, lg, "swiglu")?,
                layout_slice::<f64>(u, lu, "swiglu")?,
            )),
            _ => candle_core::bail!("swiglu kernel: gate and up must both be f32 or f64"),
        };
        Ok((out, lg.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        u: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::swiglu_fwd((g, lg), (u, lu))?;
        Ok((y, lg.shape().clone()))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if g.device().is_cuda() {
            let n = g.elem_count();
            let both = super::cuda::swiglu_bwd(g, u, dy)?;
            return Ok((
                Some(both.narrow(0, 0, n)?.reshape(g.shape())?),
                Some(both.narrow(0, n, n)?.reshape(u.shape())?),
            ));
        }
        let (dg, du) = match g.dtype() {
            DType::F32 => Self::bwd_typed::<f32>(g, u, dy)?,
            DType::F64 => Self::bwd_typed::<f64>(g, u, dy)?,
            other => candle_core::bail!("swiglu kernel: unsupported dtype {other:?}"),
        };
        Ok((Some(dg), Some(du)))
    }
}
