//! The rollout engine behind [`generate`](crate::generate): continuous batching over a paged
//! KV cache.
//!
//! Samples wait in a queue (request order, then sample order) and run in one batch of at
//! most [`EngineConfig::max_running`] rows. Each step feeds every running row its last token
//! (one batched forward), admits waiting samples while they fit, and samples the next token of
//! every row. A sample that stops leaves the batch at once and the next waiting one takes its
//! place on the following step, so the batch is never held by its longest completion.
//!
//! **Paged KV.** The running samples' keys and values live in a block pool per layer
//! (`crate::paged_kv`), [`EngineConfig::kv_block_size`] token slots per block; each sample
//! has a block table and a length. A decode step writes each row's new token into its slot
//! and attends over the row's blocks in place ([`crate::ops::paged_decode_attention`]): rows
//! of different lengths need no padding, and admitting or dropping a row copies nothing.
//!
//! **Prefix sharing.** The samples of one request share its prompt: the prompt is prefilled
//! once (whatever the number of samples, and even when they are admitted at different steps),
//! written into blocks once, and every sample's table points at those blocks. A sample's
//! first token copies the prompt's partly filled last block (copy on write; the last sample
//! to write takes the block itself), so G samples hold the prompt's full blocks once, not G
//! times. The prompt of the one request that can be partly admitted (the queue is first in,
//! first out) is held until its last sample is admitted.
//!
//! **Token budget.** [`EngineConfig::kv_token_budget`] bounds the blocks held (× block
//! size): a request's shared prompt blocks once, and each sample's own blocks up to its
//! longest possible completion (reserved at admission, so a running sample never waits for
//! a block). A sample is admitted only when the batch with it still fits; otherwise it waits
//! for running samples to finish. A sample that could not fit even alone is refused before
//! any work.
//!
//! **Chunked prefill.** [`EngineConfig::prefill_chunk`] feeds long prompts in chunks of that
//! many tokens, bounding the prefill's activations. Prefill runs on a dense left-padded
//! [`KvCache`](crate::KvCache) (as do scoring and the [`PrefixStore`]); the prompts' rows are
//! then written into blocks.
//!
//! Outputs do not depend on the schedule beyond rounding: sample `s` of a request always draws
//! from the ChaCha8 stream `(request.seed, s)`, whenever it runs and whoever runs beside it.

use crate::decode_graph::{DecodeGraphs, GraphStats};
use crate::paged_kv::{BlockPool, BlockTable};
use crate::prefill::{prefill, PrefillCounts};
use crate::prefix_store::PrefixStore;
pub use crate::sampling::EngineConfig;
use crate::sampling::{
    check_requests, empty_samples, next_tokens_on_device, Active, GenerationRequest, Sample,
    SamplingParams,
};
use crate::transformer::Transformer;
use anyhow::{bail, Result};
use candle_core::Tensor;
use serde::Serialize;
use std::collections::{BTreeSet, VecDeque};

/// The load of one decode step: one token sampled for each running row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StepLoad {
    /// Rows in the batch.
    pub running: usize,
    /// Samples still waiting for admission.
    pub waiting: usize,
    /// KV blocks held (a block shared by several samples counted once).
    pub kv_blocks: usize,
    /// KV blocks the rows' tables (and a held prompt's) point at, a shared block once per
    /// table: what the rows would hold without prefix sharing.
    pub kv_block_refs: usize,
    /// KV slots held: `kv_blocks` × block size.
    pub kv_slots: usize,
}

/// What one engine run did (tests and benchmarks read it).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EngineStats {
    /// Real prompt tokens fed by prefill forwards (padding not counted).
    pub prefill_tokens: usize,
    /// Prefill forwards (one per chunk of each admission's prompts).
    pub prefill_forwards: usize,
    /// Batched one-token decode forwards.
    pub decode_forwards: usize,
    /// Of those, the ones whose layers ran their norms and residual adds inside the skinny
    /// decode products (`COMPOSER_DECODE_GEMM=1`, at most 64 rows).
    pub decode_forwards_norms_in_products: usize,
    /// Completion tokens sampled.
    pub generated_tokens: usize,
    /// Token slots per KV block.
    pub kv_block_size: usize,
    /// Blocks the pool allocated by the end (its memory; freed blocks are reused first).
    pub kv_pool_blocks: usize,
    /// Shared blocks copied on write (a prompt's partly filled last block).
    pub kv_block_copies: usize,
    /// The fixed-shape decode's steps, captures and replays (`cuda_graphs`).
    pub graphs: GraphStats,
    /// Per step, in order.
    pub steps: Vec<StepLoad>,
}

