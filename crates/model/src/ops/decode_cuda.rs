//! Launchers of the rollout engine's decode kernels in `decode_kernels.cu` (built to their own
//! PTX module by build.rs) for contiguous f32 and bf16 storages. The paged decode attention's
//! custom op calls [`paged_decode`] from its `cuda_fwd`; its CPU twin is the op's `cpu_fwd`,
//! and `tests/paged_kv/` compares both with a dense reference on `$COMPOSER_TEST_DEVICE`.

use super::cuda::{alloc, kernel_name, launch_opted_in, typed, view};
use super::decode_gemm::{SkinnyPlan, SKINNY_THREADS};
use super::decode_plan::{decode_tc_shared_bytes, DecodePlan, DECODE_TC_THREADS, DECODE_THREADS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Storage, Tensor};
use half::bf16;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode.ptx"));
const MODULE: &str = "composer_model_decode";

/// Attention of one query per row, `q` `[rows, hq, d]`, over the pools `k`/`v`
/// `[slots, hkv, d]` read in place through `tables` (u32 `[rows, max_blocks]`) and `lens`
/// (u32 `[rows]`), both on q's device. The caller checked the shapes and that every slot
/// the tables reach lies inside the pools. With more than one chunk of keys per row
/// (`plan.splits > 1`), each chunk's partial sums go to an f32 workspace and the last block of
/// a (row, KV head) to finish merges them, counting arrivals in `counters` (u32, at least
/// `rows · hkv`, zero before and after: see [`super::PagedLayout::with_device_tables`]). bf16
/// at head_dim 64/128 with ≤ 16 query heads per KV head runs the tensor-core kernel
/// (`decode_tc_kernels.cuh`; same chunks, same partials, same merge).
pub(super) fn paged_decode(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    (tables, lens, counters): (&Tensor, &Tensor, &Tensor),
    plan: &DecodePlan,
    scale: f64,
) -> Result<CudaStorage> {
    let dtype = q.0.dtype();
    let dev = q.0.device().clone();
    let (rows, hq, d) = q.1.shape().dims3()?;
    let (_, hkv, _) = k.1.shape().dims3()?;
    let max_blocks = tables.dim(1)?;
    let (tg, tl) = tables.storage_and_layout();
    let (lg, ll) = lens.storage_and_layout();
    let (Storage::Cuda(ts), Storage::Cuda(ls)) = (&*tg, &*lg) else {
        candle_core::bail!("paged attention: the block tables are not on the CUDA device")
    };
    let tv = view::<u32>(ts, tl, "paged attention tables")?;
    let lv = view::<u32>(ls, ll, "paged attention lengths")?;
    if counters.dims1()? < rows * hkv {
        candle_core::bail!(
            "paged attention: {} split counters for {rows} rows of {hkv} KV heads",
            counters.dims1()?
        )
    }
    let (cg, cl) = counters.storage_and_layout();
    let Storage::Cuda(cs) = &*cg else {
        candle_core::bail!("paged attention: the split counters are not on the CUDA device")
    };
    let cv = view::<u32>(cs, cl, "paged attention split counters")?;
    let ints = [
        hq as i32,
        hkv as i32,
        d as i32,
        plan.block_size as i32,
        max_blocks as i32,
        plan.chunk as i32,
        plan.splits as i32,
    ];
    let scale = scale as f32;
    let splits = plan.splits;
    // Chunk partials: sums [rows, hq, splits, d], max and exp-sum [rows, hq, splits].
    let parts = if splits > 1 {
        Some((
            alloc::<f32>(&dev, rows * hq * splits * d)?,
            alloc::<f32>(&dev, rows * hq * splits)?,
            alloc::<f32>(&dev, rows * hq * splits)?,
        ))
    } else {
        None
    };
    let null: u64 = 0;
    typed!(dtype, "paged attention", |T| {
        let qv = view::<T>(q.0, q.1, "paged attention q")?;
        let kv = view::<T>(k.0, k.1, "paged attention keys")?;
        let vv = view::<T>(v.0, v.1, "paged attention values")?;
        let out = alloc::<T>(&dev, rows * hq * d)?;
        let tc = decode_tc_shared_bytes(dtype == DType::BF16, hq / hkv, d);
        let name = match tc {
            Some(_) => format!("paged_decode_tc_d{d}_bf16"),
            None => kernel_name("paged_decode", dtype)?,
        };
        let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&qv).arg(&kv).arg(&vv).arg(&tv).arg(&lv).arg(&out);
        match &parts {
            Some((o, m, l)) => b.arg(o).arg(m).arg(l),
            None => b.arg(&null).arg(&null).arg(&null),
        };
        b.arg(&cv);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&scale);
        let (threads, shared_bytes) = match tc {
            Some(bytes) => (DECODE_TC_THREADS, bytes),
            None => (DECODE_THREADS, plan.shared_bytes),
        };
        let cfg = LaunchConfig {
            grid_dim: ((rows * hkv) as u32, splits as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: shared_bytes as u32,
        };
        // SAFETY: the arguments match the kernel's signature; the partial buffers are null
        // only when splits == 1 (the kernel then writes `out` directly, and reads no
        // counter); the counters hold rows · hkv words, zero between launches; every slot the
        // tables reach was checked against the pools' length by the caller.
        unsafe { b.launch(cfg) }.w()?;
        Ok(T::wrap_cuda_slice(out, dev))
    })
}

