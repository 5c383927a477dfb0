//! The rollout engine's decode step at fixed shapes, captured as a CUDA graph and replayed
//! ([`EngineConfig::cuda_graphs`](crate::EngineConfig::cuda_graphs)).
//!
//! On a small model the GPU decode step is bound by launches and host work, not bytes
//! (Qwen2.5-0.5B at batch 64: ~3% of the HBM roofline, BENCHMARKS.md): every step issues the
//! same ~10 launches per layer from the host. A CUDA graph records a step's launches once and
//! replays them with one call. A graph replays fixed pointers and launch shapes, so the step
//! is made shape-stable:
//! - rows are padded up to a power of two (one graph per size used; at most 2× the rows);
//!   padded rows feed token 0 at position 0 and write and read a scratch block no table holds;
//! - every input the step reads (token ids, positions, KV slots, lengths, block tables padded
//!   to the run's longest possible table) lives in one u32 buffer per size, overwritten in
//!   place before each replay (one upload);
//! - the attention kernel is planned for the longest row the run can have, not this step's;
//! - the logits land in one buffer sized for the largest step (each size writes its first
//!   rows), which sampling reads.
//!
//! A size's first step runs eagerly (its result is that step's; candle caches the small
//! shape/stride uploads its kernels make, which a capture may not do) and is then captured;
//! later steps of that size replay. When the block pool grows (a new pool tensor), the graphs
//! are captured again. On the CPU the same fixed-shape step runs eagerly (no capture): CI
//! tests the padding, the scratch block and the input buffer there.
//!
//! A capture records everything issued to the device's one stream: no other thread may use the
//! device during a `generate` call with graphs on (the trainer refuses `cuda_graphs` with
//! `[train] mode = "async"` on a CUDA device).

use crate::ops::{KvSlots, PagedLayout};
use crate::paged_kv::{BlockPool, BlockTable, PagedStep};
use crate::transformer::{DecodeStacks, Transformer};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// What the fixed-shape decode did in one engine run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphStats {
    /// Decode steps run at a padded, fixed shape (eager, captured or replayed).
    pub padded_steps: usize,
    /// CUDA graphs captured (one per padded size, again after the pool grew).
    pub captures: usize,
    /// Steps replayed from a captured graph.
    pub replays: usize,
}

/// One padded size's input buffer and graph.
struct Bucket {
    /// u32 `[rows · (4 + width)]`: ids, positions, slots and lengths `[rows]` each, then the
    /// block tables `[rows, width]`.
    inputs: Tensor,
    /// u32 `[rows · kv_heads]`, zeros between launches: the paged attention counts each row's
    /// chunks done here ([`PagedLayout::with_device_tables`]); the graph replays its pointer.
    split_counters: Tensor,
    #[cfg(feature = "cuda")]
    graph: Option<candle_core::cuda_backend::cudarc::driver::CudaGraph>,
}

/// The fixed-shape decode of one engine run: its padded sizes and their graphs.
pub(crate) struct DecodeGraphs {
    block_size: usize,
    /// Blocks in every row's table: the most any row of the run can hold.
    width: usize,
    /// The block padded rows write and read (taken from the pool on the first step).
    scratch: Option<u32>,
    /// The pool's generation the graphs were captured against.
    pool_generation: u64,
    /// Rows of the largest padded step (a power of two).
    max_rows: usize,
    /// The steps' logits `[max_rows, vocab]` (the model's dtype): a step of `n` rows writes the first `n`
    /// (CUDA; allocated at the first capture).
    #[cfg(feature = "cuda")]
    logits: Option<Tensor>,
    buckets: BTreeMap<usize, Bucket>,
    pub(crate) stats: GraphStats,
}