impl EngineStats {
    /// The most KV slots the running batch held (blocks × block size).
    pub fn peak_kv_slots(&self) -> usize {
        self.steps.iter().map(|s| s.kv_slots).max().unwrap_or(0)
    }
    /// The most KV blocks held at once.
    pub fn peak_kv_blocks(&self) -> usize {
        self.steps.iter().map(|s| s.kv_blocks).max().unwrap_or(0)
    }
    /// The most block references at once (the blocks held without prefix sharing).
    pub fn peak_kv_block_refs(&self) -> usize {
        self.steps
            .iter()
            .map(|s| s.kv_block_refs)
            .max()
            .unwrap_or(0)
    }
    /// The most rows that ran together.
    pub fn peak_running(&self) -> usize {
        self.steps.iter().map(|s| s.running).max().unwrap_or(0)
    }
}

/// KV slots a row needs by its end: its prompt and every completion token but the last (the
/// last is sampled, never fed); a sample also stops at the model's position limit.
fn final_slots(prompt_len: usize, max_new_tokens: usize, max_pos: usize) -> usize {
    prompt_len.max((prompt_len + max_new_tokens).min(max_pos) - 1)
}

/// The budget's block arithmetic for prompts of `p` tokens.
struct BlockCosts<'a> {
    block_size: usize,
    need: &'a dyn Fn(usize) -> usize,
}

impl BlockCosts<'_> {
    /// The prompt's full blocks, held once for all its samples.
    fn shared(&self, p: usize) -> usize {
        p / self.block_size
    }
    /// One sample's own blocks by its end: its copy of the prompt's partly filled last block
    /// and its completion's blocks.
    fn own(&self, p: usize) -> usize {
        (self.need)(p).div_ceil(self.block_size) - p / self.block_size
    }
    /// The prompt's partly filled last block, held apart from the samples' copies while the
    /// prompt waits for more of its samples.
    fn held_partial(&self, p: usize) -> usize {
        usize::from(!p.is_multiple_of(self.block_size))
    }
}

/// A prompt written into blocks and the logits of its first completion token `[1, V]`.
struct PromptBlocks {
    request: usize,
    table: BlockTable,
    logits: Tensor,
}

/// The running batch: per row, its sample, KV blocks and the token it feeds next.
#[derive(Default)]
struct Running {
    active: Vec<Active>,
    tables: Vec<BlockTable>,
    pending: Vec<u32>,
}

/// As [`generate`](crate::generate) (not deterministic mode), also returning what the engine
/// did.
pub fn generate_with_stats(
    model: &Transformer,
    requests: &[GenerationRequest],
    params: &SamplingParams,
) -> Result<(Vec<Vec<Sample>>, EngineStats)> {
    generate_with_store(model, requests, params, None)
}

