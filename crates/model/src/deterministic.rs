//! Deterministic (batch-invariant) sampling and scoring: the sampler's log-probs equal the
//! scorer's recomputed log-probs bit for bit.
//!
//! Batched decoding cannot promise that by itself: a product's reduction order depends on its
//! shape (candle's CPU product takes another path for one row than for several, and for some
//! small shapes changes with the row count), a prefill computes the prompt's keys with other
//! shapes than a decode step, and padding shifts what a row's reductions see. Here:
//! - the rows are fed in lockstep, unpadded: the positions where every row still has prompt
//!   tokens in as few forwards as allowed (a prefill), then one token a step — at position
//!   `t` each row feeds its token (prompt, then sampled; a finished row a filler whose outputs
//!   are dropped), so every row's cache holds its own tokens;
//! - the rows go through the forward together (up to 64) with every product
//!   [batch-invariant](crate::ops::linear_rows_invariant) and each new query's attention over
//!   its own cache row, causally, [alone](crate::ops::attend_one_rows_invariant) — on the CPU
//!   their CPU bodies, on CUDA their kernels (cuBLAS picks its algorithm by the whole shape, so
//!   its products would not do); the rest of the forward is row by row already (norms, RoPE,
//!   the sampler's `log softmax(logits / T)`, [`sampler_log_softmax`]) — so a position's bits
//!   depend neither on which rows are beside it, how many, or where it sits, nor on whether it
//!   came in a prefill or a one-token step (the sampler and the scorer batch and prefill
//!   differently and still agree);
//! - where those kernels do not serve (CUDA in f16/f64, head_dim past 256) each row runs alone,
//!   one token at a time, through the ordinary KV-cached forward: the same kernels on the same
//!   shapes whether sampling or scoring.
//!
//! The price is throughput (see BENCHMARKS.md, "Deterministic mode: what bitwise log-probs
//! cost"): simple kernels in place of the engine's, a prefill only over the prompt positions
//! every row of a group shares, no prefix sharing. Same RNG streams as
//! [`generate`](crate::generate), so the same seed samples from the same uniforms.

use crate::kv_cache::KvCache;
use crate::sampling::{
    check_requests, chosen_logprobs, empty_samples, next_tokens, sampler_log_softmax, Active,
    GenerationRequest, Sample, SamplingParams,
};
use crate::transformer::Transformer;
use anyhow::Result;
use candle_core::{DType, Tensor};

/// Rows fed together at most (any grouping gives the same bits).
const LOCKSTEP_ROWS: usize = 64;

/// KV cache bytes a lockstep group may reserve (its rows' dense caches, each sized for the
/// longest sequence): fewer rows a group when longer sequences or a larger model need more
/// (a 7B in bf16 at 4,096 positions: ~235 MB a row, 18 rows).
const LOCKSTEP_KV_BYTES: usize = 4 << 30;

/// Whether [`Transformer::forward_rows_invariant`] serves `model`: on the CPU, and on CUDA in
/// f32 or bf16 with head_dim ≤ 256 (its kernels'). There rows share a lockstep batch;
/// elsewhere each runs alone.
fn rows_invariant_on(model: &Transformer) -> bool {
    let device = model.device();
    device.is_cpu()
        || (device.is_cuda()
            && matches!(model.dtype(), DType::F32 | DType::BF16)
            && model.cfg.head_dim <= 256)
}

/// Rows that may share a lockstep batch on `model`'s device when the longest sequence has
/// `max_len` positions: up to [`LOCKSTEP_ROWS`] within [`LOCKSTEP_KV_BYTES`], at least one.
fn rows_per_batch(model: &Transformer, max_len: usize) -> usize {
    if !rows_invariant_on(model) {
        return 1;
    }
    let c = &model.cfg;
    let per_position = 2
        * c.num_hidden_layers
        * c.num_key_value_heads
        * c.head_dim
        * model.dtype().size_in_bytes();
    rows_within(per_position, max_len)
}

/// Rows whose caches of `max_len` positions at `per_position` bytes fit [`LOCKSTEP_KV_BYTES`]
/// (between 1 and [`LOCKSTEP_ROWS`]).
fn rows_within(per_position: usize, max_len: usize) -> usize {
    (LOCKSTEP_KV_BYTES / per_position.saturating_mul(max_len).max(1)).clamp(1, LOCKSTEP_ROWS)
}

/// Tokens a prefill forward feeds across its rows at most (bounds its activations).
const PREFILL_TOKENS: usize = 2048;

/// Logits (elements) a scoring forward returns at most: a prefill's positions are all scored.
const SCORE_LOGITS: usize = 1 << 25;