impl DecodeGraphs {
    /// The fixed-shape decode for `model` with blocks of `block_size` slots, rows of up to
    /// `max_slots` tokens, steps of up to `max_rows` rows. Errors when the step cannot be captured: its ops would follow each
    /// step's shapes (no training kernels for the model's device and dtype, or a head shape the
    /// paged attention kernel does not serve).
    pub(crate) fn new(
        model: &Transformer,
        block_size: usize,
        max_slots: usize,
        max_rows: usize,
    ) -> Result<Self> {
        let width = max_slots.div_ceil(block_size).max(1);
        let c = &model.cfg;
        let served = model.device().is_cpu()
            || crate::ops::paged_attention::cuda_kernel_serves(
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                block_size,
                width * block_size,
            );
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(d) = model.device() {
            // A capture may neither wait on events recorded before it (cudarc's per-tensor
            // tracking, `COMPOSER_CUDA_EVENT_TRACKING=1`) nor allocate synchronously.
            if d.is_event_tracking() || !d.cuda_stream().context().has_async_alloc() {
                bail!(
                    "cuda_graphs = true needs stream-ordered allocation and cudarc's event tracking off (unset COMPOSER_CUDA_EVENT_TRACKING); set cuda_graphs = false"
                );
            }
        }
        if !model.decode_is_kernel_path() || !served {
            bail!(
                "cuda_graphs = true: this model's decode step cannot run at fixed shapes ({:?} on {:?}, {} heads over {} KV heads of dim {}; needs f32/bf16, the training kernels and head_dim <= 256); set cuda_graphs = false",
                model.dtype(),
                model.device(),
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim
            );
        }
        Ok(DecodeGraphs {
            block_size,
            width,
            scratch: None,
            pool_generation: 0,
            max_rows: max_rows.max(1).next_power_of_two(),
            #[cfg(feature = "cuda")]
            logits: None,
            buckets: BTreeMap::new(),
            stats: GraphStats::default(),
        })
    }

    /// The decode forward of rows `tables` (already prepared: `slots[r]` is where row `r`'s
    /// token goes, its table's length the tokens before it) feeding `tokens[r]` at position
    /// `positions[r]`: the next-token logits `[rows, vocab]` (the model's dtype), from the padded size's
    /// graph where there is one.
    pub(crate) fn forward(
        &mut self,
        model: &Transformer,
        (tokens, positions): (&[u32], &[usize]),
        (tables, slots): (&[BlockTable], &[u32]),
        pool: &mut BlockPool,
        stacks: &DecodeStacks,
    ) -> Result<Tensor> {
        let rows = tokens.len();
        if positions.len() != rows || tables.len() != rows || slots.len() != rows || rows == 0 {
            bail!(
                "fixed-shape decode: {rows} tokens, {} positions, {} tables, {} slots",
                positions.len(),
                tables.len(),
                slots.len()
            );
        }
        model.check_positions(positions.iter().copied(), "paged decode")?;
        let scratch = match self.scratch {
            Some(s) => s,
            None => *self.scratch.insert(pool.scratch_block()?),
        };
        if pool.generation() != self.pool_generation {
            self.drop_graphs();
            self.pool_generation = pool.generation();
        }
        let n = rows.next_power_of_two();
        if n > self.max_rows {
            bail!(
                "internal: a decode step of {rows} rows, more than the run's {}",
                self.max_rows
            );
        }
        let (w, bs) = (self.width, self.block_size);
        let host = self.host_inputs(n, (tokens, positions), (tables, slots), scratch)?;
        // A replay runs no op's own checks: every slot and block it reaches is checked here.
        let capacity = pool.capacity_blocks();
        let (blocks, step_slots) = (&host[4 * n..], &host[2 * n..3 * n]);
        if blocks.iter().any(|&b| b as usize >= capacity)
            || step_slots.iter().any(|&s| s as usize >= capacity * bs)
        {
            bail!("internal: a decode step reaches past the KV pool's {capacity} blocks");
        }
        let device = model.device();
        let bucket = match self.buckets.entry(n) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(Bucket {
                inputs: Tensor::zeros(n * (4 + w), DType::U32, device)?,
                split_counters: Tensor::zeros(
                    n * model.cfg.num_key_value_heads,
                    DType::U32,
                    device,
                )?,
                #[cfg(feature = "cuda")]
                graph: None,
            }),
        };
        bucket
            .inputs
            .slice_set(&Tensor::new(host.as_slice(), device)?, 0, 0)?;
        self.stats.padded_steps += 1;
        // The host copy of what the step reads: the KV write and the CPU kernel check and read
        // it, the CUDA kernels read the buffer's views.
        let part = |i: usize| host[i * n..(i + 1) * n].to_vec();
        let table_rows: Vec<Vec<u32>> = host[4 * n..].chunks(w).map(<[u32]>::to_vec).collect();
        let lens = part(3).into_iter().map(|l| l as usize).collect();
        let view = |i: usize| bucket.inputs.narrow(0, i * n, n);
        let step = PagedStep {
            slots: KvSlots::with_device(part(2), view(2)?)?,
            layout: PagedLayout::new(bs, table_rows, lens)?.with_device_tables(
                (
                    bucket.inputs.narrow(0, 4 * n, n * w)?.reshape((n, w))?,
                    view(3)?,
                    bucket.split_counters.clone(),
                ),
                w * bs,
            )?,
        };
        let (ids, pos) = (view(0)?, view(1)?);
        let pool: &BlockPool = pool;
        let forward = || model.forward_paged_on(&ids, &pos, pool, &step, stacks);
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = device {
            use anyhow::Context as _;
            if let Some(graph) = &bucket.graph {
                graph
                    .launch()
                    .context("replaying the decode step's CUDA graph")?;
                self.stats.replays += 1;
            } else {
                let all = match &self.logits {
                    Some(l) => l.clone(),
                    None => {
                        let shape = (self.max_rows, model.cfg.vocab_size);
                        let l = Tensor::zeros(shape, model.dtype(), device)?;
                        self.logits.insert(l).clone()
                    }
                };
                let logits = all.narrow(0, 0, n)?;
                let step_into_logits = || -> Result<()> {
                    let _cache = dev.enable_cuda_graph_htod_cache();
                    logits.slice_set(&forward()?, 0, 0)?;
                    Ok(())
                };
                // This step's result, and candle's shape uploads cached for the capture.
                step_into_logits()?;
                bucket.graph = Some(capture(dev, step_into_logits).with_context(|| {
                    format!("capturing the decode step at {n} rows as a CUDA graph (set cuda_graphs = false to decode without)")
                })?);
                self.stats.captures += 1;
            }
            let logits = self.logits.as_ref().expect("set before the first capture");
            return Ok(logits.narrow(0, 0, rows)?);
        }
        Ok(forward()?.narrow(0, 0, rows)?)
    }

    /// The step's inputs for `n` rows as the buffer holds them: the real rows, then padding
    /// rows (token 0 at position 0, writing and reading slot 0 of `scratch`).
    fn host_inputs(
        &self,
        n: usize,
        (tokens, positions): (&[u32], &[usize]),
        (tables, slots): (&[BlockTable], &[u32]),
        scratch: u32,
    ) -> Result<Vec<u32>> {
        let (w, bs) = (self.width, self.block_size);
        let mut host = vec![0u32; n * (4 + w)];
        for (r, t) in tables.iter().enumerate() {
            if t.blocks.len() > w {
                bail!(
                    "internal: a row holds {} KV blocks, more than the {w} its run allows",
                    t.blocks.len()
                );
            }
            host[r] = tokens[r];
            host[n + r] = positions[r] as u32;
            host[2 * n + r] = slots[r];
            host[3 * n + r] = (t.len + 1) as u32;
            let row = &mut host[4 * n + r * w..4 * n + (r + 1) * w];
            row[..t.blocks.len()].copy_from_slice(&t.blocks);
            row[t.blocks.len()..].fill(scratch);
        }
        for r in tables.len()..n {
            host[2 * n + r] = scratch * bs as u32;
            host[3 * n + r] = 1;
            host[4 * n + r * w..4 * n + (r + 1) * w].fill(scratch);
        }
        Ok(host)
    }

    /// Forgets every graph (the pool they read moved); buffers stay.
    fn drop_graphs(&mut self) {
        #[cfg(feature = "cuda")]
        for b in self.buckets.values_mut() {
            b.graph = None;
        }
    }
}

