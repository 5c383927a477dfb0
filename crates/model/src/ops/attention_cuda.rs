//! Launchers of the causal variable-length GQA attention kernels (`varlen_attn_*` in
//! `attention_kernels.cu`, their own PTX module): the forward (output and per-row
//! log-sum-exp) and the backward (`delta = rowsum(∂O·O)`, then `∂Q` per query tile and
//! `∂K`/`∂V` per key tile, no atomics). bf16 with head_dim 64 or 128 runs the tensor-core
//! kernels (`*_tc_*`, mma.sync), everything else the scalar ones. Their CPU twin is
//! `attention_cpu`; `tests/ops_attention.rs` compares both against the composition.

use super::attention_cpu::Dims;
use super::cuda::{alloc, kernel_name, launch_opted_in, on_tensors, typed, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::bf16;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
const MODULE: &str = "composer_model_attention";

/// Warps per block of every attention kernel (`ATT_WARPS`).
const WARPS: usize = 4;

/// The largest any attention kernel asks for (the tensor-core forward and ∂K/∂V at head_dim
/// 128, opted in by [`launch_opted_in`]): 99 KiB is the least an sm_80+ card allows a block.
const MAX_SHARED_BYTES: usize = 99 * 1024;

/// The tiles of one head_dim class, as instantiated by `ATT_INSTANTIATE` in attention_kernels.cu (the
/// kernels check the row count and shared memory they are launched with against their own).
struct Tiles {
    /// Largest head_dim of the class (the kernels' name suffix `_d{dmax}`).
    dmax: usize,
    /// Query rows per warp in the forward, and keys per shared tile.
    fwd_rpw: usize,
    fwd_bk: usize,
    /// Query rows per warp in the ∂Q kernel, and keys per shared tile.
    dq_rpw: usize,
    dq_bk: usize,
    /// Key rows per warp in the ∂K/∂V kernel, and queries per shared tile.
    dkv_rpw: usize,
    dkv_bq: usize,
}

const TILES: [Tiles; 3] = [
    Tiles {
        dmax: 64,
        fwd_rpw: 8,
        fwd_bk: 32,
        dq_rpw: 8,
        dq_bk: 32,
        dkv_rpw: 8,
        dkv_bq: 32,
    },
    Tiles {
        dmax: 128,
        fwd_rpw: 6,
        fwd_bk: 32,
        dq_rpw: 3,
        dq_bk: 32,
        dkv_rpw: 3,
        dkv_bq: 32,
    },
    Tiles {
        dmax: 256,
        fwd_rpw: 3,
        fwd_bk: 16,
        dq_rpw: 1,
        dq_bk: 16,
        dkv_rpw: 1,
        dkv_bq: 16,
    },
];

/// Head dims the tensor-core kernels (`varlen_attn_*_tc_d{D}_bf16`) are instantiated for.
const TC_HEAD_DIMS: [usize; 2] = [64, 128];

/// Rows per block of the tensor-core kernels (16 per warp): queries, or keys in ∂K/∂V.
const TC_ROWS: usize = 16 * WARPS;

/// The tensor-core kernels' tiles through shared memory (their `BK`/`BQ`): keys per tile of
/// the forward and of ∂Q, queries per step of ∂K/∂V (two in flight in each). Each tile row is
/// `d + 8` bf16 (padded against bank conflicts), and ∂K/∂V's steps also hold their lse and
/// delta (2 f32 per query).
const TC_FWD_KEYS: usize = 64;
const TC_DQ_KEYS: usize = 32;
const TC_DKV_QUERIES: usize = 48;

/// f32 units of shared memory for `rows` tile rows of two bf16 tensors (K and V, or q and ∂O).
fn tc_tile_pair_floats(rows: usize, d: usize) -> usize {
    rows * (d + 8)
}

/// Whether attention (forward and backward) runs on tensor cores: bf16 with a head_dim they
/// are built for, unless `COMPOSER_ATTENTION_TC=0` (the scalar kernels instead: a diagnostic,
/// and the baseline the GPU check compares them with).
fn tensor_cores(dtype: DType, d: usize) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("COMPOSER_ATTENTION_TC").is_ok_and(|v| v == "0"));
    dtype == DType::BF16 && TC_HEAD_DIMS.contains(&d) && !off
}

