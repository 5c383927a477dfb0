//! Launchers of deterministic mode's batch-invariant kernels (`rows_invariant_kernels.cuh`, in
//! the decode PTX module): the product of [`super::linear_rows_invariant`] and the attention of
//! [`super::attend_one_rows_invariant`] on CUDA, f32 and bf16 with f32 sums. Their CPU twins are
//! those functions' CPU bodies; `tests/deterministic_and_cache.rs` on
//! `COMPOSER_TEST_DEVICE=cuda` checks the bits on a GPU, `tools/cuda_emu/rows_invariant.cpp`
//! the kernels on the CPU.

use super::cuda::{alloc, kernel_name, on_tensors, typed, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Result, Shape, Storage, Tensor};
use half::bf16;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode.ptx"));
const MODULE: &str = "composer_model_decode";

/// Weight rows per block of `rows_linear` (`RI_WARPS`, one warp each).
const ROWS_LINEAR_WARPS: usize = 8;
/// Warps per block of `attend_one` (`RA_WARPS`).
const ATTEND_WARPS: usize = 8;
/// Largest head_dim of `attend_one` (`RA_MAX_D`).
pub(super) const ATTEND_MAX_HEAD_DIM: usize = 256;

/// `x` `[rows, k]` times `wᵀ` (`w` `[n, k]`), both on one CUDA device in f32 or bf16:
/// `[rows, n]`, each row alone in a fixed order.
pub(super) fn rows_linear(
    x: &Tensor,
    w: &Tensor,
    rows: usize,
    n: usize,
    k: usize,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let ints = [rows as i32, n as i32, k as i32];
    if [rows, n, k].iter().any(|&v| v > i32::MAX as usize) {
        candle_core::bail!(
            "linear_rows_invariant: {rows} × {k} · [{n}, {k}] is past the kernel's 32-bit sizes"
        )
    }
    on_tensors(
        &[x, w],
        Shape::from((rows, n)),
        "linear_rows_invariant",
        |a| {
            let dev = a[0].0.device().clone();
            typed!(dtype, "linear_rows_invariant", |T| {
                let xv = view::<T>(a[0].0, a[0].1, "linear_rows_invariant x")?;
                let wv = view::<T>(a[1].0, a[1].1, "linear_rows_invariant w")?;
                let y = alloc::<T>(&dev, rows * n)?;
                let f =
                    dev.get_or_load_custom_func(&kernel_name("rows_linear", dtype)?, MODULE, PTX)?;
                let mut b = f.builder();
                b.arg(&xv).arg(&wv).arg(&y);
                for v in &ints {
                    b.arg(v);
                }
                let cfg = LaunchConfig {
                    grid_dim: (n.div_ceil(ROWS_LINEAR_WARPS).max(1) as u32, 1, 1),
                    block_dim: (32 * ROWS_LINEAR_WARPS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: the arguments match the kernel's signature; x holds rows·k, w n·k and
                // y rows·n elements (contiguous views of those shapes).
                unsafe { b.launch(cfg) }.w()?;
                Ok(T::wrap_cuda_slice(y, dev))
            })
        },
    )
}

/// The `t` queries of each row, `q` `[rows, t, hq, d]`, over the first `keys` of `k`/`v`
/// `[rows, hkv, keys, d]` causally (query `i` over `keys − t + i + 1`; read in place through
/// strides k and v share, the last axis contiguous, as the dense KV cache's narrowed buffers
/// are); `[rows, t, hq, d]`. The caller checked the shapes (`keys ≥ t ≥ 1`, rows ≥ 1) and
/// the layout.
pub(super) fn attend_one(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let dtype = q.dtype();
    let q = q.contiguous()?;
    let (rows, t, hq, d) = q.dims4()?;
    let (_, hkv, len, _) = k.dims4()?;
    // The kernel reads keys and values through k's strides (the caller gave both one layout).
    let st = k.layout().stride();
    if [rows * t * hq, len, d]
        .iter()
        .any(|&n| n > i32::MAX as usize)
    {
        candle_core::bail!("attend_one_rows_invariant: past the kernel's 32-bit sizes")
    }
    // The furthest element a block reads past the start (checked against the storages below).
    let reach = (rows - 1) * st[0] + (hkv - 1) * st[1] + (len - 1) * st[2] + d;
    let (s_row, s_head, s_key) = (st[0] as i64, st[1] as i64, st[2] as i64);
    let ints = [hq as i32, hkv as i32, d as i32, t as i32, (len - t) as i32];
    let scale = scale as f32;
    let (qg, ql) = q.storage_and_layout();
    let (kg, kl) = k.storage_and_layout();
    let (vg, vl) = v.storage_and_layout();
    let (Storage::Cuda(qs), Storage::Cuda(ks), Storage::Cuda(vs)) = (&*qg, &*kg, &*vg) else {
        candle_core::bail!("attend_one_rows_invariant: the CUDA kernel got a non-CUDA tensor")
    };
    let dev = qs.device().clone();
    let out = typed!(dtype, "attend_one_rows_invariant", |T| {
        let qv = view::<T>(qs, ql, "attend_one_rows_invariant q")?;
        let kv = reaching::<T>(ks, kl.start_offset(), reach)?;
        let vv = reaching::<T>(vs, vl.start_offset(), reach)?;
        let out = alloc::<T>(&dev, rows * t * hq * d)?;
        let f = dev.get_or_load_custom_func(&kernel_name("attend_one", dtype)?, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&qv).arg(&kv).arg(&vv).arg(&out);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&s_row).arg(&s_head).arg(&s_key).arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: ((rows * t * hq) as u32, 1, 1),
            block_dim: (32 * ATTEND_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; every key and value the blocks
        // read lies within `reach` of the views' starts (checked above), q holds rows·t·hq·d.
        unsafe { b.launch(cfg) }.w()?;
        T::wrap_cuda_slice(out, dev.clone())
    });
    Ok(Tensor::from_storage(
        Storage::Cuda(out),
        Shape::from((rows, t, hq, d)),
        BackpropOp::none(),
        false,
    ))
}

/// The `reach` elements of `s` from `start` (a strided view's extent), refused past the storage.
fn reaching<T: CudaDType>(
    s: &candle_core::CudaStorage,
    start: usize,
    reach: usize,
) -> Result<CudaView<'_, T>> {
    let all = s.as_cuda_slice::<T>()?;
    if start + reach > all.len() {
        candle_core::bail!("attend_one_rows_invariant: the cache view reaches past its storage")
    }
    Ok(all.slice(start..start + reach))
}
