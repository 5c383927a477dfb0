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
//!
//! A bias is added in place to the fresh product (a separate `broadcast_add` was another pass
//! over the output and, on CUDA, candle's strided broadcast kernel: the q/k/v biases of the
//! Qwen2 shapes); its gradient is `∂y` summed over the rows, as the broadcast's was.

use anyhow::{Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Storage, Tensor, D};

/// `x` `[.., in]` times `wᵀ` for `w` `[out, in]`, plus `bias` `[out]` if given, giving
/// `[.., out]`: the same values in and out of a graph; in one, a single node whose backward
/// forms `∂x`, and `∂w` and `∂bias` when `w` is trainable.
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (out_w, _) = check_product(x, w, "linear")?;
    if let Some(b) = bias {
        if b.dims() != [out_w] || b.dtype() != w.dtype() {
            anyhow::bail!(
                "linear: bias {:?} {:?} does not fit w {:?} {:?}",
                b.dims(),
                b.dtype(),
                w.dims(),
                w.dtype()
            );
        }
    }
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    let bias = bias.map(Tensor::contiguous).transpose()?;
    Ok(match (w.track_op(), bias) {
        (true, None) => x.apply_op2(&w, Matmul)?,
        (true, Some(b)) => x.apply_op3(&w, &b, Matmul)?,
        // A trainable bias on a frozen weight: the bias its own node.
        (false, Some(b)) if b.track_op() => x
            .apply_op1(FrozenMatmul { w, bias: None })?
            .broadcast_add(&b)?,
        (false, bias) => x.apply_op1(FrozenMatmul { w, bias })?,
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

/// The CPU product plus `b` (if any), added in place.
fn product_cpu(
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    b: Option<(&CpuStorage, &Layout)>,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let (mut y, shape) = product(x.0, x.1, w.0, w.1)?;
    if let Some((b, lb)) = b {
        add_bias_cpu(&mut y, b, lb)?;
    }
    Ok((y, shape))
}

/// `y[r, c] += b[c]` in place, rounded to the dtype as candle's add of the two is.
fn add_bias_cpu(y: &mut CpuStorage, b: &CpuStorage, lb: &Layout) -> candle_core::Result<()> {
    fn rows<T: Copy + std::ops::Add<Output = T>>(y: &mut [T], b: &[T]) {
        for row in y.chunks_mut(b.len().max(1)) {
            for (v, &c) in row.iter_mut().zip(b) {
                *v = *v + c;
            }
        }
    }
    let (a, e) = super::contiguous_range(lb, "linear", "bias")?;
    match (y, b) {
        (CpuStorage::F32(y), CpuStorage::F32(b)) => rows(y, &b[a..e]),
        (CpuStorage::F64(y), CpuStorage::F64(b)) => rows(y, &b[a..e]),
        (CpuStorage::BF16(y), CpuStorage::BF16(b)) => rows(y, &b[a..e]),
        (CpuStorage::F16(y), CpuStorage::F16(b)) => rows(y, &b[a..e]),
        _ => candle_core::bail!("linear: the bias's dtype is not the product's"),
    }
    Ok(())
}

/// `w`'s `(out, in)` when `x` `[.., in]` and `w` `[out, in]` fit a product `x · wᵀ` (same
/// dtype), else an error naming `op` and both.
pub(super) fn check_product(x: &Tensor, w: &Tensor, op: &str) -> Result<(usize, usize)> {
    let (out_w, in_w) = w
        .dims2()
        .with_context(|| format!("{op}: w must be [out_features, in_features]"))?;
    let in_f = x
        .dim(D::Minus1)
        .with_context(|| format!("{op}: x has no dimensions"))?;
    if in_f != in_w || x.dtype() != w.dtype() {
        anyhow::bail!(
            "{op}: x {:?} {:?} and w {:?} {:?} do not fit",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    Ok((out_w, in_w))
}

/// The CUDA product plus `b` (if any), added in place (`bias_add_rows`).
#[cfg(feature = "cuda")]
fn product_cuda(
    x: (&candle_core::CudaStorage, &Layout),
    w: (&candle_core::CudaStorage, &Layout),
    b: Option<(&candle_core::CudaStorage, &Layout)>,
) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
    let (mut y, shape) = product(x.0, x.1, w.0, w.1)?;
    if let Some(b) = b {
        bias_add_rows(&mut y, shape.elem_count(), b)?;
    }
    Ok((y, shape))
}

/// `∂y` `[.., n]` as `[m, n]` with `m` the rows of `x`.
fn rows_of(dy: &Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
    let n = dy.dim(D::Minus1)?;
    dy.reshape((x.elem_count() / x.dim(D::Minus1)?.max(1), n))
}

/// The product with a trainable weight (and bias, if one is given).
struct Matmul;

impl Matmul {
    /// `(∂x, ∂w, ∂y` as `[m, n])`.
    fn grads(x: &Tensor, w: &Tensor, dy: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        // Detached: the backward's own products need no graph.
        let (x, w) = (x.detach(), w.detach());
        let dy2 = rows_of(dy, &x)?;
        let dx = dy2.matmul(&w)?.reshape(x.shape())?;
        let x2 = x.reshape((dy2.dim(0)?, w.dim(1)?))?;
        let dw = dy2.t()?.matmul(&x2)?;
        Ok((dx, dw, dy2))
    }
}

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
        product_cpu((x, lx), (w, lw), None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        product_cuda((x, lx), (w, lw), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = Self::grads(x, w, dy)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for Matmul {
    fn name(&self) -> &'static str {
        "linear-bias"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        product_cpu((x, lx), (w, lw), Some((b, lb)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        product_cuda((x, lx), (w, lw), Some((b, lb)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, dy2) = Self::grads(x, w, dy)?;
        // In ∂y's dtype, as the broadcast add's backward summed it.
        let db = dy2.sum(0)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The product with a frozen weight (and frozen bias, if any): only `∂x`.
struct FrozenMatmul {
    /// `[n, k]`, contiguous, not in any graph.
    w: Tensor,
    /// `[n]`, contiguous, not in any graph.
    bias: Option<Tensor>,
}

impl FrozenMatmul {
    /// Runs `f` on the weight's and the bias's storages, found by `pick` on x's backend.
    fn with_parts<S, R>(
        &self,
        pick: impl Fn(&Storage) -> Option<&S>,
        f: impl FnOnce((&S, &Layout), Option<(&S, &Layout)>) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let on_x = |what: &str| {
            candle_core::Error::Msg(format!("linear: the {what} is not on x's device"))
        };
        let (ws, wl) = self.w.storage_and_layout();
        let ws = pick(&ws).ok_or_else(|| on_x("weight"))?;
        let bias = self.bias.as_ref().map(|b| b.storage_and_layout());
        let b = match &bias {
            Some((s, l)) => Some((pick(s).ok_or_else(|| on_x("bias"))?, *l)),
            None => None,
        };
        f((ws, wl), b)
    }
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.with_parts(
            |s| match s {
                Storage::Cpu(s) => Some(s),
                _ => None,
            },
            |w, b| product_cpu((x, lx), w, b),
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.with_parts(
            |s| match s {
                Storage::Cuda(s) => Some(s),
                _ => None,
            },
            |w, b| product_cuda((x, lx), w, b),
        )
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(rows_of(dy, x)?.matmul(&self.w)?.reshape(x.shape())?))
    }
}

/// Launches `bias_add_rows` (`linear_kernels.cuh`) on the fresh product `y` (its first
/// `total` elements: `[total / n, n]`) with `b` `[n]`.
#[cfg(feature = "cuda")]
fn bias_add_rows(
    y: &mut candle_core::CudaStorage,
    total: usize,
    b: (&candle_core::CudaStorage, &Layout),
) -> candle_core::Result<()> {
    use super::cuda::{elementwise_config, kernel_name, typed, view, MODULE, PTX};
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::DType;
    use half::bf16;
    let dev = y.device().clone();
    let dtype = y.dtype();
    let n = b.1.shape().elem_count();
    typed!(dtype, "linear bias", |T| {
        let bv = view::<T>(b.0, b.1, "linear bias")?;
        let ys = y.as_cuda_slice_mut::<T>()?;
        if ys.len() < total || !total.is_multiple_of(n.max(1)) {
            candle_core::bail!(
                "linear bias: a product of {} elements for {total}",
                ys.len()
            )
        }
        let (rows, n_i) = ((total / n.max(1)) as u64, n as i32);
        let f = dev.get_or_load_custom_func(&kernel_name("bias_add_rows", dtype)?, MODULE, PTX)?;
        let mut builder = f.builder();
        builder.arg(ys).arg(&bv).arg(&rows).arg(&n_i);
        // SAFETY: (y, b, rows, n) as the kernel takes them; y holds rows·n elements, b n.
        unsafe { builder.launch(elementwise_config(total.div_ceil(8))) }.w()?;
        Ok(())
    })
}
