//! Launchers of the softmax kernels in `kernels.cu` (with `head_kernels.cuh`): attention's
//! masked softmax and the LM head's softmax algebra, for contiguous f32 and bf16 storages. Their
//! CPU twins are the same custom ops' `cpu_fwd` (`masked_softmax.rs`, `head_softmax.rs`);
//! `tests/ops/` (`COMPOSER_TEST_DEVICE=cuda`) compares the two on a GPU.

use super::cuda::{alloc, kernel_name, on_tensors, rows_config, typed, view, MODULE, PTX};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::bf16;

/// Where the additive mask of a masked softmax is, and how rows map onto it.
pub(crate) struct MaskShape {
    /// Query positions per batch row (the mask's second axis).
    pub t: usize,
    /// Score rows per batch entry (heads × queries).
    pub rows_per_batch: usize,
    /// Leading size of the mask (1: shared by every batch entry).
    pub mask_batches: usize,
}

/// Softmax over the last axis of `s` `[rows, tk]` plus an f32 `mask` `[mask_batches, t, tk]`.
pub(crate) fn masked_softmax_fwd(
    s: (&CudaStorage, &Layout),
    mask: Option<&Tensor>,
    shape: &MaskShape,
) -> Result<CudaStorage> {
    let dtype = s.0.dtype();
    let dev = s.0.device().clone();
    let dims = s.1.shape().dims();
    let tk = *dims.last().unwrap_or(&1);
    let rows = s.1.shape().elem_count() / tk.max(1);
    let args = (
        rows as i32,
        tk as i32,
        shape.t as i32,
        shape.rows_per_batch as i32,
        shape.mask_batches as i32,
    );
    let mask = mask.map(|m| m.contiguous()).transpose()?;
    let guard = mask.as_ref().map(|m| m.storage_and_layout());
    let mask_view = match &guard {
        Some((g, l)) => {
            let Storage::Cuda(ms) = &**g else {
                candle_core::bail!("masked_softmax: the CUDA kernel got a non-CUDA mask")
            };
            Some(view::<f32>(ms, l, "masked_softmax mask")?)
        }
        None => None,
    };
    let null: u64 = 0;
    typed!(dtype, "masked_softmax", |T| {
        let sv = view::<T>(s.0, s.1, "masked_softmax")?;
        let p = alloc::<T>(&dev, rows * tk)?;
        let f =
            dev.get_or_load_custom_func(&kernel_name("masked_softmax_fwd", dtype)?, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&sv);
        match &mask_view {
            Some(mv) => b.arg(mv),
            None => b.arg(&null),
        };
        b.arg(&p)
            .arg(&args.0)
            .arg(&args.1)
            .arg(&args.2)
            .arg(&args.3)
            .arg(&args.4);
        // SAFETY: the arguments match the kernel's signature (a null mask pointer is allowed).
        unsafe { b.launch(rows_config(rows, tk)) }.w()?;
        Ok(T::wrap_cuda_slice(p, dev))
    })
}

/// Masked softmax backward from the probabilities `p` and their gradient `dp`.
pub(crate) fn masked_softmax_bwd(p: &Tensor, dp: &Tensor) -> Result<Tensor> {
    let dtype = p.dtype();
    let tk = p.dims().last().copied().unwrap_or(1);
    let rows = p.elem_count() / tk.max(1);
    let (rows_i, tk_i) = (rows as i32, tk as i32);
    on_tensors(
        &[p, dp],
        p.shape().clone(),
        "masked_softmax backward",
        |a| {
            let dev = a[0].0.device().clone();
            typed!(dtype, "masked_softmax backward", |T| {
                let pv = view::<T>(a[0].0, a[0].1, "masked_softmax")?;
                let gv = view::<T>(a[1].0, a[1].1, "masked_softmax")?;
                let out = alloc::<T>(&dev, rows * tk)?;
                let f = dev.get_or_load_custom_func(
                    &kernel_name("masked_softmax_bwd", dtype)?,
                    MODULE,
                    PTX,
                )?;
                let mut b = f.builder();
                b.arg(&pv).arg(&gv).arg(&out).arg(&rows_i).arg(&tk_i);
                // SAFETY: the arguments match the kernel's signature.
                unsafe { b.launch(rows_config(rows, tk)) }.w()?;
                Ok(T::wrap_cuda_slice(out, dev))
            })
        },
    )
}

/// `[rows, 2]` f32 `(lse, entropy)` of `softmax(z·inv_t)` per row of `z` `[rows, v]`.
pub(crate) fn head_row_stats(z: &Tensor, inv_t: f64) -> Result<Tensor> {
    let dtype = z.dtype();
    let (rows, v) = z.dims2()?;
    let (rows_i, v_i, inv_t_f) = (rows as i32, v as i32, inv_t as f32);
    on_tensors(&[z], Shape::from((rows, 2)), "head_row_stats", |a| {
        let dev = a[0].0.device().clone();
        typed!(dtype, "head_row_stats", |T| {
            let zv = view::<T>(a[0].0, a[0].1, "head_row_stats")?;
            let stats = alloc::<f32>(&dev, rows * 2)?;
            let f =
                dev.get_or_load_custom_func(&kernel_name("head_row_stats", dtype)?, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&zv).arg(&stats).arg(&rows_i).arg(&v_i).arg(&inv_t_f);
            // SAFETY: the arguments match the kernel's signature.
            unsafe { b.launch(rows_config(rows, v)) }.w()?;
            Ok(f32::wrap_cuda_slice(stats, dev))
        })
    })
}

/// `∂z` `[rows, v]` in z's dtype from f32 `stats` `[rows, 2]`, u32 `ids` `[rows, w]` (in range)
/// and f32 `grad` `[rows, w + 1]` (see `head_softmax.rs`).
pub(crate) fn head_logits_grad(
    z: &Tensor,
    stats: &Tensor,
    ids: &Tensor,
    grad: &Tensor,
    inv_t: f64,
) -> Result<Tensor> {
    let dtype = z.dtype();
    let (rows, v) = z.dims2()?;
    let w = ids.dim(1)?;
    let (rows_i, v_i, w_i, inv_t_f) = (rows as i32, v as i32, w as i32, inv_t as f32);
    on_tensors(
        &[z, stats, ids, grad],
        z.shape().clone(),
        "head_logits_grad",
        |a| {
            let dev = a[0].0.device().clone();
            typed!(dtype, "head_logits_grad", |T| {
                let zv = view::<T>(a[0].0, a[0].1, "head_logits_grad")?;
                let sv = view::<f32>(a[1].0, a[1].1, "head_logits_grad")?;
                let iv = view::<u32>(a[2].0, a[2].1, "head_logits_grad")?;
                let gv = view::<f32>(a[3].0, a[3].1, "head_logits_grad")?;
                let dz = alloc::<T>(&dev, rows * v)?;
                let f = dev.get_or_load_custom_func(
                    &kernel_name("head_logits_grad", dtype)?,
                    MODULE,
                    PTX,
                )?;
                let mut b = f.builder();
                b.arg(&zv)
                    .arg(&sv)
                    .arg(&iv)
                    .arg(&gv)
                    .arg(&dz)
                    .arg(&rows_i)
                    .arg(&v_i)
                    .arg(&w_i)
                    .arg(&inv_t_f);
                // SAFETY: the arguments match the kernel's signature; ids were checked in range.
                unsafe { b.launch(rows_config(rows, v)) }.w()?;
                Ok(T::wrap_cuda_slice(dz, dev))
            })
        },
    )
}