/// Graphs keep the memory of their steps' temporaries in the driver's graph pool, apart from
/// the allocator everything else uses: once the run's graphs are gone it goes back, so the
/// trainer that runs next has it.
#[cfg(feature = "cuda")]
impl Drop for DecodeGraphs {
    fn drop(&mut self) {
        let captured = self.buckets.values().any(|b| b.graph.is_some()) || self.stats.captures > 0;
        let device = self
            .buckets
            .values()
            .next()
            .map(|b| b.inputs.device().clone());
        self.buckets.clear();
        if let (true, Some(candle_core::Device::Cuda(dev))) = (captured, device) {
            let stream = dev.cuda_stream();
            if stream.synchronize().is_ok() {
                // SAFETY: a plain driver call on the context's device; no graph of this run
                // exists any more and the stream is idle.
                unsafe {
                    use candle_core::cuda_backend::cudarc::driver::sys;
                    sys::cuDeviceGraphMemTrim(stream.context().cu_device());
                }
            }
        }
    }
}

/// Records `step` on `dev`'s stream as a CUDA graph (nothing runs), then instantiates it. The
/// capture always ends, also when `step` fails.
#[cfg(feature = "cuda")]
fn capture(
    dev: &candle_core::CudaDevice,
    step: impl FnOnce() -> Result<()>,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaGraph> {
    use anyhow::Context as _;
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = dev.cuda_stream();
    stream.synchronize()?;
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let recorded = step();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    recorded?;
    graph?.context("the capture recorded nothing")
}
