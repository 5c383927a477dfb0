//! The decode step's projections for a few rows on CUDA: `x·Wᵀ` with `x` `[rows ≤ 64, in]`,
//! and the same product with the MLP's SwiGLU as its epilogue on the stacked `[gate | up]`
//! weight (`decode_gemm_kernels.cuh`). At batch 64 the four cuBLAS products of a
//! Qwen2.5-0.5B layer took ~24 µs on an H200 (2026-11-27 profile) for ~30 MB of weights, about
//! 6 µs of HBM bytes: cuBLAS's tiles are made for many rows, so the small projections run on a
//! few SMs. Here a block owns 128 weight rows and every row of `x`, and `in` is split over
//! more blocks when the weight rows alone give too few ([`skinny_plan`]).
//!
//! Opt-in (`COMPOSER_DECODE_GEMM=1`) until a GPU run measures it against cuBLAS
//! (`tools/gpu_check.sh`'s `c05-d-skinny`); elsewhere — the CPU, f32, more than 64 rows, a
//! width that is not a multiple of 8 — [`decode_product`] is [`super::linear`] (and
//! [`super::swiglu_packed`]), which is also the kernel's CPU twin. `tools/cuda_emu`
//! (`decode_gemm` driver) runs the kernel on CPU threads against f64.
//!
//! The products also take the decode layer's norms and residual adds ([`InputNorm`], the
//! residual of [`decode_product`]): a layer's stream then goes from ~7 launches to 5 — q/k/v
//! (input norm in, keys and values out to the cache), attention, o (+ residual), gate/up
//! (post-attention norm in, SwiGLU out), down (+ residual) — without its two `add_rms_norm`.

use super::{KvSlots, QkvHeads};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::OnceLock;

/// What the decode product gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeEpilogue {
    /// `x·Wᵀ` `[rows, out]`.
    Product,
    /// `silu(g)·u` `[rows, out / 2]` of the product `[g | u]` with `W` = `[gate | up]`
    /// stacked: [`super::swiglu_packed`] of the product, without the product in memory.
    Swiglu,
}

/// The RMSNorm in front of a decode product: `x` becomes `rms_norm(x, weight, eps)` first
/// (the layer's input or post-attention norm). On the kernel, `x·weight` is rounded to bf16
/// and the product divided by x's rms — `rms_norm` rounds `x / rms` instead (a difference of
/// the size of bf16's rounding, bounded by `tests/ops.rs`).
#[derive(Debug, Clone, Copy)]
pub struct InputNorm<'a> {
    /// `[in]`.
    pub weight: &'a Tensor,
    /// Epsilon inside the square root.
    pub eps: f64,
}

/// Most rows the skinny kernel takes: the decode layer folds its norms into the products
/// (`DecodeStacks::norms_in_products`) at most at this batch.
pub const DECODE_PRODUCT_MAX_ROWS: usize = SKINNY_MAX_ROWS;

/// Weight rows per block (`SG_NT`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_ROWS: usize = 128;
/// `in` per pipeline stage (`SG_KC`) and stages (`SG_STAGES`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_STAGE_K: usize = 64;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_STAGES: usize = 3;
/// Most rows of `x` a block holds (4 m16 tiles).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_MAX_ROWS: usize = 64;
/// The smallest `in` a split of the product takes (two stages): a split's f32 partial
/// (`rows × 128` floats) stays at most as large as its weights (`128 × in` bf16) at 64 rows.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_MIN_SPLIT: usize = 128;
/// Blocks a product should have for the SMs to be busy (an H100/H200 has 132; a block uses up
/// to 81 KiB of shared memory, so two fit an SM). `COMPOSER_DECODE_GEMM_BLOCKS` replaces it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const SKINNY_TARGET_BLOCKS: usize = 132;

/// Threads per block (`32·SG_WARPS`).
#[cfg(feature = "cuda")]
pub(super) const SKINNY_THREADS: usize = 128;