/// Rows fed through the KV-cached forward in lockstep: a shared prefix of positions at once,
/// then one position a step.
struct Lockstep<'a> {
    model: &'a Transformer,
    cache: KvCache,
    rows: usize,
}

impl<'a> Lockstep<'a> {
    /// `rows` empty rows, their caches sized for `max_len` positions.
    fn new(model: &'a Transformer, rows: usize, max_len: usize) -> Self {
        let mut cache = KvCache::new(model.cfg.num_hidden_layers, vec![0; rows]);
        cache.reserve(max_len);
        Lockstep { model, cache, rows }
    }

    /// Positions to feed next when every row has real tokens up to position `shared`
    /// (exclusive) and the cache holds `cache.len()`: the rest of that prefix in one forward
    /// (at most [`PREFILL_TOKENS`] over the rows, and with `scored` at most [`SCORE_LOGITS`]
    /// logits), else one. Only the batch-invariant forward may feed several: there a
    /// position's bits do not depend on the positions fed with it.
    fn span(&self, shared: usize, scored: bool) -> usize {
        let left = shared.saturating_sub(self.cache.len);
        if left <= 1 || !rows_invariant_on(self.model) {
            return 1;
        }
        let mut most = PREFILL_TOKENS / self.rows;
        if scored {
            most = most.min(SCORE_LOGITS / (self.rows * self.model.cfg.vocab_size).max(1));
        }
        left.min(most.max(1))
    }

    /// Feeds `span` tokens per row (`tokens` row by row; positions `cache.len()..+span`);
    /// returns the next-token logits `[rows · n, V]` f32 (f64 for an f64 model), row by row,
    /// of every fed position (`n = span`) or with `last_only` of the last (`n = 1`).
    fn feed(&mut self, tokens: &[u32], span: usize, last_only: bool) -> Result<Tensor> {
        let input = Tensor::from_vec(tokens.to_vec(), (self.rows, span), self.model.device())?;
        let logits = if rows_invariant_on(self.model) {
            self.model
                .forward_rows_invariant(&input, &mut self.cache, last_only)?
        } else {
            self.model.forward(&input, Some(&mut self.cache))?
        };
        let v = logits.dim(2)?;
        Ok(logits.reshape((logits.elem_count() / v, v))?)
    }
}

/// One sample of deterministic decoding: its prompt, the token it feeds next, its draw.
struct Row<'r> {
    prompt: &'r [u32],
    /// The token sampled last (fed at the next step).
    last: u32,
    /// Its draw (taken out while `next_tokens` draws for the rows at a step).
    active: Option<Active>,
    done: bool,
}