fn tiles(d: usize) -> Result<&'static Tiles> {
    match TILES.iter().find(|t| d <= t.dmax) {
        Some(t) if d > 0 => Ok(t),
        _ => candle_core::bail!(
            "attention: the CUDA kernel handles head_dim 1..=256, got {d} (use the composition)"
        ),
    }
}

/// A launch of `blocks` × `heads` blocks of the attention kernels with `floats` f32 of
/// dynamic shared memory.
fn config(blocks: usize, heads: usize, floats: usize) -> Result<LaunchConfig> {
    let bytes = floats * 4;
    if bytes > MAX_SHARED_BYTES {
        candle_core::bail!("attention: {bytes} bytes of shared memory exceed {MAX_SHARED_BYTES}");
    }
    Ok(LaunchConfig {
        grid_dim: (blocks.max(1) as u32, heads as u32, 1),
        block_dim: ((32 * WARPS) as u32, 1, 1),
        shared_mem_bytes: bytes as u32,
    })
}

/// The scalar arguments every attention kernel ends with, before its rows per block: the
/// integers `(n, hq, hkv, d)`, checked to fit in 32 bits (element offsets are 64-bit in the
/// kernels; token and head indices are not), and the softmax scale.
struct Scalars {
    n: i32,
    hq: i32,
    hkv: i32,
    d: i32,
    scale: f32,
}

impl Scalars {
    fn new(dims: &Dims, scale: f64) -> Result<Self> {
        let Dims { n, hq, hkv, d } = *dims;
        let fits = |x: usize| i32::try_from(x).ok();
        match (fits(n), fits(n * hq), fits(hkv), fits(d)) {
            (Some(n), Some(_), Some(hkv), Some(d)) if hq <= 65_535 => Ok(Scalars {
                n,
                hq: hq as i32,
                hkv,
                d,
                scale: scale as f32,
            }),
            _ => candle_core::bail!(
                "attention: {n} tokens × {hq} heads are too many for the CUDA kernel's 32-bit indices"
            ),
        }
    }

    /// Pushes the kernels' last arguments: `n, hq, hkv, d, scale, rows` (`rows` per block).
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>, rows: &'a i32) {
        b.arg(&self.n)
            .arg(&self.hq)
            .arg(&self.hkv)
            .arg(&self.d)
            .arg(&self.scale)
            .arg(rows);
    }
}

/// The arguments the ∂Q and ∂K/∂V kernels start with, in their order: the forward's inputs,
/// the output's gradient, the forward's log-sum-exp, `delta`, `cu_seqlens` and its length.
struct GradInputs<'v, T> {
    q: CudaView<'v, T>,
    k: CudaView<'v, T>,
    v: CudaView<'v, T>,
    dout: CudaView<'v, T>,
    lse: CudaView<'v, f32>,
    delta: CudaSlice<f32>,
    cu: CudaSlice<i32>,
    n_cu: i32,
}

impl<T> GradInputs<'_, T> {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.q)
            .arg(&self.k)
            .arg(&self.v)
            .arg(&self.dout)
            .arg(&self.lse)
            .arg(&self.delta)
            .arg(&self.cu)
            .arg(&self.n_cu);
    }
}

/// `cu_seqlens` on the device as i32.
fn device_cu(dev: &CudaDevice, cu: &[usize]) -> Result<CudaSlice<i32>> {
    let cu: Vec<i32> = cu
        .iter()
        .map(|&c| i32::try_from(c))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| candle_core::Error::Msg("attention: cu_seqlens exceeds i32".into()))?;
    dev.clone_htod(&cu)
}

