//! The rollout engine behind [`generate`](crate::generate): continuous batching over the
//! KV-cached forward.
//!
//! Samples wait in a queue (request order, then sample order) and run in one batch of at
//! most [`EngineConfig::max_running`] rows. Each step feeds every running row its last token
//! (one batched forward), admits waiting samples while they fit, and samples the next token of
//! every row. A sample that stops leaves the batch at once and the next waiting one takes its
//! place on the following step, so the batch is never held by its longest completion.
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
use crate::rollout::{
    check_requests, empty_samples, next_tokens, Active, GenerationRequest, Sample, SamplingParams,
};
use crate::transformer::Transformer;
use anyhow::{bail, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Scheduler knobs of the rollout engine (0 = no limit, everywhere).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Most samples decoding at once.
    pub max_running: usize,
    /// Most KV slots the running batch may hold: rows × slots per row, padding and the
    /// reserved decode room included. Memory: slots × layers × 2 × kv_heads × head_dim
    /// elements.
    pub kv_token_budget: usize,
    /// Prompt tokens per prefill forward (long prompts are prefilled in chunks).
    pub prefill_chunk: usize,
}

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

/// As [`generate`](crate::generate) (not deterministic mode), also returning what the engine
/// did.
pub fn generate_with_stats(
    model: &Transformer,
    requests: &[GenerationRequest],
    params: &SamplingParams,
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
    let mut held: Option<HeldPrompt> = None;
    let mut running: Option<KvCache> = None;
    let mut active: Vec<Active> = Vec::new();
    let mut pending: Vec<u32> = Vec::new();
    let mut finished: Vec<(usize, usize, Sample)> = Vec::new();
    loop {
        // 1. Feed every running row the token it sampled last.
        let mut logits = None;
        if let Some(cache) = running.as_mut() {
            let n = pending.len();
            let input = Tensor::from_vec(std::mem::take(&mut pending), (n, 1), model.device())?;
            logits = Some(model.forward(&input, Some(cache))?.squeeze(1)?);
            stats.decode_forwards += 1;
        }
        // 2. Admit waiting samples while the batch with them fits.
        let admit = admission(&queue, running.as_ref(), &active, requests, &cfg, &need);
        if admit > 0 {
            let items: Vec<(usize, usize)> = queue.drain(..admit).collect();
            let next_request = queue.front().map(|&(r, _)| r);
            let (rows, row_logits) = admit_rows(
                &model,
                requests,
                &items,
                next_request,
                &mut held,
                cfg.prefill_chunk,
                &mut stats,
            )?;
            active.extend(items.iter().map(|&(r, s)| Active::new(r, &requests[r], s)));
            let parts: Vec<&KvCache> = running.iter().chain(std::iter::once(&rows)).collect();
            let capacity = batch_capacity(&parts, &active, &need);
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
            running: active.len(),
            waiting: queue.len(),
            kv_slots: cache.batch_size() * cache.capacity(),
        });
        // 3. Sample every row; finished samples leave the batch.
        let (tokens, token_logprobs) = next_tokens(&logits, params, &mut active)?;
        stats.generated_tokens += tokens.len();
        let mut keep = Vec::with_capacity(active.len());
        let mut still = Vec::with_capacity(active.len());
        for (row, mut a) in active.drain(..).enumerate() {
            let done = a.push(
                tokens[row],
                token_logprobs[row],
                &stop_ids,
                params.max_new_tokens,
                max_pos,
            );
            match done {
                Some(sample) => finished.push((a.request, a.sample, sample)),
                None => {
                    pending.push(tokens[row]);
                    keep.push(row);
                    still.push(a);
                }
            }
        }
        active = still;
        if keep.len() != cache.batch_size() {
            running = if keep.is_empty() {
                None
            } else {
                Some(cache.select_rows(&keep)?)
            };
        }
    }
    debug_assert!(queue.is_empty() && active.is_empty());
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

