//! The sampling request types and the token sampler, shared by the rollout engine
//! ([`crate::engine`]) and the batch-invariant decoder ([`crate::deterministic`]):
//! [`SamplingParams`] (with the engine's scheduler knobs, [`EngineConfig`]),
//! [`GenerationRequest`], [`Sample`], and the sampler that draws each row's next token.
//!
//! **Sampler log-prob** (what [`Sample::sampler_logprobs`] holds, and what the trainer
//! recomputes): `log softmax(logits / temperature)[token]` over the full vocabulary, WITHOUT
//! the top-p / top-k truncation (those only restrict which tokens can be drawn). For greedy
//! decoding (temperature 0) it is the temperature-1 log-prob `log softmax(logits)[token]`.
//!
//! Determinism: sample `s` of a request draws from a ChaCha8 stream seeded by
//! `(request.seed, s)`, so the same seed gives the same tokens whatever else is in the batch.

mod draw;

pub(crate) use draw::{chosen_logprobs, next_tokens, next_tokens_on_device};
pub use draw::{filter_cuts, sample_inverse_cdf, SampleFilter};

use crate::logprobs;
use crate::transformer::Transformer;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Decoding knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; 0 = greedy (argmax).
    pub temperature: f64,
    /// Nucleus sampling mass in (0, 1]; 1 = off.
    pub top_p: f64,
    /// Keep only the k most likely tokens (ties with the k-th kept, as transformers); 0 = off.
    pub top_k: usize,
    /// Min-p (transformers' `min_p`): keep tokens with `p ≥ min_p · p_max`; 0 = off.
    #[serde(default)]
    pub min_p: f64,
    /// Completion length cap (a sample that hits it finishes with `Length`).
    pub max_new_tokens: usize,
    /// Token ids that end a sample (included in its completion). None = the model's EOS ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Batch-invariant decoding ([`crate::deterministic`]): the samples in lockstep through
    /// batch-invariant products and attention (CPU; CUDA in f32/bf16; elsewhere each alone,
    /// one token a step); its log-probs equal [`crate::score_deterministic`]'s bitwise. Slower.
    #[serde(default)]
    pub deterministic: bool,
    /// Scheduler knobs (batch size and KV token budget limits, prefill chunk); the default
    /// has no limits: every sample decodes in one batch.
    #[serde(default)]
    pub engine: EngineConfig,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            max_new_tokens: 128,
            stop_token_ids: None,
            deterministic: false,
            engine: EngineConfig::default(),
        }
    }
}

/// One prompt to complete `num_samples` times.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationRequest {
    /// Prompt token ids (non-empty).
    pub prompt_ids: Vec<u32>,
    /// Number of completions.
    pub num_samples: usize,
    /// RNG seed of this request.
    pub seed: u64,
}

/// Why a sample ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token was sampled (it is the last completion token).
    Stop,
    /// `max_new_tokens` (or the model's position limit) was reached.
    Length,
}

/// One completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Number of prompt tokens.
    pub prompt_len: usize,
    /// Sampled token ids.
    pub completion_ids: Vec<u32>,
    /// Per completion token: `log softmax(logits / T)[token]` (T = 1 when greedy), no
    /// top-p/top-k truncation.
    pub sampler_logprobs: Vec<f32>,
    /// Stop or length.
    pub finish_reason: FinishReason,
}

/// One sample being decoded: its RNG stream, tokens and log-probs so far.
pub(crate) struct Active {
    pub(crate) request: usize,
    pub(crate) sample: usize,
    rng: ChaCha8Rng,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    pub(crate) prompt_len: usize,
}

impl Active {
    /// Sample `sample` of request `request`: ChaCha8 seeded by the request's seed, stream
    /// `sample`.
    pub(crate) fn new(request: usize, r: &GenerationRequest, sample: usize) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(r.seed);
        rng.set_stream(sample as u64);
        Active {
            request,
            sample,
            rng,
            ids: Vec::new(),
            logprobs: Vec::new(),
            prompt_len: r.prompt_ids.len(),
        }
    }

    /// Records `token` and its log-prob; returns the finished sample when `token` is a stop
    /// id or a length limit is reached.
    pub(crate) fn push(
        &mut self,
        token: u32,
        logprob: f32,
        stop_ids: &[u32],
        max_new_tokens: usize,
        max_pos: usize,
    ) -> Option<Sample> {
        self.ids.push(token);
        self.logprobs.push(logprob);
        let stop = stop_ids.contains(&token);
        let at_limit =
            self.ids.len() >= max_new_tokens || self.prompt_len + self.ids.len() >= max_pos;
        (stop || at_limit).then(|| Sample {
            prompt_len: self.prompt_len,
            completion_ids: std::mem::take(&mut self.ids),
            sampler_logprobs: std::mem::take(&mut self.logprobs),
            finish_reason: if stop {
                FinishReason::Stop
            } else {
                FinishReason::Length
            },
        })
    }
}

