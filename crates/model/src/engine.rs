//! The rollout engine behind [`generate`](crate::generate): continuous batching over the
//! KV-cached forward.
//!
//! Samples wait in a queue (request order, then sample order) and run in one batch of at
//! most [`EngineConfig::max_running`] rows. Each step feeds every running row its last token
//! (one batched forward), admits waiting samples while they fit, and samples the next token of
//! every row. A sample that stops leaves the batch at once and the next waiting one takes its
//! place on the following step, so the batch is never held by its longest completion.
//!
//! The batch's KV cache is one dense left-padded tensor per layer. A waiting sample takes a
//! finished sample's row **in place** when its prompt fits there (right-aligned to the
//! cache's length, with its decode room inside the capacity): only its prompt's K/V are
//! written. Otherwise free rows are dropped and new rows stacked into a rebuilt cache, which
//! then keeps spare room (within the budget) so later finished rows can be reused in place.
//!
//! **Prefix sharing.** The samples of one request share its prompt: the prompt is prefilled
//! once (whatever the number of samples, and even when they are admitted at different steps)
//! and its K/V rows are copied into each sample's row of the batch. The prompt KV of the one
//! request that can be partly admitted (the queue is first in, first out) is held until its
//! last sample is admitted.
//!
//! **Token budget.** [`EngineConfig::kv_token_budget`] bounds the running batch's KV cache:
//! rows × slots per row, padding included (rows are left-padded to a common length and each
//! row's slots are reserved up to its longest possible completion, so the cache never
//! regrows mid-decode). A sample is admitted only when the batch with it still fits; otherwise
//! it waits for running samples to finish. A sample that could not fit even alone is refused
//! before any work.
//!
//! **Chunked prefill.** [`EngineConfig::prefill_chunk`] feeds long prompts in chunks of that
//! many tokens (the cache carries the earlier chunks), bounding the prefill's activations.
//!
//! Outputs do not depend on the schedule beyond rounding: sample `s` of a request always draws
//! from the ChaCha8 stream `(request.seed, s)`, whenever it runs and whoever runs beside it.

use crate::kv_cache::KvCache;
use crate::prefill::{prefill, PrefillCounts};
use crate::prefix_store::PrefixStore;
pub use crate::sampling::EngineConfig;
use crate::sampling::{
    check_requests, empty_samples, next_tokens, Active, GenerationRequest, Sample, SamplingParams,
};
use crate::transformer::Transformer;
use anyhow::{bail, Result};
use candle_core::Tensor;
use serde::Serialize;
use std::collections::VecDeque;

/// The load of one decode step: one token sampled for each running row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StepLoad {
    /// Rows in the batch.
    pub running: usize,
    /// Samples still waiting for admission.
    pub waiting: usize,
    /// KV slots the batch's cache holds (rows × slots per row).
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
    /// Completion tokens sampled.
    pub generated_tokens: usize,
    /// Samples admitted into a finished sample's row in place (no cache rebuild).
    pub rows_reused: usize,
    /// Per step, in order.
    pub steps: Vec<StepLoad>,
}

