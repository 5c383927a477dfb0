//! Deterministic (batch-invariant) sampling and scoring: the sampler's log-probs equal the
//! scorer's recomputed log-probs bit for bit.
//!
//! Batched decoding cannot promise that: a matmul's reduction order depends on its shape
//! (rows in the batch, prefill chunk length), and padding shifts what a row's reductions see.
//! Here every sequence runs alone, one token at a time, through the ordinary KV-cached
//! forward ([`Transformer::forward`] with a one-row [`KvCache`]): the logits after token `t`
//! come from the same kernels on the same shapes and the same numbers whether they are
//! computed while sampling (prompt fed token by token, then decode) or while scoring a
//! finished sequence, and whatever else is in the batch. Both read the token's log-prob with
//! the sampler's own `log softmax(logits / T)` ([`sampler_log_softmax`]).
//!
//! The price is throughput: no batching and no multi-token prefill (see BENCHMARKS.md,
//! "Deterministic mode: what bitwise log-probs cost"). Same RNG streams as
//! [`generate`](crate::generate), so the same seed samples from the same uniforms.

use crate::kv_cache::KvCache;
use crate::sampling::{
    check_requests, empty_samples, next_tokens, sampler_log_softmax, Active, GenerationRequest,
    Sample, SamplingParams,
};
use crate::transformer::Transformer;
use anyhow::Result;
use candle_core::Tensor;

/// One sequence fed token by token through the KV-cached forward.
struct SoloSequence<'a> {
    model: &'a Transformer,
    cache: KvCache,
}

impl<'a> SoloSequence<'a> {
    fn new(model: &'a Transformer) -> Self {
        SoloSequence {
            model,
            cache: KvCache::new(model.cfg.num_hidden_layers, vec![0]),
        }
    }

    /// Feeds one token; returns the next-token logits `[1, V]`.
    fn step(&mut self, token: u32) -> Result<Tensor> {
        let input = Tensor::new(&[[token]], self.model.device())?;
        Ok(self
            .model
            .forward(&input, Some(&mut self.cache))?
            .squeeze(1)?)
    }
}

/// As [`generate`](crate::generate), batch-invariant: each sample decodes alone, its
/// prompt fed one token at a time. Its log-probs equal [`score_deterministic`]'s on the same
/// ids, bitwise.
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
    let mut out = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        let mut samples = Vec::with_capacity(r.num_samples);
        for s in 0..r.num_samples {
            let mut seq = SoloSequence::new(&model);
            let mut logits = None;
            for &t in &r.prompt_ids {
                logits = Some(seq.step(t)?);
            }
            let mut logits = logits.expect("prompts are non-empty (checked)");
            let mut active = [Active::new(i, r, s)];
            loop {
                let (tokens, lps) = next_tokens(&logits, params, &mut active)?;
                if let Some(done) =
                    active[0].push(tokens[0], lps[0], &stop_ids, params.max_new_tokens, max_pos)
                {
                    samples.push(done);
                    break;
                }
                logits = seq.step(tokens[0])?;
            }
        }
        out.push(samples);
    }
    Ok(out)
}

/// As [`score_with_temperature`](crate::score::score_with_temperature), batch-invariant:
/// entry `t` of sequence `s` is `log softmax(logits / T)[s[t+1]]` after feeding `s[..=t]` one
/// token at a time. T = 1 scores a greedy sampler's log-probs.
pub fn score_deterministic(
    model: &Transformer,
    seqs: &[Vec<u32>],
    temperature: f64,
) -> Result<Vec<Vec<f32>>> {
    crate::score::check_score_inputs(model, seqs, temperature)?;
    let model = model.detached();
    let mut out = Vec::with_capacity(seqs.len());
    for s in seqs {
        let mut seq = SoloSequence::new(&model);
        let mut lps = Vec::with_capacity(s.len().saturating_sub(1));
        for w in s.windows(2) {
            let logp = sampler_log_softmax(&seq.step(w[0])?, temperature)?;
            let lp = logp
                .narrow(1, w[1] as usize, 1)?
                .flatten_all()?
                .to_vec1::<f32>()?[0];
            lps.push(lp);
        }
        out.push(lps);
    }
    Ok(out)
}