/// How the kernel runs one product.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SkinnyPlan {
    /// m16 tiles of `x`'s rows (1–4: the kernel's `MT`).
    pub(super) m_tiles: usize,
    /// Blocks along the weight rows.
    pub(super) tiles: usize,
    /// Blocks along `in`, each over `k_split` of it (a multiple of a stage).
    pub(super) splits: usize,
    pub(super) k_split: usize,
    /// Dynamic shared memory of a block.
    pub(super) shared_bytes: usize,
}

/// The kernel's plan for `rows × in` times `[out, in]ᵀ` with `target` blocks wanted: `None`
/// when it does not serve the shape (no rows or more than 64, `in` not a multiple of 8, a
/// SwiGLU `out` not a multiple of 128).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn skinny_plan(
    rows: usize,
    out: usize,
    k: usize,
    epilogue: DecodeEpilogue,
    target: usize,
) -> Option<SkinnyPlan> {
    // The kernel's indices are 32-bit.
    let fits_i32 = |v: usize| v <= i32::MAX as usize;
    if !(1..=SKINNY_MAX_ROWS).contains(&rows)
        || k == 0
        || !k.is_multiple_of(8)
        || out == 0
        || !fits_i32(out.next_multiple_of(SKINNY_ROWS))
        || !fits_i32(k.next_multiple_of(SKINNY_STAGE_K))
    {
        return None;
    }
    let tiles = match epilogue {
        DecodeEpilogue::Product => out.div_ceil(SKINNY_ROWS),
        DecodeEpilogue::Swiglu if out.is_multiple_of(SKINNY_ROWS) => out / SKINNY_ROWS,
        DecodeEpilogue::Swiglu => return None,
    };
    // Splits of `in` for about `target` blocks in all (the nearest count).
    let wanted = ((target + tiles / 2) / tiles).max(1);
    let k_split = k
        .div_ceil(wanted)
        .max(SKINNY_MIN_SPLIT)
        .next_multiple_of(SKINNY_STAGE_K);
    let m_tiles = rows.div_ceil(16);
    Some(SkinnyPlan {
        m_tiles,
        tiles,
        splits: k.div_ceil(k_split),
        k_split,
        shared_bytes: SKINNY_STAGES * (SKINNY_ROWS + 16 * m_tiles) * (SKINNY_STAGE_K + 8) * 2,
    })
}

/// Whether `COMPOSER_DECODE_GEMM=1` turned the skinny kernel on: the decode layer then runs
/// its norms and residual adds inside the products, on any device (elsewhere than CUDA bf16,
/// through the same functions' fallbacks — the kernel's CPU twin).
pub fn decode_gemm_on() -> bool {
    skinny_settings().0
}

/// Whether the skinny kernel serves a product of `out` weight rows over `k` with `epilogue`
/// at any batch it takes (`k` a multiple of 8; a SwiGLU `out` a multiple of 128).
pub fn decode_product_serves(out: usize, k: usize, epilogue: DecodeEpilogue) -> bool {
    skinny_plan(1, out, k, epilogue, SKINNY_TARGET_BLOCKS).is_some()
}

/// Whether the skinny q/k/v kernel serves `heads` over `k` (the stacked product served, and
/// head_dim even and dividing a block's 128 weight rows, so a block holds whole heads).
pub fn decode_qkv_serves(heads: QkvHeads, k: usize) -> bool {
    qkv_head_dim_served(heads.head_dim)
        && decode_product_serves(heads.packed_width(), k, DecodeEpilogue::Product)
}

/// head_dim even and dividing a block's weight rows (`SgQkv`'s requirement).
fn qkv_head_dim_served(d: usize) -> bool {
    d.is_multiple_of(2) && SKINNY_ROWS.is_multiple_of(d)
}

