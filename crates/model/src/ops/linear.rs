//! `x · wᵀ` — the decoder's projections — as one autograd node with the backward each case
//! needs.
//!
//! candle's `x.matmul(&w.t())` puts a transpose node, the product and (for `[B, T, in]`
//! inputs) two reshapes into the graph, and its backward accumulates a `zeros + grad` buffer
//! for each: for the weight one in the transposed layout (a strided add) before the weight's
//! own, and for a frozen weight (LoRA's base) a weight-sized product that nothing reads (7B:
//! 15 GB and a third of the backward's FLOPs). Here the product is one custom op over the
//! storages' matmul (cuBLAS on CUDA) for any number of leading dimensions: a trainable weight
//! gets `∂w = ∂yᵀ·x` formed directly as `[out, in]`, a frozen one none, and `∂x = ∂y·w`.

use anyhow::{Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Storage, Tensor, D};

/// `x` `[.., in]` times `wᵀ` for `w` `[out, in]`, giving `[.., out]`: the same product in and
/// out of a graph; in one, a single node whose backward forms `∂x`, and `∂w` when `w` is
/// trainable.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (_, in_w) = w
        .dims2()
        .context("linear: w must be [out_features, in_features]")?;
    let in_f = x.dim(D::Minus1).context("linear: x has no dimensions")?;
    if in_f != in_w || x.dtype() != w.dtype() {
        anyhow::bail!(
            "linear: x {:?} {:?} and w {:?} {:?} do not fit",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    Ok(if w.track_op() {
        x.apply_op2(&w, Matmul)?
    } else {
        x.apply_op1(FrozenMatmul { w })?
    })
}

/// `x · wᵀ` on storages: `x` `[.., k]` and `w` `[n, k]`, both contiguous; returns the product
/// `[.., n]`.
fn product<S: BackendStorage>(
    x: &S,
    lx: &Layout,
    w: &S,
    lw: &Layout,
) -> candle_core::Result<(S, Shape)> {
    let k = lx.dims().last().copied().unwrap_or(0);
    let m = lx.shape().elem_count() / k.max(1);
    let (n, _) = lw.shape().dims2()?;
    let x2 = Layout::contiguous_with_offset((m, k), lx.start_offset());
    let mut dims = lx.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    Ok((
        x.matmul(w, (1, m, n, k), &x2, &lw.transpose(0, 1)?)?,
        Shape::from(dims),
    ))
}

/// `∂y` `[.., n]` as `[m, n]` with `m` the rows of `x`.
fn rows_of(dy: &Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
    let n = dy.dim(D::Minus1)?;
    dy.reshape((x.elem_count() / x.dim(D::Minus1)?.max(1), n))
}

/// The product with a trainable weight.
struct Matmul;

impl CustomOp2 for Matmul {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        product(x, lx, w, lw)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        product(x, lx, w, lw)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // Detached: the backward's own products need no graph.
        let (x, w) = (x.detach(), w.detach());
        let dy2 = rows_of(dy, &x)?;
        let dx = dy2.matmul(&w)?.reshape(x.shape())?;
        let x2 = x.reshape((dy2.dim(0)?, w.dim(1)?))?;
        let dw = dy2.t()?.matmul(&x2)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// The product with a frozen weight: only `∂x`.
struct FrozenMatmul {
    /// `[n, k]`, contiguous, not in any graph.
    w: Tensor,
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (ws, wl) = self.w.storage_and_layout();
        let Storage::Cpu(ws) = &*ws else {
            candle_core::bail!("linear: x on the CPU but the weight is not")
        };
        product(x, lx, ws, wl)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (ws, wl) = self.w.storage_and_layout();
        let Storage::Cuda(ws) = &*ws else {
            candle_core::bail!("linear: x on the GPU but the weight is not")
        };
        product(x, lx, ws, wl)
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(rows_of(dy, x)?.matmul(&self.w)?.reshape(x.shape())?))
    }
}