/// Forward of contiguous `q` `[n, hq, d]`, `k`/`v` `[n, hkv, d]`: the output (q's dtype) and
/// the log-sum-exp of every (token, query head) row, an f32 `[n, hq]` tensor.
pub(super) fn varlen_attention_fwd(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    dims: &Dims,
    cu: &[usize],
    scale: f64,
) -> Result<(CudaStorage, Tensor)> {
    let dtype = q.0.dtype();
    let dev = q.0.device().clone();
    let tile = tiles(dims.d)?;
    let scalars = Scalars::new(dims, scale)?;
    let (n, d) = (dims.n, dims.d);
    let cu_dev = device_cu(&dev, cu)?;
    let n_cu = cu.len() as i32;
    let tc = tensor_cores(dtype, d);
    let (rows, name, smem_floats) = if tc {
        let name = format!("varlen_attn_fwd_tc_d{d}");
        // Two stages of K/V tiles: the next tile's copy overlaps this one's products.
        (TC_ROWS, name, 2 * tc_tile_pair_floats(TC_FWD_KEYS, d))
    } else {
        let rows = WARPS * tile.fwd_rpw;
        let floats = rows * d + d * (tile.fwd_bk + 1) + tile.fwd_bk * d;
        (rows, format!("varlen_attn_fwd_d{}", tile.dmax), floats)
    };
    let rows_i = rows as i32;
    let cfg = config(n.div_ceil(rows), dims.hq, smem_floats)?;
    let lse = alloc::<f32>(&dev, n * dims.hq)?;
    let out = typed!(dtype, "attention", |T| {
        let qv = view::<T>(q.0, q.1, "attention")?;
        let kv = view::<T>(k.0, k.1, "attention")?;
        let vv = view::<T>(v.0, v.1, "attention")?;
        let out = alloc::<T>(&dev, n * dims.hq * d)?;
        let f = dev.get_or_load_custom_func(&kernel_name(&name, dtype)?, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&qv)
            .arg(&kv)
            .arg(&vv)
            .arg(&cu_dev)
            .arg(&n_cu)
            .arg(&out)
            .arg(&lse);
        scalars.push(&mut b, &rows_i);
        // SAFETY: the arguments match the kernel's signature; the shared memory is the
        // kernel's layout for this tile class (opted in past 48 KiB).
        unsafe { launch_opted_in(&f, &mut b, cfg, "attention") }?;
        T::wrap_cuda_slice(out, dev.clone())
    });
    let lse = Tensor::from_storage(
        Storage::Cuda(f32::wrap_cuda_slice(lse, dev)),
        (n, dims.hq),
        BackpropOp::none(),
        false,
    );
    Ok((out, lse))
}