/// Checks the sampling knobs (temperature, top-p, min-p) alone, before anything is loaded.
pub(crate) fn check_params(params: &SamplingParams) -> Result<()> {
    if params.temperature < 0.0 || !params.temperature.is_finite() {
        bail!("temperature must be >= 0, got {}", params.temperature);
    }
    if !(params.top_p > 0.0 && params.top_p <= 1.0) {
        bail!("top_p must be in (0, 1], got {}", params.top_p);
    }
    if !(0.0..=1.0).contains(&params.min_p) {
        bail!("min_p must be in [0, 1], got {}", params.min_p);
    }
    Ok(())
}

/// Checks the sampling knobs and every request against the model before any work; returns the
/// stop ids.
pub(crate) fn check_requests(
    model: &Transformer,
    requests: &[GenerationRequest],
    params: &SamplingParams,
) -> Result<Vec<u32>> {
    check_params(params)?;
    let max_pos = model.cfg.max_position_embeddings;
    let vocab = model.cfg.vocab_size;
    for (i, r) in requests.iter().enumerate() {
        if r.prompt_ids.is_empty() {
            bail!("request {i}: empty prompt");
        }
        if r.prompt_ids.len() > max_pos {
            bail!(
                "request {i}: prompt of {} tokens is longer than the model's max_position_embeddings ({max_pos})",
                r.prompt_ids.len()
            );
        }
        if let Some(&bad) = r.prompt_ids.iter().find(|&&t| t as usize >= vocab) {
            bail!("request {i}: token id {bad} is outside the vocabulary ({vocab})");
        }
    }
    Ok(params
        .stop_token_ids
        .clone()
        .unwrap_or_else(|| model.cfg.eos_token_ids.clone()))
}

/// Empty samples for `max_new_tokens = 0` (nothing asked, every sample ends at its limit).
pub(crate) fn empty_samples(requests: &[GenerationRequest]) -> Vec<Vec<Sample>> {
    requests
        .iter()
        .map(|r| {
            (0..r.num_samples)
                .map(|_| Sample {
                    prompt_len: r.prompt_ids.len(),
                    completion_ids: Vec::new(),
                    sampler_logprobs: Vec::new(),
                    finish_reason: FinishReason::Length,
                })
                .collect()
        })
        .collect()
}

/// Scheduler knobs of the rollout engine (0 = no limit, for the limits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Most samples decoding at once.
    pub max_running: usize,
    /// Most KV slots the running samples' blocks may take: blocks held × `kv_block_size`,
    /// a prompt's blocks shared by its samples counted once, each sample's blocks reserved up
    /// to its longest possible completion. Memory: slots × layers × 2 × kv_heads × head_dim
    /// elements. Not counted: the transient prefill cache of the prompts being admitted.
    pub kv_token_budget: usize,
    /// Prompt tokens per prefill forward (long prompts are prefilled in chunks).
    pub prefill_chunk: usize,
    /// Token slots per block of the paged KV cache (>= 1; default 16).
    pub kv_block_size: usize,
    /// Decode steps at fixed, padded shapes, captured once per padded batch size as a CUDA
    /// graph and replayed (`crate::decode_graph`); on the CPU the same fixed-shape step runs
    /// without capture. No other thread may use the device during the call. Beyond
    /// `kv_token_budget`: one scratch KV block (the padded rows') and a logits buffer of the
    /// largest padded step (`[rows, vocab]`, f32).
    pub cuda_graphs: bool,
}

/// The default block size of the paged KV cache.
pub const DEFAULT_KV_BLOCK_SIZE: usize = 16;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 0,
            kv_token_budget: 0,
            prefill_chunk: 0,
            kv_block_size: DEFAULT_KV_BLOCK_SIZE,
            cuda_graphs: false,
        }
    }
}

/// The sampler's distribution `log softmax(logits / T)` in f32, `[rows, V]` (T = 1: no
/// division). The deterministic scorer uses this same function, so its log-probs are the
/// sampler's bit for bit.
pub(crate) fn sampler_log_softmax(logits: &Tensor, temperature: f64) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    let scaled = if temperature == 1.0 {
        logits
    } else {
        (&logits / temperature)?
    };
    Ok(logprobs::log_softmax(&scaled)?.contiguous()?)
}