/// Whether `COMPOSER_DECODE_GEMM=1` turned the kernel on, and the blocks it aims for.
fn skinny_settings() -> (bool, usize) {
    static SETTINGS: OnceLock<(bool, usize)> = OnceLock::new();
    *SETTINGS.get_or_init(|| {
        let on = std::env::var("COMPOSER_DECODE_GEMM").is_ok_and(|v| v == "1");
        let target = std::env::var("COMPOSER_DECODE_GEMM_BLOCKS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or(SKINNY_TARGET_BLOCKS);
        (on, target)
    })
}

/// The split-k counters of a decode layer's products: u32, one per block of weight rows of its
/// widest projection, zero between launches (the last block of a tile wraps its counter back
/// to zero, so no launch zeroes them — a CUDA graph replays the products alone). The products of a layer
/// run one after another on the stream, so they share them.
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct SplitCounters(Tensor);

impl SplitCounters {
    /// Counters for products of at most `max_out` weight rows on `device`; `None` where the
    /// kernel does not run (not CUDA, or not turned on).
    pub fn for_device(device: &Device, max_out: usize) -> Result<Option<SplitCounters>> {
        if !device.is_cuda() || !skinny_settings().0 {
            return Ok(None);
        }
        Ok(Some(Self::new(device, max_out)?))
    }

    /// Counters for products of at most `max_out` weight rows on `device`, whatever
    /// `COMPOSER_DECODE_GEMM` says (the tests' way to the kernel).
    pub fn new(device: &Device, max_out: usize) -> Result<SplitCounters> {
        let n = max_out.div_ceil(SKINNY_ROWS).max(1);
        Ok(SplitCounters(Tensor::zeros(n, DType::U32, device)?))
    }
}

/// `x·wᵀ` for `x` `[rows, in]` and `w` `[out, in]`, or with [`DecodeEpilogue::Swiglu`]
/// `swiglu_packed(x·wᵀ)`; with `norm`, of `x` through that RMSNorm first; with `residual`
/// `[rows, out]` (Product only), `residual + x·wᵀ` (the product rounded first). The skinny
/// kernel when `counters` are given (CUDA, bf16, ≤ 64 rows, `in` a multiple of 8, 16-byte
/// aligned storages), else [`super::rms_norm`], [`super::linear`] (and
/// [`super::swiglu_packed`]) and an add. Inference only: the kernel has no backward.
pub fn decode_product(
    x: &Tensor,
    w: &Tensor,
    epilogue: DecodeEpilogue,
    norm: Option<InputNorm>,
    residual: Option<&Tensor>,
    counters: Option<&SplitCounters>,
) -> Result<Tensor> {
    let (rows, k) = x.dims2()?;
    let (out, in_w) = w.dims2()?;
    if k != in_w {
        bail!(
            "decode product: x {:?} and w {:?} do not fit",
            x.dims(),
            w.dims()
        );
    }
    if epilogue == DecodeEpilogue::Swiglu && out % 2 != 0 {
        bail!(
            "decode product: the SwiGLU epilogue needs w = [gate | up], got {} rows",
            out
        );
    }
    if let Some(r) = residual {
        if epilogue != DecodeEpilogue::Product || r.dims() != [rows, out] {
            bail!(
                "decode product: a residual {:?} takes the plain product [{rows}, {out}]",
                r.dims()
            );
        }
    }
    check_norm_width(norm, k, "decode product")?;
    #[cfg(feature = "cuda")]
    if let Some(c) = counters {
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        if let Some(plan) = cuda::plan_for(&x, &w, out, epilogue, c)? {
            if let Some(fused) = cuda::Fused::of(norm, residual, (&x, &w))? {
                let op = cuda::SkinnyProduct {
                    plan,
                    epilogue,
                    counters: &c.0,
                    fused,
                };
                return Ok(x.apply_op2_no_bwd(&w, &op)?);
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = counters;
    let x = input_normed(x, norm)?;
    let y = super::linear(&x, w, None)?;
    let y = match epilogue {
        DecodeEpilogue::Product => y,
        DecodeEpilogue::Swiglu => super::swiglu_packed(&y)?,
    };
    Ok(match residual {
        Some(r) => (r + y)?,
        None => y,
    })
}

/// `x` through `norm`, if any (the trainer's [`super::rms_norm`]): what the decode products
/// read where the kernel does not fold the norm in.
pub fn input_normed(x: &Tensor, norm: Option<InputNorm>) -> Result<Tensor> {
    match norm {
        Some(n) => super::rms_norm(x, n.weight, n.eps),
        None => Ok(x.clone()),
    }
}

/// An error naming `what` when `norm`'s weight is not `[k]`, x's width.
fn check_norm_width(norm: Option<InputNorm>, k: usize, what: &str) -> Result<()> {
    match norm {
        Some(n) if n.weight.dims() != [k] => bail!(
            "{what}: the input norm's weight is {:?}, x has {k} columns",
            n.weight.dims()
        ),
        _ => Ok(()),
    }
}

/// The decode step's attention inputs from its stacked `[q | k | v]` projection `w`
/// `[(heads + 2·kv_heads)·head_dim, in]` of `x` `[rows, in]`: [`super::qkv_bias_rope`] of the
/// product (bias added, q and k rotated by `cos`/`sin` `[rows, head_dim / 2]`), the keys and
/// values written into their cache slots `slots` of `pool` `[2, slots, kv_heads, head_dim]`
/// ([`super::write_kv_slots`]); returns q `[rows, heads, head_dim]`. With `norm`, of `x`
/// through that RMSNorm (see [`InputNorm`]). With `counters` on CUDA in bf16 (and head_dim
/// even, dividing 128) one launch — the skinny product with the norm in front and the three as
/// its epilogue — instead of three or four; else those ops.
#[allow(clippy::too_many_arguments)]
pub fn decode_qkv_into_cache(
    x: &Tensor,
    norm: Option<InputNorm>,
    w: &Tensor,
    bias: Option<&Tensor>,
    cos: &Tensor,
    sin: &Tensor,
    heads: QkvHeads,
    pool: &Tensor,
    slots: &KvSlots,
    counters: Option<&SplitCounters>,
) -> Result<Tensor> {
    let (rows, k) = x.dims2()?;
    let width = heads.packed_width();
    if w.dims() != [width, k] {
        bail!(
            "decode q/k/v: the stacked weight is {:?}, expected [{width}, {k}] for x {:?}",
            w.dims(),
            x.dims()
        );
    }
    let (_, slot_count, _, _) = pool.dims4()?;
    slots.check(slot_count, "decode q/k/v")?;
    check_norm_width(norm, k, "decode q/k/v")?;
    #[cfg(feature = "cuda")]
    if let Some(c) = counters {
        let inputs = (x, norm, w);
        if let Some(q) = cuda::qkv_on_kernel(inputs, bias, (cos, sin), heads, pool, slots, c)? {
            return Ok(q);
        }
    }
    let x = input_normed(x, norm)?;
    let qkv = decode_product(&x, w, DecodeEpilogue::Product, None, None, counters)?;
    let (q, kv) = super::qkv_bias_rope(&qkv, bias, cos, sin, heads)?;
    super::write_kv_slots(pool, &kv, slots)?;
    debug_assert_eq!(q.dims(), [rows, heads.num_heads, heads.head_dim]);
    Ok(q)
}

#[cfg(feature = "cuda")]
mod cuda;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_splits_the_small_projections_and_not_the_wide_one() {
        // Qwen2.5-0.5B at batch 64: q/k/v (1152 × 896), o (896 × 896), gate/up (9728 × 896),
        // down (896 × 4864).
        let p = |out, k, e| skinny_plan(64, out, k, e, SKINNY_TARGET_BLOCKS).unwrap();
        let qkv = p(1152, 896, DecodeEpilogue::Product);
        assert_eq!((qkv.tiles, qkv.splits, qkv.k_split), (9, 7, 128));
        let down = p(896, 4864, DecodeEpilogue::Product);
        assert_eq!((down.tiles, down.splits, down.k_split), (7, 19, 256));
        let gate_up = p(9728, 896, DecodeEpilogue::Swiglu);
        assert_eq!(
            (gate_up.tiles, gate_up.splits, gate_up.k_split),
            (76, 2, 448)
        );
        // 3 stages of 128 weight rows and 64 x rows, 72 bf16 a row: within the 99 KiB (less
        // the kernel's static shared memory: the split flag's 16 bytes, 64 rows' sums of
        // squares) any sm_80+ card allows a block.
        assert_eq!(gate_up.shared_bytes, 3 * 192 * 72 * 2);
        assert!(gate_up.shared_bytes + 16 + 64 * 4 <= 99 * 1024);
        for plan in [qkv, down, gate_up] {
            assert_eq!(plan.k_split % SKINNY_STAGE_K, 0);
            assert_eq!(plan.m_tiles, 4);
        }
    }

    #[test]
    fn plan_covers_every_k_once() {
        for rows in [1, 16, 17, 64] {
            for k in [8, 64, 72, 136, 896, 3584, 4864, 18944] {
                for out in [1, 128, 200, 9728] {
                    for target in [1, 132, 1000] {
                        let plan =
                            skinny_plan(rows, out, k, DecodeEpilogue::Product, target).unwrap();
                        // Every split starts inside k, and together they reach its end.
                        assert!((plan.splits - 1) * plan.k_split < k);
                        assert!(plan.splits * plan.k_split >= k);
                        assert_eq!(plan.m_tiles, rows.div_ceil(16));
                        assert!(plan.splits <= 65_535);
                    }
                }
            }
        }
    }

    #[test]
    fn plan_refuses_what_the_kernel_cannot_run() {
        let e = DecodeEpilogue::Product;
        assert!(skinny_plan(0, 128, 64, e, 132).is_none());
        assert!(skinny_plan(65, 128, 64, e, 132).is_none());
        assert!(skinny_plan(8, 128, 60, e, 132).is_none());
        assert!(skinny_plan(8, 0, 64, e, 132).is_none());
        assert!(skinny_plan(8, 200, 64, DecodeEpilogue::Swiglu, 132).is_none());
        assert!(skinny_plan(8, 256, 64, DecodeEpilogue::Swiglu, 132).is_some());
    }

    #[test]
    fn decode_product_off_cuda_is_the_product_and_its_swiglu() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (3, 16), &dev)?;
        let w = Tensor::randn(0f32, 1., (8, 16), &dev)?;
        let counters = SplitCounters::for_device(&dev, 8)?;
        assert!(counters.is_none());
        let y = decode_product(&x, &w, DecodeEpilogue::Product, None, None, None)?;
        let want = x.matmul(&w.t()?)?;
        let diff = (y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        let s = decode_product(&x, &w, DecodeEpilogue::Swiglu, None, None, None)?;
        let want = crate::ops::swiglu_packed(&want)?;
        let diff = (s - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        Ok(())
    }

    #[test]
    fn decode_product_names_bad_shapes() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((3, 16), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((8, 12), DType::F32, &dev).unwrap();
        let e = decode_product(&x, &w, DecodeEpilogue::Product, None, None, None).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
        let w = Tensor::zeros((7, 16), DType::F32, &dev).unwrap();
        let e = decode_product(&x, &w, DecodeEpilogue::Swiglu, None, None, None).unwrap_err();
        assert!(e.to_string().contains("gate | up"), "{e}");
        // A residual on the SwiGLU output, or of the wrong shape; a norm weight of the wrong
        // width.
        let w = Tensor::zeros((8, 16), DType::F32, &dev).unwrap();
        let r = Tensor::zeros((3, 8), DType::F32, &dev).unwrap();
        let swiglu = DecodeEpilogue::Swiglu;
        let e = decode_product(&x, &w, swiglu, None, Some(&r), None).unwrap_err();
        assert!(e.to_string().contains("residual [3, 8]"), "{e}");
        let r = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
        let e = decode_product(&x, &w, DecodeEpilogue::Product, None, Some(&r), None).unwrap_err();
        assert!(e.to_string().contains("plain product [3, 8]"), "{e}");
        let nw = Tensor::ones(15, DType::F32, &dev).unwrap();
        let norm = Some(InputNorm {
            weight: &nw,
            eps: 1e-6,
        });
        let e = decode_product(&x, &w, DecodeEpilogue::Product, norm, None, None).unwrap_err();
        assert!(e.to_string().contains("norm's weight is [15]"), "{e}");
    }
}
