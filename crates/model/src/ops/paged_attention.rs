//! Decode attention over a paged KV cache: one query token per row attends to the row's
//! keys/values wherever its block table puts them in the block pool, with grouped-query heads.
//!
//! The pool holds `[slots, kv_heads, head_dim]` keys (and values), `block_size` slots per
//! block; token `j` of a row lies in slot `table[j / block_size] * block_size + j % block_size`.
//! The CPU kernel (f32/f64) and, built with `--features cuda`, the CUDA kernel (f32/bf16,
//! `decode_kernels.cu`: a block per row, KV head and chunk of up to
//! [`DECODE_CHUNK`](super::decode_plan::DECODE_CHUNK) keys,
//! the chunks merged flash-decoding style by the last block of a row to finish) read the slots in place (no per-step copy of the rows'
//! K/V); elsewhere [`paged_decode_attention_composed`] gathers each row's slots into a
//! contiguous, masked batch with candle ops (the device-generic fallback, and the reference of
//! the tests). Inference only: no backward.

use super::decode_plan::decode_plan;
use super::{dot, kernels_apply, layout_slice, par_map, work_dtype, Real};
use anyhow::{bail, Context, Result};
use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor};
use std::sync::OnceLock;

/// Multiply-adds per K or V pass (keys read × query heads × head_dim) below which the CPU
/// kernel runs on the calling thread: spawning threads costs more than it saves.
const PARALLEL_WORK: usize = 1 << 22;

/// Where the rows of one decode step find their keys and values in a block pool.
#[derive(Debug)]
pub struct PagedLayout {
    block_size: usize,
    tables: Vec<Vec<u32>>,
    lens: Vec<usize>,
    /// The fallback's slot index `[rows · longest]` and mask `[rows, 1, 1, longest]`, built
    /// once per layout (a step's layers share them).
    gathered: OnceLock<(Tensor, Tensor)>,
    /// The CUDA kernel's block tables `[rows, max_blocks]`, lengths `[rows]` and split
    /// counters `[rows · kv_heads]` (u32), built once per layout (or given:
    /// [`PagedLayout::with_device_tables`]); a step's layers share them.
    #[cfg(feature = "cuda")]
    device_tables: OnceLock<(Tensor, Tensor, Tensor)>,
    /// The longest row the CUDA kernel is planned for, when fixed in advance (a captured
    /// launch keeps its grid whatever later steps' rows are); else this step's longest.
    plan_len: Option<usize>,
}

impl PagedLayout {
    /// Rows attending to `lens[b]` tokens stored in the blocks `tables[b]` (in order) of
    /// `block_size` slots. Errors when a row is empty or its table is too short.
    pub fn new(block_size: usize, tables: Vec<Vec<u32>>, lens: Vec<usize>) -> Result<Self> {
        if block_size == 0 {
            bail!("paged attention: block_size must be >= 1");
        }
        if tables.len() != lens.len() {
            bail!(
                "paged attention: {} block tables for {} row lengths",
                tables.len(),
                lens.len()
            );
        }
        for (b, (t, &len)) in tables.iter().zip(&lens).enumerate() {
            if len == 0 || t.len() < len.div_ceil(block_size) {
                bail!(
                    "paged attention: row {b} attends to {len} tokens but its table has {} blocks of {block_size}",
                    t.len()
                );
            }
        }
        Ok(PagedLayout {
            block_size,
            tables,
            lens,
            gathered: OnceLock::new(),
            #[cfg(feature = "cuda")]
            device_tables: OnceLock::new(),
            plan_len: None,
        })
    }

    /// The same layout with the CUDA kernel's inputs given: `tables` u32 `[rows, width]` and
    /// `lens` u32 `[rows]` on the device (views of a buffer a CUDA graph reads, holding this
    /// layout's tables and lengths: the caller uploads them), `counters` u32 `[rows ·
    /// kv_heads]` (or more), zeros, where the kernel counts the chunks of a row done (each
    /// launch leaves them zero; the caller keeps them as long as a graph that read them), and
    /// the kernel planned for rows of up to `plan_len` keys, so one captured launch serves
    /// every later step whose rows fit. The CPU kernel reads the host tables as before.
    pub fn with_device_tables(
        self,
        (tables, lens, counters): (Tensor, Tensor, Tensor),
        plan_len: usize,
    ) -> Result<Self> {
        let rows = self.rows();
        let width = self.tables.iter().map(Vec::len).max().unwrap_or(0);
        let (t_rows, t_width) = tables.dims2().context("paged attention: device tables")?;
        if t_rows != rows
            || t_width < width
            || lens.dims() != [rows]
            || counters
                .dims1()
                .context("paged attention: split counters")?
                < rows
            || plan_len < self.longest()
        {
            bail!(
                "paged attention: device tables {:?}, lengths {:?} and split counters {:?} planned for {plan_len} keys do not hold {rows} rows of up to {width} blocks and {} keys",
                tables.dims(),
                lens.dims(),
                counters.dims(),
                self.longest()
            );
        }
        #[cfg(feature = "cuda")]
        let _ = self.device_tables.set((tables, lens, counters));
        #[cfg(not(feature = "cuda"))]
        let _ = (tables, lens, counters);
        Ok(PagedLayout {
            plan_len: Some(plan_len),
            ..self
        })
    }

