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
/// `swiglu_packed(x·wᵀ)`: the skinny kernel when `counters` are given (CUDA, bf16, ≤ 64 rows,
/// `in` a multiple of 8, 16-byte aligned storages), else [`super::linear`] (and
/// [`super::swiglu_packed`]). Inference only: the kernel has no backward.
pub fn decode_product(
    x: &Tensor,
    w: &Tensor,
    epilogue: DecodeEpilogue,
    counters: Option<&SplitCounters>,
) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
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
    #[cfg(feature = "cuda")]
    if let Some(c) = counters {
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        if let Some(plan) = cuda::plan_for(&x, &w, out, epilogue, c)? {
            let op = cuda::SkinnyProduct {
                plan,
                epilogue,
                counters: &c.0,
            };
            return Ok(x.apply_op2_no_bwd(&w, &op)?);
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = counters;
    let y = super::linear(x, w, None)?;
    match epilogue {
        DecodeEpilogue::Product => Ok(y),
        DecodeEpilogue::Swiglu => super::swiglu_packed(&y),
    }
}

/// The decode step's attention inputs from its stacked `[q | k | v]` projection `w`
/// `[(heads + 2·kv_heads)·head_dim, in]` of `x` `[rows, in]`: [`super::qkv_bias_rope`] of the
/// product (bias added, q and k rotated by `cos`/`sin` `[rows, head_dim / 2]`), the keys and
/// values written into their cache slots `slots` of `pool` `[2, slots, kv_heads, head_dim]`
/// ([`super::write_kv_slots`]); returns q `[rows, heads, head_dim]`. With `counters` on CUDA in
/// bf16 (and head_dim even, dividing 128) one launch — the skinny product with the three as its
/// epilogue — instead of three; else those three ops.
#[allow(clippy::too_many_arguments)]
pub fn decode_qkv_into_cache(
    x: &Tensor,
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
    #[cfg(feature = "cuda")]
    if let Some(c) = counters {
        if let Some(q) = cuda::qkv_on_kernel(x, w, bias, (cos, sin), heads, pool, slots, c)? {
            return Ok(q);
        }
    }
    let qkv = decode_product(x, w, DecodeEpilogue::Product, counters)?;
    let (q, kv) = super::qkv_bias_rope(&qkv, bias, cos, sin, heads)?;
    super::write_kv_slots(pool, &kv, slots)?;
    debug_assert_eq!(q.dims(), [rows, heads.num_heads, heads.head_dim]);
    Ok(q)
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{skinny_plan, skinny_settings, DecodeEpilogue, SkinnyPlan, SplitCounters};
    use super::{KvSlots, QkvHeads};
    use anyhow::Result;
    use candle_core::op::BackpropOp;
    use candle_core::{CpuStorage, CustomOp2, DType, InplaceOp1, Layout, Shape, Storage, Tensor};
    use std::sync::Mutex;

    /// The plan of the skinny product of contiguous `x` `[rows, k]` and `w` `[out, k]` with
    /// `epilogue`, where the kernel serves it: both bf16 on the counters' device, counters for
    /// every tile, both starting 16-byte aligned (a CUDA storage is a whole allocation,
    /// 256-byte aligned; a view starts `start_offset` elements into it, and `k` % 8 == 0 keeps
    /// every row aligned for the kernel's 16-byte copies). `None`: cuBLAS instead.
    pub(super) fn plan_for(
        x: &Tensor,
        w: &Tensor,
        out: usize,
        epilogue: DecodeEpilogue,
        counters: &SplitCounters,
    ) -> Result<Option<SkinnyPlan>> {
        let (rows, k) = x.dims2()?;
        let Some(plan) = skinny_plan(rows, out, k, epilogue, skinny_settings().1) else {
            return Ok(None);
        };
        let serves = plan.tiles <= counters.0.dim(0)?
            && [x, w].iter().all(|t| {
                t.dtype() == DType::BF16
                    && t.device().same_device(counters.0.device())
                    && t.layout().start_offset().is_multiple_of(8)
            });
        Ok(serves.then_some(plan))
    }

    /// The CUDA storage under a read guard (`what` names the op in the error).
    fn cuda_storage<'s>(
        s: &'s Storage,
        what: &str,
    ) -> candle_core::Result<&'s candle_core::CudaStorage> {
        match s {
            Storage::Cuda(s) => Ok(s),
            _ => candle_core::bail!("{what}: an input is not on the CUDA device"),
        }
    }

    /// [`super::decode_qkv_into_cache`] on the kernel: q, or `None` where the kernel does not
    /// serve (the caller then runs the three ops). The caller checked every slot.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_on_kernel(
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        (cos, sin): (&Tensor, &Tensor),
        heads: QkvHeads,
        pool: &Tensor,
        slots: &KvSlots,
        counters: &SplitCounters,
    ) -> Result<Option<Tensor>> {
        let (rows, k) = x.dims2()?;
        let QkvHeads {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        } = heads;
        let width = heads.packed_width();
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let Some(plan) = plan_for(&x, &w, width, DecodeEpilogue::Product, counters)? else {
            return Ok(None);
        };
        let (two, slot_count, pool_kv, pool_d) = pool.dims4()?;
        // What the op reads besides x, w and the counters (plan_for checked those).
        let mut others = vec![cos, sin, slots.on_device()];
        others.extend(bias);
        let serves = d % 2 == 0
            && 128 % d == 0
            && (two, pool_kv, pool_d) == (2, nkv, d)
            && slots.len() == rows
            && cos.dims() == [rows, d / 2]
            && sin.dims() == [rows, d / 2]
            && bias.is_none_or(|b| b.dims() == [width])
            && pool.is_contiguous()
            && [cos, sin, pool]
                .into_iter()
                .chain(bias)
                .all(|t| t.dtype() == DType::BF16)
            && slots.on_device().dtype() == DType::U32
            && others
                .iter()
                .chain([&pool])
                .all(|t| t.device().same_device(x.device()));
        if !serves {
            return Ok(None);
        }
        // The op holds the pool's write lock while it reads the others: one of them sharing the
        // pool's storage would wait on itself.
        let pool_storage: *const Storage = &*pool.storage_and_layout().0;
        let shares = [&x, &w, &counters.0]
            .into_iter()
            .chain(others)
            .any(|t| std::ptr::eq(&*t.storage_and_layout().0, pool_storage));
        if shares {
            anyhow::bail!("decode q/k/v: an input shares the KV pool's storage");
        }
        let bias = bias.map(Tensor::contiguous).transpose()?;
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        let slots = slots.on_device().contiguous()?;
        let op = QkvIntoCache {
            plan,
            x: &x,
            w: &w,
            bias: bias.as_ref(),
            cos: &cos,
            sin: &sin,
            slots: &slots,
            counters: &counters.0,
            dims: (rows, k, nh, nkv, d, slot_count),
            q: Mutex::new(None),
        };
        pool.inplace_op1(&op)?;
        let q =
            op.q.lock()
                .map_err(|_| anyhow::anyhow!("decode q/k/v: poisoned"))?
                .take();
        let Some(q) = q else {
            anyhow::bail!("decode q/k/v: the kernel gave no q")
        };
        let q = Tensor::from_storage(Storage::Cuda(q), (rows, nh, d), BackpropOp::none(), false);
        Ok(Some(q))
    }

    /// The q/k/v kernel as an in-place op on the pool (the keys and values written into it);
    /// q, the op's other output, comes back through `q`.
    struct QkvIntoCache<'a> {
        plan: SkinnyPlan,
        x: &'a Tensor,
        w: &'a Tensor,
        bias: Option<&'a Tensor>,
        cos: &'a Tensor,
        sin: &'a Tensor,
        slots: &'a Tensor,
        counters: &'a Tensor,
        /// rows, in, heads, kv heads, head_dim, the pool's slots.
        dims: (usize, usize, usize, usize, usize, usize),
        q: Mutex<Option<candle_core::CudaStorage>>,
    }

    impl InplaceOp1 for QkvIntoCache<'_> {
        fn name(&self) -> &'static str {
            "skinny-qkv"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
            candle_core::bail!(
                "skinny q/k/v: a CUDA kernel (decode_qkv_into_cache takes the three ops on the CPU)"
            )
        }

        fn cuda_fwd(
            &self,
            pool: &mut candle_core::CudaStorage,
            lp: &Layout,
        ) -> candle_core::Result<()> {
            fn cuda(s: &Storage) -> candle_core::Result<&candle_core::CudaStorage> {
                cuda_storage(s, "skinny q/k/v")
            }
            let (xg, xl) = self.x.storage_and_layout();
            let (wg, wl) = self.w.storage_and_layout();
            let (cg, cl) = self.counters.storage_and_layout();
            let (cos_g, cos_l) = self.cos.storage_and_layout();
            let (sin_g, sin_l) = self.sin.storage_and_layout();
            let (sg, sl) = self.slots.storage_and_layout();
            let bias_g = self.bias.map(|b| b.storage_and_layout());
            let bias = match &bias_g {
                Some((g, l)) => Some((cuda(g)?, *l)),
                None => None,
            };
            let (rows, k, nh, nkv, d, slot_count) = self.dims;
            let q = crate::ops::decode_cuda::skinny_qkv(
                (cuda(&xg)?, xl),
                (cuda(&wg)?, wl),
                (cuda(&cg)?, cl),
                &self.plan,
                bias,
                ((cuda(&cos_g)?, cos_l), (cuda(&sin_g)?, sin_l)),
                (pool, lp),
                (cuda(&sg)?, sl),
                (rows, k),
                (nh, nkv, d, slot_count),
            )?;
            *self
                .q
                .lock()
                .map_err(|_| candle_core::Error::Msg("skinny q/k/v: poisoned".into()))? = Some(q);
            Ok(())
        }
    }

    /// The kernel as a candle op over `(x, w)`, both contiguous bf16 on one CUDA device, with
    /// [`plan_for`]'s plan.
    pub(super) struct SkinnyProduct<'a> {
        pub(super) plan: SkinnyPlan,
        pub(super) epilogue: DecodeEpilogue,
        pub(super) counters: &'a Tensor,
    }

    impl CustomOp2 for SkinnyProduct<'_> {
        fn name(&self) -> &'static str {
            "skinny-product"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!(
                "skinny product: a CUDA kernel (decode_product takes linear on the CPU)"
            )
        }

        fn cuda_fwd(
            &self,
            x: &candle_core::CudaStorage,
            lx: &Layout,
            w: &candle_core::CudaStorage,
            lw: &Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
            let (rows, k) = lx.shape().dims2()?;
            let (out, _) = lw.shape().dims2()?;
            let (cg, cl) = self.counters.storage_and_layout();
            let y = crate::ops::decode_cuda::skinny_product(
                (x, lx),
                (w, lw),
                (cuda_storage(&cg, "skinny product")?, cl),
                &self.plan,
                self.epilogue == DecodeEpilogue::Swiglu,
                (rows, out, k),
            )?;
            let cols = match self.epilogue {
                DecodeEpilogue::Product => out,
                DecodeEpilogue::Swiglu => out / 2,
            };
            Ok((y, Shape::from((rows, cols))))
        }
    }
}

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
        // the kernel's 16 bytes of static shared memory) any sm_80+ card allows a block.
        assert_eq!(gate_up.shared_bytes, 3 * 192 * 72 * 2);
        assert!(gate_up.shared_bytes + 16 <= 99 * 1024);
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
        let y = decode_product(&x, &w, DecodeEpilogue::Product, None)?;
        let want = x.matmul(&w.t()?)?;
        let diff = (y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        let s = decode_product(&x, &w, DecodeEpilogue::Swiglu, None)?;
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
        let e = decode_product(&x, &w, DecodeEpilogue::Product, None).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
        let w = Tensor::zeros((7, 16), DType::F32, &dev).unwrap();
        let e = decode_product(&x, &w, DecodeEpilogue::Swiglu, None).unwrap_err();
        assert!(e.to_string().contains("gate | up"), "{e}");
    }
}