/// As [`generate_with_stats`], with a [`PrefixStore`]: a prompt that starts with a stored
/// row's tokens (a finished sample of an earlier call, e.g. the previous turn of a multi-turn
/// episode) prefills only the tokens after them, and every finished sample's row is stored
/// for its continuation.
pub fn generate_with_store(
    model: &Transformer,
    requests: &[GenerationRequest],
    params: &SamplingParams,
    mut store: Option<&mut PrefixStore>,
) -> Result<(Vec<Vec<Sample>>, EngineStats)> {
    let stop_ids = check_requests(model, requests, params)?;
    let cfg = params.engine;
    let bs = cfg.kv_block_size;
    if bs == 0 {
        bail!("kv_block_size must be >= 1 (token slots per KV block), got 0");
    }
    let mut stats = EngineStats {
        kv_block_size: bs,
        ..Default::default()
    };
    // A zero token budget asks for nothing: every sample is empty and ends at its length limit
    // (the decode loop below always samples at least one token before checking the limit).
    if params.max_new_tokens == 0 {
        return Ok((empty_samples(requests), stats));
    }
    let max_pos = model.cfg.max_position_embeddings;
    let need = |p: usize| final_slots(p, params.max_new_tokens, max_pos);
    let costs = BlockCosts {
        block_size: bs,
        need: &need,
    };
    let budget_blocks = cfg.kv_token_budget / bs;
    if cfg.kv_token_budget > 0 {
        for (i, r) in requests.iter().enumerate() {
            let p = r.prompt_ids.len();
            // Alone: its prompt's blocks (the partial one kept apart while the prompt is held
            // for its other samples) and its own.
            let held = if r.num_samples > 1 {
                costs.held_partial(p)
            } else {
                0
            };
            let blocks = costs.shared(p) + costs.own(p) + held;
            if r.num_samples > 0 && blocks > budget_blocks {
                bail!(
                    "request {i}: one sample needs {} KV slots ({p} prompt tokens + up to {} completion tokens, in blocks of {bs}) but kv_token_budget is {}",
                    blocks * bs,
                    need(p) - p,
                    cfg.kv_token_budget
                );
            }
        }
    }
    let model = model.detached();
    let stacks = model.stack_for_decode()?;
    let mut graphs = if cfg.cuda_graphs {
        let longest = requests.iter().map(|r| need(r.prompt_ids.len())).max();
        let samples: usize = requests.iter().map(|r| r.num_samples).sum();
        let rows = match cfg.max_running {
            0 => samples,
            m => m.min(samples),
        };
        Some(DecodeGraphs::new(&model, bs, longest.unwrap_or(1), rows)?)
    } else {
        None
    };
    let mut pool = BlockPool::new(&model, bs, budget_blocks)?;
    let mut queue: VecDeque<(usize, usize)> = requests
        .iter()
        .enumerate()
        .flat_map(|(i, r)| (0..r.num_samples).map(move |s| (i, s)))
        .collect();
    let mut held: Option<PromptBlocks> = None;
    let mut batch = Running::default();
    let mut finished: Vec<(usize, usize, Sample)> = Vec::new();
    let admit = Admit {
        model: &model,
        requests,
        cfg: &cfg,
        costs: &costs,
    };
    loop {
        // 1. Feed every row the token it sampled last.
        let mut logits = None;
        if !batch.active.is_empty() {
            let positions: Vec<usize> = batch.tables.iter().map(|t| t.len).collect();
            logits = Some(match graphs.as_mut() {
                Some(g) => {
                    let slots = pool.prepare_appends(&mut batch.tables)?;
                    let rows = (batch.pending.as_slice(), positions.as_slice());
                    g.forward(&model, rows, (&batch.tables, &slots), &mut pool, &stacks)?
                }
                None => {
                    let step = pool.prepare_step(&mut batch.tables)?;
                    model.forward_paged(&batch.pending, &positions, &pool, &step, &stacks)?
                }
            });
            batch.tables.iter_mut().for_each(|t| t.len += 1);
            stats.decode_forwards += 1;
            if stacks.norms_in_products(batch.active.len()) {
                stats.decode_forwards_norms_in_products += 1;
            }
        }
        // 2. Admit waiting samples while the batch with them fits.
        let n = admit.admission(&queue, &batch, held.as_ref());
        if n > 0 {
            let items: Vec<(usize, usize)> = queue.drain(..n).collect();
            let next_request = queue.front().map(|&(r, _)| r);
            let row_logits = admit.admit_rows(
                &items,
                next_request,
                (&mut pool, &mut held),
                &mut batch,
                store.as_deref_mut(),
                &mut stats,
            )?;
            logits = Some(match logits {
                // The decode step's are in the model's dtype, the prefill's in f32 made from
                // it: narrowing those back is exact.
                Some(l) => Tensor::cat(&[&l, &row_logits.to_dtype(l.dtype())?], 0)?,
                None => row_logits,
            });
        }
        let Some(logits) = logits else {
            break;
        };
        let held_refs = held.as_ref().map_or(0, |h| h.table.blocks.len());
        stats.steps.push(StepLoad {
            running: batch.active.len(),
            waiting: queue.len(),
            kv_blocks: pool.held_blocks(),
            kv_block_refs: batch.tables.iter().map(|t| t.blocks.len()).sum::<usize>() + held_refs,
            kv_slots: pool.held_blocks() * bs,
        });
        // 3. Sample every row; a finished sample frees its blocks.
        let (tokens, token_logprobs) = next_tokens_on_device(&logits, params, &mut batch.active)?;
        stats.generated_tokens += tokens.len();
        let rows = std::mem::take(&mut batch);
        for ((mut a, table), (&token, &logprob)) in rows
            .active
            .into_iter()
            .zip(rows.tables)
            .zip(tokens.iter().zip(&token_logprobs))
        {
            match a.push(token, logprob, &stop_ids, params.max_new_tokens, max_pos) {
                Some(sample) => {
                    if let Some(store) = store.as_deref_mut() {
                        // Keep the tokens it fed: its prompt and all but the last sampled.
                        let fed = sample.completion_ids.len() - 1;
                        let mut tokens = requests[a.request].prompt_ids.clone();
                        tokens.extend_from_slice(&sample.completion_ids[..fed]);
                        store.insert(tokens, pool.gather(&table)?);
                    }
                    pool.release(table);
                    finished.push((a.request, a.sample, sample));
                }
                None => {
                    batch.active.push(a);
                    batch.tables.push(table);
                    batch.pending.push(token);
                }
            }
        }
    }
    // Admission always takes the queue's front sample into an empty batch (the budget was
    // checked against one sample alone above), so the loop ends only with the queue empty.
    if !queue.is_empty() {
        bail!(
            "internal: {} samples were never admitted into an empty batch",
            queue.len()
        );
    }
    debug_assert!(batch.active.is_empty() && held.is_none());
    stats.kv_pool_blocks = pool.capacity_blocks();
    stats.graphs = graphs.map(|g| g.stats).unwrap_or_default();
    stats.kv_block_copies = pool.copies;
    // Samples finish in any order; put them back in sample-index order per request.
    finished.sort_by_key(|(r, s, _)| (*r, *s));
    let mut results: Vec<Vec<Sample>> = requests
        .iter()
        .map(|r| Vec::with_capacity(r.num_samples))
        .collect();
    for (req, _, sample) in finished {
        results[req].push(sample);
    }
    Ok((results, stats))
}