/// The backward: `(∂q, ∂k, ∂v)` in the inputs' shapes and dtype, from the forward's inputs,
/// output `out`, its gradient `dout` and the forward's f32 `lse` `[n, hq]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn varlen_attention_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
    dims: &Dims,
    cu: &[usize],
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dtype = q.dtype();
    let tile = tiles(dims.d)?;
    let scalars = Scalars::new(dims, scale)?;
    let Dims { n, hq, hkv, d } = *dims;
    let tc = tensor_cores(dtype, d);
    let (nq, nkv) = (n * hq * d, n * hkv * d);
    let n_cu = cu.len() as i32;
    // ∂q, ∂k and ∂v one after the other in one buffer (one launcher call owns every input).
    let grads = on_tensors(
        &[q, k, v, out, dout, lse],
        Shape::from(nq + 2 * nkv),
        "attention backward",
        |a| {
            let dev = a[0].0.device().clone();
            let cu_dev = device_cu(&dev, cu)?;
            let lse_v = view::<f32>(a[5].0, a[5].1, "attention lse")?;
            typed!(dtype, "attention backward", |T| {
                let w = "attention backward";
                let qv = view::<T>(a[0].0, a[0].1, w)?;
                let kv = view::<T>(a[1].0, a[1].1, w)?;
                let vv = view::<T>(a[2].0, a[2].1, w)?;
                let ov = view::<T>(a[3].0, a[3].1, w)?;
                let gv = view::<T>(a[4].0, a[4].1, w)?;
                // delta = rowsum(∂O·O), one warp per (token, head) row.
                let delta = alloc::<f32>(&dev, n * hq)?;
                let rows_all = (n * hq) as i32;
                let f = dev.get_or_load_custom_func(
                    &kernel_name("varlen_attn_delta", dtype)?,
                    MODULE,
                    PTX,
                )?;
                let mut b = f.builder();
                b.arg(&gv)
                    .arg(&ov)
                    .arg(&delta)
                    .arg(&rows_all)
                    .arg(&scalars.d);
                // SAFETY: the arguments match the kernel's signature.
                unsafe { b.launch(config((n * hq).div_ceil(WARPS), 1, 0)?) }.w()?;
                let inputs = GradInputs {
                    q: qv,
                    k: kv,
                    v: vv,
                    dout: gv,
                    lse: lse_v,
                    delta,
                    cu: cu_dev,
                    n_cu,
                };
                let mut buf = alloc::<T>(&dev, nq + 2 * nkv)?;
                let (mut dq, mut dkv) = buf.split_at_mut(nq);
                let (mut dk, mut dv) = dkv.split_at_mut(nkv);
                // ∂q: query tiles of every query head; ∂k, ∂v: key tiles of every key/value
                // head (on tensor cores, the block's keys and two stages of a step's queries
                // with their lse and delta in shared memory).
                let (dq_rows, dq_floats, dkv_rows, dkv_floats, suffix) = if tc {
                    let dkv_stage = tc_tile_pair_floats(TC_DKV_QUERIES, d) + 2 * TC_DKV_QUERIES;
                    (
                        TC_ROWS,
                        2 * tc_tile_pair_floats(TC_DQ_KEYS, d), // two stages
                        TC_ROWS,
                        tc_tile_pair_floats(TC_ROWS, d) + 2 * dkv_stage,
                        format!("tc_d{d}"),
                    )
                } else {
                    let (qr, kr) = (WARPS * tile.dq_rpw, WARPS * tile.dkv_rpw);
                    let dq_floats = 2 * qr * d + 2 * d * (tile.dq_bk + 1);
                    let dkv_floats = 2 * kr * d + 2 * d * (tile.dkv_bq + 1) + 2 * tile.dkv_bq;
                    (qr, dq_floats, kr, dkv_floats, format!("d{}", tile.dmax))
                };
                let rows_i = dq_rows as i32;
                let cfg = config(n.div_ceil(dq_rows), hq, dq_floats)?;
                let name = format!("varlen_attn_bwd_dq_{suffix}");
                let f = dev.get_or_load_custom_func(&kernel_name(&name, dtype)?, MODULE, PTX)?;
                let mut b = f.builder();
                inputs.push(&mut b);
                b.arg(&mut dq);
                scalars.push(&mut b, &rows_i);
                // SAFETY: the arguments match the kernel's signature; the shared memory is
                // the kernel's layout for this tile class.
                unsafe { b.launch(cfg) }.w()?;
                let rows_i = dkv_rows as i32;
                let cfg = config(n.div_ceil(dkv_rows), hkv, dkv_floats)?;
                let name = format!("varlen_attn_bwd_dkv_{suffix}");
                let f = dev.get_or_load_custom_func(&kernel_name(&name, dtype)?, MODULE, PTX)?;
                let mut b = f.builder();
                inputs.push(&mut b);
                b.arg(&mut dk).arg(&mut dv);
                scalars.push(&mut b, &rows_i);
                // SAFETY: as above (past 48 KiB at head_dim 128 on tensor cores: opted in).
                unsafe { launch_opted_in(&f, &mut b, cfg, "attention") }?;
                Ok(T::wrap_cuda_slice(buf, dev))
            })
        },
    )?;
    Ok((
        grads.narrow(0, 0, nq)?.reshape(q.shape())?,
        grads.narrow(0, nq, nkv)?.reshape(k.shape())?,
        grads.narrow(0, nq + nkv, nkv)?.reshape(v.shape())?,
    ))
}