    /// Keys the longest row attends to.
    fn longest(&self) -> usize {
        self.lens.iter().copied().max().unwrap_or(0)
    }

    /// Keys the CUDA kernel is planned for: the fixed plan length, else the longest row.
    fn plan_len(&self) -> usize {
        self.plan_len.unwrap_or_else(|| self.longest())
    }

    /// Rows in the step.
    pub fn rows(&self) -> usize {
        self.lens.len()
    }

    /// The pool slot of token `j` of row `b`.
    #[inline]
    fn slot(&self, b: usize, j: usize) -> usize {
        self.tables[b][j / self.block_size] as usize * self.block_size + j % self.block_size
    }

    /// The largest slot any row reads, plus one.
    fn slots_needed(&self) -> usize {
        (0..self.rows())
            .map(|b| self.slot(b, self.lens[b] - 1) + 1)
            .max()
            .unwrap_or(0)
    }

    /// The fallback's gather index and additive mask on `device` (padding keys of shorter
    /// rows read slot 0 and are masked with −∞).
    fn gathered(&self, device: &Device) -> Result<&(Tensor, Tensor)> {
        if let Some(g) = self.gathered.get() {
            return Ok(g);
        }
        let (rows, longest) = (self.rows(), self.longest());
        let mut index = vec![0u32; rows * longest];
        let mut mask = vec![f32::NEG_INFINITY; rows * longest];
        for b in 0..rows {
            for j in 0..self.lens[b] {
                index[b * longest + j] = self.slot(b, j) as u32;
                mask[b * longest + j] = 0.0;
            }
        }
        let built = (
            Tensor::from_vec(index, rows * longest, device)?,
            Tensor::from_vec(mask, (rows, 1, 1, longest), device)?,
        );
        Ok(self.gathered.get_or_init(|| built))
    }

    /// The CUDA kernel's block tables `[rows, max_blocks]` (shorter tables padded with block
    /// 0, never read), row lengths `[rows]` and split counters `[rows · kv_heads]` (zeros),
    /// u32 on `device`.
    #[cfg(feature = "cuda")]
    fn device_tables(
        &self,
        device: &Device,
        kv_heads: usize,
    ) -> candle_core::Result<&(Tensor, Tensor, Tensor)> {
        if let Some(t) = self.device_tables.get() {
            return Ok(t);
        }
        let rows = self.rows();
        let width = self.tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut flat = vec![0u32; rows * width];
        for (b, t) in self.tables.iter().enumerate() {
            flat[b * width..b * width + t.len()].copy_from_slice(t);
        }
        let lens: Vec<u32> = self.lens.iter().map(|&l| l as u32).collect();
        let built = (
            Tensor::from_vec(flat, (rows, width), device)?,
            Tensor::from_vec(lens, rows, device)?,
            Tensor::zeros(rows * kv_heads, candle_core::DType::U32, device)?,
        );
        Ok(self.device_tables.get_or_init(|| built))
    }
}

/// Whether the CUDA kernel serves `heads` query heads over `kv_heads` of `head_dim`, blocks of
/// `block_size` slots and rows of up to `plan_len` keys. A captured decode step needs it: the
/// composed fallback's shapes follow each step's rows.
pub(crate) fn cuda_kernel_serves(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    plan_len: usize,
) -> bool {
    kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && decode_plan(kv_heads, heads / kv_heads, head_dim, block_size, plan_len).is_some()
}