impl EngineStats {
    /// The largest KV cache the running batch held, in slots.
    pub fn peak_kv_slots(&self) -> usize {
        self.steps.iter().map(|s| s.kv_slots).max().unwrap_or(0)
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

/// The prompt KV of the request whose samples are only partly admitted, and the logits of
/// its first completion token.
struct HeldPrompt {
    request: usize,
    cache: KvCache,
    logits: Tensor,
}

/// Prompt KV kept across admissions: the held prompt, and the caller's store of finished
/// rows whose continuations prefill only their new tokens.
struct PromptKv<'s> {
    held: Option<HeldPrompt>,
    store: Option<&'s mut PrefixStore>,
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
    store: Option<&mut PrefixStore>,
) -> Result<(Vec<Vec<Sample>>, EngineStats)> {
    let stop_ids = check_requests(model, requests, params)?;
    let mut stats = EngineStats::default();
    // A zero token budget asks for nothing: every sample is empty and ends at its length limit
    // (the decode loop below always samples at least one token before checking the limit).
    if params.max_new_tokens == 0 {
        return Ok((empty_samples(requests), stats));
    }
    let cfg = params.engine;
    let max_pos = model.cfg.max_position_embeddings;
    let need = |p: usize| final_slots(p, params.max_new_tokens, max_pos);
    if cfg.kv_token_budget > 0 {
        for (i, r) in requests.iter().enumerate() {
            let n = need(r.prompt_ids.len());
            if r.num_samples > 0 && n > cfg.kv_token_budget {
                bail!(
                    "request {i}: one sample needs {n} KV slots ({} prompt tokens + up to {} completion tokens) but kv_token_budget is {}",
                    r.prompt_ids.len(),
                    n - r.prompt_ids.len(),
                    cfg.kv_token_budget
                );
            }
        }
    }
    let model = model.detached();
    let mut queue: VecDeque<(usize, usize)> = requests
        .iter()
        .enumerate()
        .flat_map(|(i, r)| (0..r.num_samples).map(move |s| (i, s)))
        .collect();
    let mut prompt_kv = PromptKv { held: None, store };
    let mut running: Option<KvCache> = None;
    // One entry per row of `running`: the sample decoding there, or None once it finished
    // (the row waits to be reused in place by a waiting sample, or to be dropped).
    let mut slots: Vec<Option<Active>> = Vec::new();
    // The token each row feeds next (0 for a finished row: its output is ignored).
    let mut pending: Vec<u32> = Vec::new();
    let mut finished: Vec<(usize, usize, Sample)> = Vec::new();
    loop {
        // 1. Feed every row the token it sampled last.
        let mut logits = None;
        if let Some(cache) = running.as_mut() {
            let n = pending.len();
            let input = Tensor::from_vec(std::mem::take(&mut pending), (n, 1), model.device())?;
            logits = Some(model.forward(&input, Some(cache))?.squeeze(1)?);
            stats.decode_forwards += 1;
        }
        // 2a. Waiting samples take finished samples' rows in place while they fit there.
        if let (Some(cache), Some(lg)) = (running.as_mut(), logits.as_mut()) {
            let mut batch = Batch {
                cache,
                logits: lg,
                slots: &mut slots,
            };
            let admit = Admit {
                model: &model,
                requests,
                prefill_chunk: cfg.prefill_chunk,
                need: &need,
            };
            admit.refill_in_place(&mut batch, &mut queue, &mut prompt_kv, &mut stats)?;
        }
        // 2b. Rows still free are dropped.
        if slots.iter().any(Option::is_none) {
            let keep: Vec<usize> = (0..slots.len()).filter(|&b| slots[b].is_some()).collect();
            (running, logits) = match (&running, logits) {
                (Some(c), Some(l)) if !keep.is_empty() => (
                    Some(c.select_rows(&keep)?),
                    Some(l.index_select(&row_index(&keep, &model)?, 0)?),
                ),
                _ => (None, None),
            };
            slots.retain(Option::is_some);
        }
        // 2c. Admit waiting samples as new rows while the batch with them fits.
        let mut prompt_lens: Vec<usize> = slots.iter().flatten().map(|a| a.prompt_len).collect();
        let admit = admission(
            &queue,
            running.as_ref(),
            &prompt_lens,
            requests,
            &cfg,
            &need,
        );
        if admit > 0 {
            let items: Vec<(usize, usize)> = queue.drain(..admit).collect();
            let next_request = queue.front().map(|&(r, _)| r);
            let (rows, row_logits) = Admit {
                model: &model,
                requests,
                prefill_chunk: cfg.prefill_chunk,
                need: &need,
            }
            .admit_rows(&items, next_request, &mut prompt_kv, &mut stats)?;
            slots.extend(
                items
                    .iter()
                    .map(|&(r, s)| Some(Active::new(r, &requests[r], s))),
            );
            prompt_lens.extend(items.iter().map(|&(r, _)| requests[r].prompt_ids.len()));
            let parts: Vec<&KvCache> = running.iter().chain(std::iter::once(&rows)).collect();
            let (longest, room) = batch_shape(&parts, &prompt_lens, &need);
            // While samples wait, spare room lets finished rows be reused in place later
            // (within the budget); the batch needs `longest + room` slots per row.
            let mut capacity = longest + room;
            if !queue.is_empty() {
                capacity += room;
                if cfg.kv_token_budget > 0 {
                    capacity = capacity.min(cfg.kv_token_budget / slots.len());
                }
                capacity = capacity.max(longest + room);
            }
            let merged = KvCache::concat_rows(&parts, capacity)?;
            running = Some(merged);
            logits = Some(match logits {
                Some(l) => Tensor::cat(&[&l, &row_logits], 0)?,
                None => row_logits,
            });
        }
        let (Some(logits), Some(cache)) = (logits, running.as_ref()) else {
            break;
        };
        stats.steps.push(StepLoad {
            running: slots.len(),
            waiting: queue.len(),
            kv_slots: cache.batch_size() * cache.capacity(),
        });
        // 3. Sample every row; a finished sample frees its row.
        let mut active: Vec<Active> = slots
            .iter_mut()
            .map(|s| s.take().expect("every row is live after step 2"))
            .collect();
        let (tokens, token_logprobs) = next_tokens(&logits, params, &mut active)?;
        stats.generated_tokens += tokens.len();
        pending = tokens.clone();
        for (row, mut a) in active.into_iter().enumerate() {
            let done = a.push(
                tokens[row],
                token_logprobs[row],
                &stop_ids,
                params.max_new_tokens,
                max_pos,
            );
            match done {
                Some(sample) => {
                    if let Some(store) = prompt_kv.store.as_deref_mut() {
                        // Keep the tokens it fed: its prompt and all but the last sampled.
                        let fed = sample.completion_ids.len() - 1;
                        let mut tokens = requests[a.request].prompt_ids.clone();
                        tokens.extend_from_slice(&sample.completion_ids[..fed]);
                        store.insert(tokens, cache.row(row)?);
                    }
                    finished.push((a.request, a.sample, sample));
                    pending[row] = 0;
                }
                None => slots[row] = Some(a),
            }
        }
        // Free rows are dropped at once when no waiting sample can reuse them.
        if slots.iter().any(Option::is_none)
            && (queue.is_empty() || slots.iter().all(Option::is_none))
        {
            let keep: Vec<usize> = (0..slots.len()).filter(|&b| slots[b].is_some()).collect();
            running = if keep.is_empty() {
                None
            } else {
                Some(cache.select_rows(&keep)?)
            };
            pending = keep.iter().map(|&b| pending[b]).collect();
            slots.retain(Option::is_some);
        }
    }
    debug_assert!(queue.is_empty() && slots.is_empty());
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

/// The shape of a batch stacking `parts` (rows left-aligned) for samples with prompt lengths
/// `prompt_lens` (in row order): `(longest stored row, most decode room any row still needs)`;
/// it needs `longest + room` slots per row.
fn batch_shape(
    parts: &[&KvCache],
    prompt_lens: &[usize],
    need: &dyn Fn(usize) -> usize,
) -> (usize, usize) {
    let stored: Vec<usize> = parts
        .iter()
        .flat_map(|p| (0..p.batch_size()).map(move |b| p.seq_len(b)))
        .collect();
    let longest = stored.iter().copied().max().unwrap_or(0);
    let room = stored
        .iter()
        .zip(prompt_lens)
        .map(|(&s, &p)| need(p).saturating_sub(s))
        .max()
        .unwrap_or(0);
    (longest, room)
}

/// How many samples at the front of `queue` join the batch now: first in, first out, each
/// only if the batch with it stays within `max_running` rows and `kv_token_budget` slots.
fn admission(
    queue: &VecDeque<(usize, usize)>,
    running: Option<&KvCache>,
    prompt_lens: &[usize],
    requests: &[GenerationRequest],
    cfg: &EngineConfig,
    need: &dyn Fn(usize) -> usize,
) -> usize {
    // The running rows: count, longest stored row, most decode room still needed.
    let (mut rows, mut longest, mut room) = match running {
        Some(c) => {
            let (longest, room) = batch_shape(&[c], prompt_lens, need);
            (c.batch_size(), longest, room)
        }
        None => (0, 0, 0),
    };
    let mut admitted = 0;
    for &(r, _) in queue {
        let p = requests[r].prompt_ids.len();
        let (n_rows, n_longest, n_room) = (rows + 1, longest.max(p), room.max(need(p) - p));
        let over_rows = cfg.max_running > 0 && n_rows > cfg.max_running;
        let over_budget =
            cfg.kv_token_budget > 0 && n_rows * (n_longest + n_room) > cfg.kv_token_budget;
        if over_rows || over_budget {
            break;
        }
        (rows, longest, room) = (n_rows, n_longest, n_room);
        admitted += 1;
    }
    admitted
}

/// What admitting samples needs: the model, the requests, the prefill chunk size and the KV
/// slots a row needs by its end.
struct Admit<'a> {
    model: &'a Transformer,
    requests: &'a [GenerationRequest],
    prefill_chunk: usize,
    need: &'a dyn Fn(usize) -> usize,
}

/// The running batch as step 2a changes it: its cache, next-token logits and samples per row.
struct Batch<'a> {
    cache: &'a mut KvCache,
    logits: &'a mut Tensor,
    slots: &'a mut [Option<Active>],
}