/// As [`generate`](crate::generate), batch-invariant: the samples decode in lockstep (see
/// the module's doc), their prompts fed one token a step. Its log-probs equal
/// [`score_deterministic`]'s on the same ids, bitwise.
pub fn generate_deterministic(
    model: &Transformer,
    requests: &[GenerationRequest],
    params: &SamplingParams,
) -> Result<Vec<Vec<Sample>>> {
    let stop_ids = check_requests(model, requests, params)?;
    if params.max_new_tokens == 0 {
        return Ok(empty_samples(requests));
    }
    let model = model.detached();
    let max_pos = model.cfg.max_position_embeddings;
    let mut out: Vec<Vec<Option<Sample>>> = requests
        .iter()
        .map(|r| (0..r.num_samples).map(|_| None).collect())
        .collect();
    let all: Vec<(usize, usize)> = requests
        .iter()
        .enumerate()
        .flat_map(|(i, r)| (0..r.num_samples).map(move |s| (i, s)))
        .collect();
    // Positions a sample may reach: its prompt and new tokens, within the context.
    let positions = |prompt: &[u32]| (prompt.len() + params.max_new_tokens).min(max_pos);
    let longest = requests
        .iter()
        .map(|r| positions(&r.prompt_ids))
        .max()
        .unwrap_or(0);
    for group in all.chunks(rows_per_batch(&model, longest)) {
        let mut rows: Vec<Row> = group
            .iter()
            .map(|&(i, s)| Row {
                prompt: &requests[i].prompt_ids,
                last: 0,
                active: Some(Active::new(i, &requests[i], s)),
                done: false,
            })
            .collect();
        let max_len = rows.iter().map(|r| positions(r.prompt)).max().unwrap_or(0);
        let mut lockstep = Lockstep::new(&model, rows.len(), max_len);
        // Every row's prompt covers positions below `shared`: fed in as few forwards as allowed.
        let shared = rows.iter().map(|r| r.prompt.len()).min().unwrap_or(0);
        while !rows.iter().all(|r| r.done) {
            let t0 = lockstep.cache.len;
            let span = lockstep.span(shared, false);
            let tokens: Vec<u32> = rows
                .iter()
                .flat_map(|r| {
                    (t0..t0 + span).map(move |t| match r.prompt.get(t) {
                        Some(&p) => p,
                        None if r.done => r.prompt[0],
                        None => r.last,
                    })
                })
                .collect();
            let logits = lockstep.feed(&tokens, span, true)?;
            // Rows whose next token is drawn now: past their prompt's last token, not done.
            let t = t0 + span - 1;
            let drawing: Vec<usize> = (0..rows.len())
                .filter(|&j| !rows[j].done && t + 1 >= rows[j].prompt.len())
                .collect();
            if drawing.is_empty() {
                continue;
            }
            let index = Tensor::from_vec(
                drawing.iter().map(|&j| j as u32).collect::<Vec<_>>(),
                drawing.len(),
                logits.device(),
            )?;
            let mut active: Vec<Active> = drawing
                .iter()
                .filter_map(|&j| rows[j].active.take())
                .collect();
            let (tokens, lps) = next_tokens(&logits.index_select(&index, 0)?, params, &mut active)?;
            for (((&j, mut a), token), lp) in drawing.iter().zip(active).zip(tokens).zip(lps) {
                let row = &mut rows[j];
                row.last = token;
                if let Some(done) = a.push(token, lp, &stop_ids, params.max_new_tokens, max_pos) {
                    out[a.request][a.sample] = Some(done);
                    row.done = true;
                }
                row.active = Some(a);
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|samples| {
            samples
                .into_iter()
                .map(|s| s.expect("every sample finishes (length limits)"))
                .collect()
        })
        .collect())
}

/// As [`score_with_temperature`](crate::score::score_with_temperature), batch-invariant:
/// entry `t` of sequence `s` is `log softmax(logits / T)[s[t+1]]` after feeding `s[..=t]` one
/// token a step, the sequences in lockstep (see the module's doc). T = 1 scores a greedy
/// sampler's log-probs.
pub fn score_deterministic(
    model: &Transformer,
    seqs: &[Vec<u32>],
    temperature: f64,
) -> Result<Vec<Vec<f32>>> {
    crate::score::check_score_inputs(model, seqs, temperature)?;
    let model = model.detached();
    let mut out: Vec<Vec<f32>> = seqs
        .iter()
        .map(|s| Vec::with_capacity(s.len().saturating_sub(1)))
        .collect();
    // Only sequences with a next token to score take a row.
    let scored: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].len() >= 2).collect();
    let longest = seqs.iter().map(Vec::len).max().unwrap_or(0);
    for group in scored.chunks(rows_per_batch(&model, longest)) {
        let max_len = group.iter().map(|&i| seqs[i].len()).max().unwrap_or(0);
        let mut lockstep = Lockstep::new(&model, group.len(), max_len);
        // Positions below `shared` are real in every sequence: fed in as few forwards as allowed.
        let shared = group
            .iter()
            .map(|&i| seqs[i].len())
            .min()
            .unwrap_or(0)
            .min(max_len - 1);
        while lockstep.cache.len < max_len - 1 {
            let t0 = lockstep.cache.len;
            let span = lockstep.span(shared, true);
            // A row past its last scored position feeds a filler; its outputs are dropped.
            let fed: Vec<u32> = group
                .iter()
                .flat_map(|&i| {
                    (t0..t0 + span).map(move |t| seqs[i].get(t).copied().unwrap_or(seqs[i][0]))
                })
                .collect();
            let next: Vec<u32> = group
                .iter()
                .flat_map(|&i| {
                    (t0 + 1..t0 + span + 1).map(move |t| seqs[i].get(t).copied().unwrap_or(0))
                })
                .collect();
            let logp = sampler_log_softmax(&lockstep.feed(&fed, span, false)?, temperature)?;
            let lps = chosen_logprobs(&logp, &next)?;
            for (g, &i) in group.iter().enumerate() {
                for (dt, &lp) in lps[g * span..(g + 1) * span].iter().enumerate() {
                    if t0 + dt + 1 < seqs[i].len() {
                        out[i].push(lp);
                    }
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lockstep group's dense caches stay within their budget: Qwen2.5-7B in bf16 (28
    /// layers × 4 KV heads × 128) at 4,096 positions takes 18 rows, Qwen2.5-0.5B (24 × 2 × 64)
    /// all 64, and a sequence too long for even one row still gets one.
    #[test]
    fn lockstep_groups_fit_the_kv_budget() {
        assert_eq!(rows_within(2 * 28 * 4 * 128 * 2, 4096), 18);
        assert_eq!(rows_within(2 * 24 * 2 * 64 * 2, 4096), 64);
        assert_eq!(rows_within(2 * 28 * 4 * 128 * 2, 1 << 20), 1);
        assert_eq!(rows_within(0, 0), 64);
    }
}