/// Shapes `(rows, heads, kv_heads, head_dim)` of valid inputs.
fn check_inputs(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    layout: &PagedLayout,
) -> Result<(usize, usize, usize, usize)> {
    let (b, hq, d) = q
        .dims3()
        .context("paged attention: q must be [rows, heads, head_dim]")?;
    let (slots, hkv, dk) = k_pool
        .dims3()
        .context("paged attention: the key pool must be [slots, kv_heads, head_dim]")?;
    if dk != d || v_pool.dims() != k_pool.dims() {
        bail!(
            "paged attention: q {:?}, key pool {:?} and value pool {:?} disagree",
            q.dims(),
            k_pool.dims(),
            v_pool.dims()
        );
    }
    if hkv == 0 || hq % hkv != 0 {
        bail!("paged attention: {hq} query heads are not a multiple of {hkv} key/value heads");
    }
    if k_pool.dtype() != q.dtype() || v_pool.dtype() != q.dtype() {
        bail!("paged attention: q and the pools have different dtypes");
    }
    if layout.rows() != b {
        bail!(
            "paged attention: {b} query rows but the layout has {}",
            layout.rows()
        );
    }
    if layout.slots_needed() > slots {
        bail!(
            "paged attention: a block table reads slot {} of a pool of {slots}",
            layout.slots_needed() - 1
        );
    }
    Ok((b, hq, hkv, d))
}

/// Attention of one query token per row, `q` `[rows, heads, head_dim]`, over the rows' keys
/// and values in `k_pool`/`v_pool` (`[slots, kv_heads, head_dim]`) as `layout` places them,
/// scores scaled by `scale` → `[rows, heads, head_dim]`. Query head `h` uses key/value head
/// `h / (heads / kv_heads)`. The CPU kernel (f32/f64) and the CUDA kernel (f32/bf16, head_dim
/// up to 256) read the pool in place; other devices and dtypes use
/// [`paged_decode_attention_composed`].
pub fn paged_decode_attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    layout: &PagedLayout,
    scale: f64,
) -> Result<Tensor> {
    let (_, hq, hkv, d) = check_inputs(q, k_pool, v_pool, layout)?;
    let kernel = kernels_apply(q)
        && (q.device().is_cpu()
            || decode_plan(
                layout.rows() * hkv,
                hq / hkv,
                d,
                layout.block_size,
                layout.plan_len(),
            )
            .is_some());
    if !kernel {
        return paged_decode_attention_composed(q, k_pool, v_pool, layout, scale);
    }
    let op = PagedDecode { layout, scale };
    Ok(q.contiguous()?
        .apply_op3_no_bwd(&k_pool.contiguous()?, &v_pool.contiguous()?, &op)?)
}

/// The same attention from candle ops on any device: each row's slots gathered into a
/// `[rows, kv_heads, longest, head_dim]` batch (padding masked), scores and softmax in f32
/// (f64 for f64), as the dense cache's attention computes them.
pub fn paged_decode_attention_composed(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    layout: &PagedLayout,
    scale: f64,
) -> Result<Tensor> {
    let (b, hq, hkv, d) = check_inputs(q, k_pool, v_pool, layout)?;
    let (index, mask) = layout.gathered(q.device())?;
    let longest = index.dim(0)? / b.max(1);
    let gather = |pool: &Tensor| -> Result<Tensor> {
        Ok(pool
            .contiguous()?
            .index_select(index, 0)?
            .reshape((b, longest, hkv, d))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let (k, v) = (gather(k_pool)?, gather(v_pool)?);
    // The query heads of one group stacked along the query axis, as in the dense attention.
    let q = q.reshape((b, hkv, hq / hkv, d))?;
    let work = work_dtype(q.dtype());
    let scores = (q.matmul(&k.t()?)? * scale)?
        .to_dtype(work)?
        .broadcast_add(&mask.to_dtype(work)?)?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.contiguous()?)?.to_dtype(q.dtype())?;
    Ok(probs.matmul(&v)?.reshape((b, hq, d))?)
}

/// One (row, key/value head) task of the CPU kernel: the group's `n_rep` query heads
/// (`[n_rep, d]`), the pools, and the row's slots in token order.
struct Group<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    slots: &'a [usize],
    g: usize,
    hkv: usize,
    d: usize,
    scale: T,
}