/// What admitting samples needs: the model, the requests, the scheduler knobs and the
/// budget's block arithmetic.
struct Admit<'a> {
    model: &'a Transformer,
    requests: &'a [GenerationRequest],
    cfg: &'a EngineConfig,
    costs: &'a BlockCosts<'a>,
}

impl Admit<'_> {
    /// How many samples at the front of `queue` join the batch now: first in, first out, each
    /// only if the batch with it stays within `max_running` rows and the blocks reserved
    /// (every live prompt's shared blocks, every sample's own blocks by its end, and the held
    /// prompt's partial block) within `kv_token_budget`.
    fn admission(
        &self,
        queue: &VecDeque<(usize, usize)>,
        batch: &Running,
        held: Option<&PromptBlocks>,
    ) -> usize {
        let (cfg, costs) = (self.cfg, self.costs);
        let plen = |r: usize| self.requests[r].prompt_ids.len();
        let budget = cfg.kv_token_budget / costs.block_size;
        let mut live: BTreeSet<usize> = batch.active.iter().map(|a| a.request).collect();
        live.extend(held.map(|h| h.request));
        let mut shared: usize = live.iter().map(|&r| costs.shared(plen(r))).sum();
        let mut own: usize = batch.active.iter().map(|a| costs.own(a.prompt_len)).sum();
        let mut rows = batch.active.len();
        let mut admitted = 0;
        for (i, &(r, _)) in queue.iter().enumerate() {
            let p = plen(r);
            let n_shared = shared
                + if live.contains(&r) {
                    0
                } else {
                    costs.shared(p)
                };
            let n_own = own + costs.own(p);
            let held_after = queue.get(i + 1).is_some_and(|&(q, _)| q == r);
            let partial = if held_after { costs.held_partial(p) } else { 0 };
            let over_rows = cfg.max_running > 0 && rows + 1 > cfg.max_running;
            let over_budget = cfg.kv_token_budget > 0 && n_shared + n_own + partial > budget;
            if over_rows || over_budget {
                break;
            }
            live.insert(r);
            (shared, own, rows) = (n_shared, n_own, rows + 1);
            admitted += 1;
        }
        admitted
    }

    /// Adds newly admitted samples `items` to `batch` and returns their next-token logits
    /// `[items, V]`: the prompts not yet in blocks are prefilled once (one left-padded batch)
    /// and written into blocks, and each sample's table shares its prompt's blocks. When the
    /// last request of `items` has more samples waiting (`next_request` is the same request),
    /// its prompt is held for them; other prompts' own hold on their blocks is dropped.
    fn admit_rows(
        &self,
        items: &[(usize, usize)],
        next_request: Option<usize>,
        (pool, held): (&mut BlockPool, &mut Option<PromptBlocks>),
        batch: &mut Running,
        store: Option<&mut PrefixStore>,
        stats: &mut EngineStats,
    ) -> Result<Tensor> {
        let requests = self.requests;
        let mut distinct: Vec<usize> = items.iter().map(|&(r, _)| r).collect();
        distinct.dedup();
        // The held prompt is the queue's front request, so the first of `items`.
        let mut prompts: Vec<PromptBlocks> = Vec::with_capacity(distinct.len());
        if let Some(h) = held.take() {
            if distinct.first() == Some(&h.request) {
                prompts.push(h);
            } else {
                pool.release(h.table);
            }
        }
        let fresh: Vec<usize> = distinct
            .iter()
            .copied()
            .filter(|&r| prompts.first().map(|h| h.request) != Some(r))
            .collect();
        if !fresh.is_empty() {
            let ids: Vec<&[u32]> = fresh
                .iter()
                .map(|&r| requests[r].prompt_ids.as_slice())
                .collect();
            let mut counts = PrefillCounts::default();
            let prefilled = prefill(self.model, &ids, self.cfg.prefill_chunk, store, &mut counts)?;
            stats.prefill_tokens += counts.tokens;
            stats.prefill_forwards += counts.forwards;
            // Each cache's rows written into blocks together (a copy, a gather and a write per
            // layer, not per row).
            let mut tables: Vec<Option<BlockTable>> = fresh.iter().map(|_| None).collect();
            for (cache, members) in prefilled.groups() {
                let rows: Vec<usize> = members.iter().map(|&(_, row)| row).collect();
                for (&(i, _), table) in members.iter().zip(pool.write_prompts(cache, &rows)?) {
                    tables[i] = Some(table);
                }
            }
            for (i, (&r, table)) in fresh.iter().zip(tables).enumerate() {
                let Some(table) = table else {
                    bail!("internal: prompt {i} of the prefill has no cache");
                };
                prompts.push(PromptBlocks {
                    request: r,
                    table,
                    logits: prefilled.logits.narrow(0, i, 1)?,
                });
            }
        }
        let mut logits = Vec::with_capacity(items.len());
        for &(r, s) in items {
            let Some(prompt) = prompts.iter().find(|p| p.request == r) else {
                bail!("internal: the prompt of request {r} was neither prefilled nor held");
            };
            batch.tables.push(pool.share(&prompt.table));
            batch.active.push(Active::new(r, &requests[r], s));
            // Its first token is sampled from these logits: nothing to feed yet.
            batch.pending.push(0);
            logits.push(prompt.logits.clone());
        }
        let last = *distinct.last().expect("items is non-empty");
        for p in prompts {
            if p.request == last && next_request == Some(last) {
                *held = Some(p);
            } else {
                pool.release(p.table);
            }
        }
        Ok(Tensor::cat(&logits, 0)?)
    }
}