/// Threads per block of the one-block-per-row sampling kernel (`DS_THREADS`), used with top-k
/// or top-p.
const SAMPLE_THREADS: u32 = 1024;

/// Threads per block of the three part kernels (`SP_THREADS`).
const SAMPLE_PART_THREADS: u32 = 256;

/// Ids per part of a row in the part kernels: V = 151,936 makes 38 parts a row, so even one
/// row spreads over 38 SMs, and 64 rows over 2,432 blocks.
const SAMPLE_PART: usize = 4096;

/// Draws one token per row of `logits` `[rows, V]` (f32 or bf16, on the CUDA device) at
/// temperature `1 / inv_t` from what `filter` keeps, by inverse CDF at `uniforms[row]` (the CPU
/// sampler's draw, see the sampling kernels in sample_kernels.cuh); returns the tokens and
/// their log-probs. Without top-k and top-p, three launches over parts of every row; with
/// them, one block per row. Only `rows` uniforms go to the device and `rows` tokens and
/// log-probs come back.
pub(crate) fn sample_inverse_cdf(
    logits: &Tensor,
    uniforms: &[f64],
    inv_t: f32,
    filter: &crate::sampling::SampleFilter,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let (rows, vocab) = logits.dims2()?;
    if uniforms.len() != rows {
        candle_core::bail!(
            "sampling: {} uniforms for {rows} rows of logits",
            uniforms.len()
        );
    }
    if rows == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    if vocab == 0 || vocab > i32::MAX as usize {
        candle_core::bail!("sampling: a vocabulary of {vocab} tokens");
    }
    let logits = logits.contiguous()?;
    let dtype = logits.dtype();
    let (g, l) = logits.storage_and_layout();
    let Storage::Cuda(s) = &*g else {
        candle_core::bail!("sampling: the CUDA sampler got non-CUDA logits")
    };
    let dev = s.device().clone();
    let u = dev.clone_htod(uniforms)?;
    let tokens = alloc::<u32>(&dev, rows)?;
    let logprobs = alloc::<f32>(&dev, rows)?;
    let v_i = vocab as i32;
    // top_k ≥ V keeps everything, as 0 does.
    let top_k = if filter.top_k >= vocab {
        0
    } else {
        filter.top_k as i32
    };
    let (top_p, min_p) = (filter.top_p as f32, filter.min_p as f32);
    // The rows are the part kernels' second grid axis (at most 65,535).
    let by_parts = top_k == 0 && filter.top_p >= 1.0 && rows <= 65_535;
    typed!(dtype, "sampling", |T| {
        let lv = view::<T>(s, l, "sampling logits")?;
        let load =
            |name: &str| dev.get_or_load_custom_func(&kernel_name(name, dtype)?, MODULE, PTX);
        if by_parts {
            let parts = vocab.div_ceil(SAMPLE_PART);
            let (part_len, parts_i) = (SAMPLE_PART as i32, parts as i32);
            let part_m = alloc::<f32>(&dev, rows * parts)?;
            let part_s = alloc::<f32>(&dev, rows * parts)?;
            let part_mass = alloc::<f64>(&dev, rows * parts)?;
            let over_parts = LaunchConfig {
                grid_dim: (parts as u32, rows as u32, 1),
                block_dim: (SAMPLE_PART_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let f = load("sample_parts")?;
            let mut b = f.builder();
            b.arg(&lv).arg(&inv_t).arg(&part_m).arg(&part_s);
            b.arg(&v_i).arg(&part_len).arg(&parts_i);
            // SAFETY: the arguments match the kernel's signature; the part buffers hold
            // `rows · parts` elements, the logits `rows · vocab`.
            unsafe { b.launch(over_parts) }.w()?;
            let f = load("sample_part_mass")?;
            let mut b = f.builder();
            b.arg(&lv)
                .arg(&inv_t)
                .arg(&part_m)
                .arg(&part_s)
                .arg(&part_mass);
            b.arg(&v_i).arg(&part_len).arg(&parts_i).arg(&min_p);
            // SAFETY: as above; the first kernel wrote every part's max and sum.
            unsafe { b.launch(over_parts) }.w()?;
            let f = load("sample_pick")?;
            let mut b = f.builder();
            b.arg(&lv)
                .arg(&u)
                .arg(&inv_t)
                .arg(&part_m)
                .arg(&part_s)
                .arg(&part_mass);
            b.arg(&tokens).arg(&logprobs);
            b.arg(&v_i).arg(&part_len).arg(&parts_i).arg(&min_p);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (SAMPLE_PART_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as above; `u`, `tokens` and `logprobs` hold `rows` elements and the
            // second kernel wrote every part's mass.
            unsafe { b.launch(cfg) }.w()?;
        } else {
            let f = load("sample_inverse_cdf")?;
            let mut b = f.builder();
            b.arg(&lv)
                .arg(&u)
                .arg(&inv_t)
                .arg(&tokens)
                .arg(&logprobs)
                .arg(&v_i)
                .arg(&top_k)
                .arg(&top_p)
                .arg(&min_p);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (SAMPLE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match the kernel's signature; `u`, `tokens` and
            // `logprobs` hold `rows` elements, the logits `rows · vocab`.
            unsafe { b.launch(cfg) }.w()?;
        }
    });
    Ok((dev.clone_dtoh(&tokens)?, dev.clone_dtoh(&logprobs)?))
}

/// Writes `kv` `[2, rows, width]` (keys, then values) into the slots `slots` (u32 `[rows]`) of
/// `pool` `[2, slot_count, width]` in place. The caller checked the shapes and every slot.
pub(super) fn kv_write(
    pool: (&mut CudaStorage, &Layout),
    kv: (&CudaStorage, &Layout),
    slots: (&CudaStorage, &Layout),
    (rows, slot_count, width): (usize, usize, usize),
) -> Result<()> {
    let dtype = kv.0.dtype();
    let dev = kv.0.device().clone();
    let Some((a, b)) = pool.1.contiguous_offsets() else {
        candle_core::bail!("kv write: the pool must be contiguous")
    };
    let ints = [rows, slot_count, width].map(|x| x as i32);
    let sv = view::<u32>(slots.0, slots.1, "kv write slots")?;
    typed!(dtype, "kv write", |T| {
        let src = view::<T>(kv.0, kv.1, "kv write keys and values")?;
        let mut dst = pool.0.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
        let f = dev.get_or_load_custom_func(&kernel_name("kv_write", dtype)?, MODULE, PTX)?;
        let mut builder = f.builder();
        builder.arg(&mut dst).arg(&src).arg(&sv);
        for x in &ints {
            builder.arg(x);
        }
        let n = 2 * rows * width;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 8192) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's signature; every slot is below
        // `slot_count`, so each write lies in the pool.
        unsafe { builder.launch(cfg) }.w()?;
    });
    Ok(())
}

/// A skinny product's input norm: its weight `[k]` (contiguous bf16) and eps.
pub(super) type NormArg<'a> = Option<(&'a CudaStorage, &'a Layout, f32)>;

/// The decode step's skinny product (`skinny_gemm_{plain,swiglu}_m{1..4}_bf16`, see
/// `decode_gemm.rs`) of `x` `[rows, k]` and `w` `[out, k]`, both contiguous bf16 starting
/// 16-byte aligned, with `counters` (u32, at least `plan.tiles`, zero) for its split k: returns
/// `[rows, out]`, or `[rows, out / 2]` with the SwiGLU epilogue (`swiglu`); `x` through the
/// input `norm` first, `residual` `[rows, out]` (contiguous bf16, plain only) added.
#[allow(clippy::too_many_arguments)]
pub(super) fn skinny_product(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    counters: (&CudaStorage, &Layout),
    plan: &SkinnyPlan,
    norm: NormArg,
    residual: Option<(&CudaStorage, &Layout)>,
    swiglu: bool,
    (rows, out, k): (usize, usize, usize),
) -> Result<CudaStorage> {
    let dev = x.0.device().clone();
    let cols = if swiglu { out / 2 } else { out };
    if swiglu && residual.is_some() {
        candle_core::bail!("skinny product: a residual takes the plain product")
    }
    let y = alloc::<bf16>(&dev, rows * cols)?;
    let kind = if swiglu { "swiglu" } else { "plain" };
    let args = SkinnyArgs::new(x, w, counters, plan, norm, (rows, out, k))?;
    let rv = residual
        .map(|(s, l)| view::<bf16>(s, l, "skinny product residual"))
        .transpose()?;
    if rv.as_ref().is_some_and(|v| v.len() != rows * out) {
        candle_core::bail!("skinny product: the residual is not [{rows}, {out}]")
    }
    let f = dev.get_or_load_custom_func(&args.kernel(kind), MODULE, PTX)?;
    let mut b = f.builder();
    args.push(&mut b);
    b.arg(&y);
    if !swiglu {
        match &rv {
            Some(v) => b.arg(v),
            None => b.arg(&args.null),
        };
    }
    // SAFETY: the arguments match the kernel's signature ([`SkinnyArgs`]'s, then y, which
    // holds `rows · cols`, then for the plain product the residual, `rows · out` or null);
    // the caller checked the shapes, the plan and the alignment.
    unsafe { launch_opted_in(&f, &mut b, args.config(), "skinny product") }?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// The skinny product of `x` `[rows, k]` and the stacked `[q | k | v]` weight `w`
/// `[(nh + 2·nkv)·d, k]` with the q/k/v epilogue (`skinny_gemm_qkv_m{1..4}_bf16`): the
/// product rounded, `bias` (`[(nh + 2·nkv)·d]`, optional) added, q and k rotated by `cos`/`sin`
/// `[rows, d / 2]`; returns q `[rows, nh, d]` and writes row r's key and value into slot
/// `slots[r]` of `pool` `[2, slot_count, nkv·d]` in place. Everything bf16 and contiguous;
/// the caller checked the shapes, `d` (even, dividing 128) and every slot.
#[allow(clippy::too_many_arguments)]
pub(super) fn skinny_qkv(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    counters: (&CudaStorage, &Layout),
    plan: &SkinnyPlan,
    norm: NormArg,
    bias: Option<(&CudaStorage, &Layout)>,
    (cos, sin): ((&CudaStorage, &Layout), (&CudaStorage, &Layout)),
    pool: (&mut CudaStorage, &Layout),
    slots: (&CudaStorage, &Layout),
    (rows, k): (usize, usize),
    (nh, nkv, d, slot_count): (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    let dev = x.0.device().clone();
    let q = alloc::<bf16>(&dev, rows * nh * d)?;
    let Some((a, b)) = pool.1.contiguous_offsets() else {
        candle_core::bail!("skinny q/k/v: the pool must be contiguous")
    };
    let mut pv = pool.0.as_cuda_slice_mut::<bf16>()?.slice_mut(a..b);
    let bv = bias
        .map(|(s, l)| view::<bf16>(s, l, "skinny q/k/v bias"))
        .transpose()?;
    let cv = view::<bf16>(cos.0, cos.1, "skinny q/k/v cos")?;
    let sv = view::<bf16>(sin.0, sin.1, "skinny q/k/v sin")?;
    let slv = view::<u32>(slots.0, slots.1, "skinny q/k/v slots")?;
    let ints = [nh, nkv, d, slot_count].map(|v| v as i32);
    let null: u64 = 0;
    let args = SkinnyArgs::new(x, w, counters, plan, norm, (rows, (nh + 2 * nkv) * d, k))?;
    let f = dev.get_or_load_custom_func(&args.kernel("qkv"), MODULE, PTX)?;
    let mut b = f.builder();
    args.push(&mut b);
    match &bv {
        Some(v) => b.arg(v),
        None => b.arg(&null),
    };
    b.arg(&cv).arg(&sv).arg(&q).arg(&mut pv).arg(&slv);
    for v in &ints {
        b.arg(v);
    }
    // SAFETY: the arguments match the kernel's signature; q holds `rows · nh · d`; every slot
    // is below `slot_count` (checked by the caller), so each key and value lands in the pool.
    unsafe { launch_opted_in(&f, &mut b, args.config(), "skinny q/k/v") }?;
    Ok(CudaStorage::wrap_cuda_slice(q, dev))
}

/// The arguments every skinny-product kernel starts with (x, w, the split partials, the
/// counters, m, n, k, k_split, splits, the input norm's weight and eps) and its launch shape.
struct SkinnyArgs<'a> {
    x: CudaView<'a, bf16>,
    w: CudaView<'a, bf16>,
    /// The split partials: f32 `[tiles, splits, 16·m_tiles, 128]` then the rows' sums of
    /// squares `[tiles, splits, 16·m_tiles]`, when k is split.
    part: Option<CudaSlice<f32>>,
    null: u64,
    counters: CudaView<'a, u32>,
    ints: [i32; 5],
    norm_w: Option<CudaView<'a, bf16>>,
    eps: f32,
    plan: SkinnyPlan,
}

impl<'a> SkinnyArgs<'a> {
    fn new(
        x: (&'a CudaStorage, &Layout),
        w: (&'a CudaStorage, &Layout),
        counters: (&'a CudaStorage, &Layout),
        plan: &SkinnyPlan,
        norm: NormArg<'a>,
        (rows, out, k): (usize, usize, usize),
    ) -> Result<Self> {
        if counters.1.shape().elem_count() < plan.tiles {
            candle_core::bail!(
                "skinny product: {} split counters for {} tiles",
                counters.1.shape().elem_count(),
                plan.tiles
            );
        }
        let part = if plan.splits > 1 {
            let n = plan.tiles * plan.splits * 16 * plan.m_tiles * (128 + 1);
            Some(alloc::<f32>(x.0.device(), n)?)
        } else {
            None
        };
        let norm_w = norm
            .map(|(s, l, _)| view::<bf16>(s, l, "skinny product norm weight"))
            .transpose()?;
        if norm_w.as_ref().is_some_and(|v| v.len() != k) {
            candle_core::bail!("skinny product: the input norm's weight is not [{k}]")
        }
        Ok(SkinnyArgs {
            x: view::<bf16>(x.0, x.1, "skinny product x")?,
            w: view::<bf16>(w.0, w.1, "skinny product weight")?,
            part,
            null: 0,
            counters: view::<u32>(counters.0, counters.1, "skinny product counters")?,
            ints: [rows, out, k, plan.k_split, plan.splits].map(|v| v as i32),
            norm_w,
            eps: norm.map_or(0.0, |(_, _, eps)| eps),
            plan: *plan,
        })
    }

    /// `skinny_gemm_{epilogue}_m{MT}_bf16`.
    fn kernel(&self, epilogue: &str) -> String {
        format!("skinny_gemm_{epilogue}_m{}_bf16", self.plan.m_tiles)
    }

    fn push<'b>(&'b self, b: &mut LaunchArgs<'b>) {
        b.arg(&self.x).arg(&self.w);
        match &self.part {
            Some(p) => b.arg(p),
            None => b.arg(&self.null),
        };
        b.arg(&self.counters);
        for v in &self.ints {
            b.arg(v);
        }
        match &self.norm_w {
            Some(v) => b.arg(v),
            None => b.arg(&self.null),
        };
        b.arg(&self.eps);
    }

    fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.plan.tiles as u32, self.plan.splits as u32, 1),
            block_dim: (SKINNY_THREADS as u32, 1, 1),
            shared_mem_bytes: self.plan.shared_bytes as u32,
        }
    }
}