/// `[n_rep, d]`: each query head's softmax-weighted sum of the row's values. Each key and
/// value row is read once for all query heads of the group.
#[inline(always)]
fn attend_group<T: Real>(t: &Group<'_, T>) -> Vec<T> {
    let (d, len) = (t.d, t.slots.len());
    let n_rep = t.q.len() / d;
    let mut scores = vec![T::zero(); n_rep * len];
    for (j, &s) in t.slots.iter().enumerate() {
        let kj = &t.k[(s * t.hkv + t.g) * d..(s * t.hkv + t.g + 1) * d];
        for r in 0..n_rep {
            scores[r * len + j] = dot(&t.q[r * d..(r + 1) * d], kj) * t.scale;
        }
    }
    for p in scores.chunks_mut(len.max(1)) {
        let max = p
            .iter()
            .fold(T::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        let mut sum = T::zero();
        for x in p.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let inv = T::one() / sum;
        p.iter_mut().for_each(|x| *x *= inv);
    }
    let mut out = vec![T::zero(); n_rep * d];
    for (j, &s) in t.slots.iter().enumerate() {
        let vj = &t.v[(s * t.hkv + t.g) * d..(s * t.hkv + t.g + 1) * d];
        for r in 0..n_rep {
            let w = scores[r * len + j];
            for (a, &x) in out[r * d..(r + 1) * d].iter_mut().zip(vj) {
                *a += w * x;
            }
        }
    }
    out
}

/// [`attend_group`] compiled for AVX2 (8-wide f32 lanes; the default x86-64 target has 4).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn attend_group_avx2<T: Real>(t: &Group<'_, T>) -> Vec<T> {
    attend_group(t)
}

/// The CPU kernel's op: per (row, key/value head) task, each query head of the group scores
/// the row's keys slot by slot, softmaxes and sums the values.
struct PagedDecode<'a> {
    layout: &'a PagedLayout,
    scale: f64,
}

impl PagedDecode<'_> {
    fn fwd_typed<T: Real>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        (b, hq, hkv, d): (usize, usize, usize, usize),
    ) -> Vec<T> {
        let n_rep = hq / hkv;
        let scale = T::from_f64(self.scale);
        let layout = self.layout;
        let task = |task: usize| {
            let (row, g) = (task / hkv, task % hkv);
            let slots: Vec<usize> = (0..layout.lens[row]).map(|j| layout.slot(row, j)).collect();
            let at = (row * hq + g * n_rep) * d;
            let group = Group {
                q: &q[at..at + n_rep * d],
                k,
                v,
                slots: &slots,
                g,
                hkv,
                d,
                scale,
            };
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                return unsafe { attend_group_avx2(&group) };
            }
            attend_group(&group)
        };
        // Threads only pay off on enough keys: a small step runs inline.
        let work = layout.lens.iter().sum::<usize>() * hq * d;
        let parts: Vec<Vec<T>> = if work >= PARALLEL_WORK {
            par_map(b * hkv, task)
        } else {
            (0..b * hkv).map(task).collect()
        };
        let mut out = vec![T::zero(); b * hq * d];
        for (task, part) in parts.into_iter().enumerate() {
            let (row, g) = (task / hkv, task % hkv);
            let at = (row * hq + g * n_rep) * d;
            out[at..at + n_rep * d].copy_from_slice(&part);
        }
        out
    }
}

impl CustomOp3 for PagedDecode<'_> {
    fn name(&self) -> &'static str {
        "paged-decode-gqa-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, hq, d) = lq.shape().dims3()?;
        let (_, hkv, _) = lk.shape().dims3()?;
        let dims = (b, hq, hkv, d);
        let w = "paged attention";
        let out = match (q, k, v) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(self.fwd_typed::<f32>(
                    layout_slice(q, lq, w)?,
                    layout_slice(k, lk, w)?,
                    layout_slice(v, lv, w)?,
                    dims,
                ))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(self.fwd_typed::<f64>(
                    layout_slice(q, lq, w)?,
                    layout_slice(k, lk, w)?,
                    layout_slice(v, lv, w)?,
                    dims,
                ))
            }
            _ => candle_core::bail!("paged attention kernel: q and the pools must be f32 or f64"),
        };
        Ok((out, lq.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (_, hq, d) = lq.shape().dims3()?;
        let (_, hkv, _) = lk.shape().dims3()?;
        let layout = self.layout;
        let Some(plan) = decode_plan(
            layout.rows() * hkv,
            hq / hkv,
            d,
            layout.block_size,
            layout.plan_len(),
        ) else {
            candle_core::bail!(
                "paged attention: the CUDA kernel cannot serve {hq} query heads over {hkv} of dim {d}"
            )
        };
        let (tables, lens, counters) =
            layout.device_tables(&Device::Cuda(q.device().clone()), hkv)?;
        let out = super::decode_cuda::paged_decode(
            (q, lq),
            (k, lk),
            (v, lv),
            (tables, lens, counters),
            &plan,
            self.scale,
        )?;
        Ok((out, lq.shape().clone()))
    }
}