impl Admit<'_> {
    /// Samples at the front of `queue` take the free rows (`slots[b]` None) of the batch in
    /// place, first in, first out, while each fits there: its prompt right-aligned to the
    /// cache's length and its decode room within the capacity. Only the prompts' K/V are
    /// written; the batch's row count and capacity (its memory) do not change.
    fn refill_in_place(
        &self,
        batch: &mut Batch,
        queue: &mut VecDeque<(usize, usize)>,
        prompt_kv: &mut PromptKv,
        stats: &mut EngineStats,
    ) -> Result<()> {
        let free: Vec<usize> = (0..batch.slots.len())
            .filter(|&b| batch.slots[b].is_none())
            .collect();
        let (len, capacity) = (batch.cache.len(), batch.cache.capacity());
        let n = queue
            .iter()
            .take(free.len())
            .take_while(|&&(r, _)| {
                let p = self.requests[r].prompt_ids.len();
                p <= len && len - p + (self.need)(p) <= capacity
            })
            .count();
        if n == 0 {
            return Ok(());
        }
        let items: Vec<(usize, usize)> = queue.drain(..n).collect();
        let next_request = queue.front().map(|&(r, _)| r);
        let (rows, row_logits) = self.admit_rows(&items, next_request, prompt_kv, stats)?;
        let b = batch.slots.len();
        let mut index: Vec<u32> = (0..b as u32).collect();
        for (i, (&row, &(r, s))) in free.iter().zip(&items).enumerate() {
            batch.cache.overwrite_row(row, &rows, i)?;
            batch.slots[row] = Some(Active::new(r, &self.requests[r], s));
            index[row] = (b + i) as u32;
        }
        stats.rows_reused += n;
        let both = Tensor::cat(&[&*batch.logits, &row_logits], 0)?;
        *batch.logits = both.index_select(&Tensor::new(index, both.device())?, 0)?;
        Ok(())
    }

    /// The K/V rows and next-token logits `[items, V]` of newly admitted samples `items`: the
    /// prompts not yet prefilled are prefilled once (one left-padded batch), and each sample's row
    /// is a copy of its prompt's. When the last request of `items` has more samples waiting
    /// (`next_request` is the same request), its prompt is held for them.
    fn admit_rows(
        &self,
        items: &[(usize, usize)],
        next_request: Option<usize>,
        prompt_kv: &mut PromptKv,
        stats: &mut EngineStats,
    ) -> Result<(KvCache, Tensor)> {
        let (model, requests) = (self.model, self.requests);
        let mut distinct: Vec<usize> = items.iter().map(|&(r, _)| r).collect();
        distinct.dedup();
        let reuse = prompt_kv
            .held
            .take()
            .filter(|h| distinct.first() == Some(&h.request));
        let fresh_requests: Vec<usize> = distinct
            .iter()
            .copied()
            .filter(|&r| reuse.as_ref().map(|h| h.request) != Some(r))
            .collect();
        let fresh = if fresh_requests.is_empty() {
            None
        } else {
            let prompts: Vec<&[u32]> = fresh_requests
                .iter()
                .map(|&r| requests[r].prompt_ids.as_slice())
                .collect();
            let mut counts = PrefillCounts::default();
            let prefilled = prefill(
                model,
                &prompts,
                self.prefill_chunk,
                prompt_kv.store.as_deref_mut(),
                &mut counts,
            )?;
            stats.prefill_tokens += counts.tokens;
            stats.prefill_forwards += counts.forwards;
            Some(prefilled)
        };
        // Source rows: the held prompt first (it is the queue's front request), then fresh rows.
        let mut held_rows = Vec::new();
        let mut fresh_rows = Vec::new();
        for &(r, _) in items {
            match fresh_requests.iter().position(|&f| f == r) {
                Some(row) => fresh_rows.push(row),
                None => held_rows.push(0),
            }
        }
        let mut caches = Vec::new();
        let mut logits = Vec::new();
        if let Some(h) = &reuse {
            caches.push(h.cache.select_rows(&held_rows)?);
            logits.push(h.logits.index_select(&row_index(&held_rows, model)?, 0)?);
        }
        if let Some((cache, lg)) = &fresh {
            caches.push(cache.select_rows(&fresh_rows)?);
            logits.push(lg.index_select(&row_index(&fresh_rows, model)?, 0)?);
        }
        // Hold the last request's prompt when more of its samples wait.
        let last = *distinct.last().expect("items is non-empty");
        if next_request == Some(last) {
            prompt_kv.held = Some(match (fresh_requests.last(), &fresh, reuse) {
                (Some(&r), Some((cache, lg)), _) if r == last => {
                    let row = fresh_requests.len() - 1;
                    HeldPrompt {
                        request: last,
                        cache: cache.select_rows(&[row])?,
                        logits: lg.narrow(0, row, 1)?,
                    }
                }
                (_, _, Some(h)) => h,
                _ => bail!("internal: the prompt of request {last} was neither prefilled nor held"),
            });
        }
        let parts: Vec<&KvCache> = caches.iter().collect();
        let longest = parts.iter().map(|c| c.len()).max().unwrap_or(0);
        Ok((
            KvCache::concat_rows(&parts, longest)?,
            Tensor::cat(&logits, 0)?,
        ))
    }
}

fn row_index(rows: &[usize], model: &Transformer) -> Result<Tensor> {
    let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    Ok(Tensor::new(idx, model.device())?)
}