/// Slots per row of a batch stacking `parts` (rows left-aligned) for the samples `active`
/// (in row order): the longest stored row plus the most decode room any row still needs.
fn batch_capacity(parts: &[&KvCache], active: &[Active], need: &dyn Fn(usize) -> usize) -> usize {
    let stored: Vec<usize> = parts
        .iter()
        .flat_map(|p| (0..p.batch_size()).map(move |b| p.seq_len(b)))
        .collect();
    let longest = stored.iter().copied().max().unwrap_or(0);
    let room = stored
        .iter()
        .zip(active)
        .map(|(&s, a)| need(a.prompt_len).saturating_sub(s))
        .max()
        .unwrap_or(0);
    longest + room
}

/// How many samples at the front of `queue` join the batch now: first in, first out, each
/// only if the batch with it stays within `max_running` rows and `kv_token_budget` slots.
fn admission(
    queue: &VecDeque<(usize, usize)>,
    running: Option<&KvCache>,
    active: &[Active],
    requests: &[GenerationRequest],
    cfg: &EngineConfig,
    need: &dyn Fn(usize) -> usize,
) -> usize {
    // The running rows: count, longest stored row, most decode room still needed (the same
    // sizing as `batch_capacity`).
    let (mut rows, mut longest, mut room) = match running {
        Some(c) => {
            let longest = (0..c.batch_size()).map(|b| c.seq_len(b)).max().unwrap_or(0);
            let room = (0..c.batch_size())
                .zip(active)
                .map(|(b, a)| need(a.prompt_len).saturating_sub(c.seq_len(b)))
                .max()
                .unwrap_or(0);
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

/// The K/V rows and next-token logits `[items, V]` of newly admitted samples `items`: the
/// prompts not yet prefilled are prefilled once (one left-padded batch), and each sample's row
/// is a copy of its prompt's. When the last request of `items` has more samples waiting
/// (`next_request` is the same request), its prompt is held for them.
fn admit_rows(
    model: &Transformer,
    requests: &[GenerationRequest],
    items: &[(usize, usize)],
    next_request: Option<usize>,
    held: &mut Option<HeldPrompt>,
    prefill_chunk: usize,
    stats: &mut EngineStats,
) -> Result<(KvCache, Tensor)> {
    let mut distinct: Vec<usize> = items.iter().map(|&(r, _)| r).collect();
    distinct.dedup();
    let reuse = held.take().filter(|h| distinct.first() == Some(&h.request));
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
        Some(prefill(model, &prompts, prefill_chunk, stats)?)
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
        *held = Some(match (fresh_requests.last(), &fresh, reuse) {
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

fn row_index(rows: &[usize], model: &Transformer) -> Result<Tensor> {
    let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    Ok(Tensor::new(idx, model.device())?)
}

/// Prefills `prompts` (left-padded into one batch, fed `chunk` columns per forward; 0 = all at
/// once); returns their cache and next-token logits `[prompts, V]`.
fn prefill(
    model: &Transformer,
    prompts: &[&[u32]],
    chunk: usize,
    stats: &mut EngineStats,
) -> Result<(KvCache, Tensor)> {
    let max_len = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(prompts.len() * max_len);
    let mut pads = Vec::with_capacity(prompts.len());
    for p in prompts {
        pads.push(max_len - p.len());
        ids.extend(std::iter::repeat_n(0u32, max_len - p.len()));
        ids.extend_from_slice(p);
    }
    let input = Tensor::from_vec(ids, (prompts.len(), max_len), model.device())?;
    let mut cache = KvCache::new(model.cfg.num_hidden_layers, pads);
    cache.reserve(max_len);
    let step = if chunk == 0 { max_len } else { chunk };
    let mut start = 0;
    let mut last = None;
    while start < max_len {
        let t = step.min(max_len - start);
        let hidden =
            model.forward_hidden(&input.narrow(1, start, t)?, None, Some(&mut cache), false)?;
        last = Some(hidden.narrow(1, t - 1, 1)?);
        stats.prefill_forwards += 1;
        start += t;
    }
    stats.prefill_tokens += prompts.iter().map(|p| p.len()).sum::<usize>();
    let last = last.expect("prompts are non-empty (checked)");
    Ok((cache, model.logits(&last)?.squeeze(1)?))
}
