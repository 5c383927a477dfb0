//! Batched, KV-cached sampling: [`generate`], whose scheduling (continuous batching, prompt
//! prefilled once per request, KV token budget) is [`crate::engine`]'s, or in deterministic
//! mode [`crate::deterministic`]'s.
//!
//! Prompts are prefilled as left-padded batches (padding keys masked, positions counted from
//! each row's first real token); decoding runs over the engine's paged KV cache, each row at
//! its own length. The request types and the token sampler (what
//! a sampler log-prob is, the per-sample RNG streams) are [`crate::sampling`]'s, re-exported
//! here.

pub use crate::sampling::{FinishReason, GenerationRequest, Sample, SamplingParams};
use crate::transformer::Transformer;
use anyhow::Result;

/// Samples completions for every request; returns, per request, its samples in order.
/// With `params.deterministic`, the batch-invariant sampler of [`crate::deterministic`].
pub fn generate(
    model: &Transformer,
    requests: &[GenerationRequest],
    params: &SamplingParams,
) -> Result<Vec<Vec<Sample>>> {
    if params.deterministic {
        return crate::deterministic::generate_deterministic(model, requests, params);
    }
    Ok(crate::engine::generate_with_stats(model, requests, params)?.0)
}
