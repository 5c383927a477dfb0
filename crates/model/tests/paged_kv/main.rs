//! The rollout engine's decode step: the paged decode attention (the test device's kernel and
//! the gathering composition) against a dense reference, a request's samples holding its
//! prompt's blocks once, the block budget, the block size as a knob, and the inverse-CDF
//! sampler (the device's) against the CPU sampler.

#[path = "../common/mod.rs"]
mod common;

mod attention;
mod engine;
mod sampler;

use candle_core::{DType, Device, Tensor};
use common::fixture;
use composer_model::ops::{paged_decode_attention, paged_decode_attention_composed, PagedLayout};
use composer_model::sampling::{sample_inverse_cdf, SampleFilter};
use composer_model::{
    generate_deterministic, generate_with_stats, generate_with_store, EngineConfig,
    GenerationRequest, ModelConfig, PrefixStore, Sample, SamplingParams, Transformer,
};

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}
