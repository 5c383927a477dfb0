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

use crate::logprobs;
use crate::transformer::Transformer;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Decoding knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; 0 = greedy (argmax).
    pub temperature: f64,
    /// Nucleus sampling mass in (0, 1]; 1 = off.
    pub top_p: f64,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Completion length cap (a sample that hits it finishes with `Length`).
    pub max_new_tokens: usize,
    /// Token ids that end a sample (included in its completion). None = the model's EOS ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Batch-invariant decoding ([`crate::deterministic`]): every sample alone, token by
    /// token, so its log-probs equal [`crate::score_deterministic`]'s bitwise. Slower.
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

/// Checks the sampling knobs and every request against the model before any work; returns the
/// stop ids.
pub(crate) fn check_requests(
    model: &Transformer,
    requests: &[GenerationRequest],
    params: &SamplingParams,
) -> Result<Vec<u32>> {
    if params.temperature < 0.0 || !params.temperature.is_finite() {
        bail!("temperature must be >= 0, got {}", params.temperature);
    }
    if !(params.top_p > 0.0 && params.top_p <= 1.0) {
        bail!("top_p must be in (0, 1], got {}", params.top_p);
    }
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

/// Tokens per block of the two-stage inverse-CDF sampler.
const SAMPLE_BLOCK: usize = 128;

/// Draws the next token of every active row and returns `(tokens, sampler log-probs)`.
///
/// The log-softmax stays on the model's device. Greedy decoding takes the argmax there, and
/// plain sampling (no top-k / top-p) uses [`inverse_cdf_blocked`], so per step only
/// O(rows · V / SAMPLE_BLOCK) numbers reach the host instead of the full `[rows, V]`
/// distribution. Top-k / top-p need a sort, done on the host over the candidate set.
pub(crate) fn next_tokens(
    logits: &Tensor,
    params: &SamplingParams,
    active: &mut [Active],
) -> Result<(Vec<u32>, Vec<f32>)> {
    let greedy = params.temperature == 0.0;
    // Sampler distribution: log softmax(logits / T) in f32 (T = 1 for greedy).
    let temperature = if greedy { 1.0 } else { params.temperature };
    let logp = sampler_log_softmax(logits, temperature)?;
    let tokens: Vec<u32> = if greedy {
        logp.argmax(D::Minus1)?.to_vec1::<u32>()?
    } else if params.top_k == 0 && params.top_p >= 1.0 {
        let uniforms: Vec<f64> = active.iter_mut().map(|a| a.rng.random::<f64>()).collect();
        inverse_cdf_blocked(&logp, &uniforms)?
    } else {
        let rows = logp.to_vec2::<f32>()?;
        rows.iter()
            .zip(active.iter_mut())
            .map(|(lp, a)| sample_token(lp, params.top_k, params.top_p, &mut a.rng))
            .collect()
    };
    let token_logprobs = chosen_logprobs(&logp, &tokens)?;
    Ok((tokens, token_logprobs))
}

/// As [`next_tokens`], for the rollout engine: on CUDA (f32/bf16 logits, built with
/// `--features cuda`) plain sampling (temperature > 0, no top-k / top-p) draws on the device
/// with [`sample_inverse_cdf`]'s kernel, the same uniforms from the same streams, so only
/// `rows` numbers cross each way. Deterministic mode keeps [`next_tokens`], whose log-probs
/// are the deterministic scorer's bit for bit.
pub(crate) fn next_tokens_on_device(
    logits: &Tensor,
    params: &SamplingParams,
    active: &mut [Active],
) -> Result<(Vec<u32>, Vec<f32>)> {
    let plain = params.temperature > 0.0 && params.top_k == 0 && params.top_p >= 1.0;
    if plain && logits.device().is_cuda() && crate::ops::kernels_apply(logits) {
        let uniforms: Vec<f64> = active.iter_mut().map(|a| a.rng.random::<f64>()).collect();
        return sample_inverse_cdf(logits, params.temperature, &uniforms);
    }
    next_tokens(logits, params, active)
}

/// Draws one token per row of `logits` `[rows, V]` from `softmax(logits / temperature)` by
/// inverse CDF at `uniforms[row]` (in [0, 1)): the first token, in id order, whose cumulative
/// probability exceeds `u · Σp`; returns the tokens and their sampler log-probs
/// `log softmax(logits / temperature)[token]`. On CUDA with f32/bf16 logits (built with
/// `--features cuda`) one kernel does it on the device (`decode_kernels.cu`); elsewhere the
/// two-stage [`inverse_cdf_blocked`]. Both draw the same token from the same uniform up to
/// float rounding at the CDF's boundaries.
pub fn sample_inverse_cdf(
    logits: &Tensor,
    temperature: f64,
    uniforms: &[f64],
) -> Result<(Vec<u32>, Vec<f32>)> {
    if !(temperature > 0.0 && temperature.is_finite()) {
        bail!("inverse-CDF sampling needs a temperature > 0, got {temperature}");
    }
    let (rows, _) = logits.dims2()?;
    if uniforms.len() != rows {
        bail!(
            "inverse-CDF sampling: {} uniforms for {rows} rows of logits",
            uniforms.len()
        );
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() && crate::ops::kernels_apply(logits) {
        return Ok(crate::ops::sample_inverse_cdf_cuda(
            logits,
            uniforms,
            (1.0 / temperature) as f32,
        )?);
    }
    let logp = sampler_log_softmax(logits, temperature)?;
    let tokens = inverse_cdf_blocked(&logp, uniforms)?;
    let token_logprobs = chosen_logprobs(&logp, &tokens)?;
    Ok((tokens, token_logprobs))
}

/// `logp[row, tokens[row]]` for every row.
fn chosen_logprobs(logp: &Tensor, tokens: &[u32]) -> Result<Vec<f32>> {
    let ids = Tensor::from_vec(tokens.to_vec(), (tokens.len(), 1), logp.device())?;
    Ok(logp.gather(&ids, 1)?.squeeze(1)?.to_vec1::<f32>()?)
}

/// Inverse-CDF sampling of one token per row of `logp` (`[rows, V]` log-probs), row `i` at
/// uniform `uniforms[i]`, in two stages: the probability mass of each block of
/// [`SAMPLE_BLOCK`] tokens goes to the host, which picks the block where the cumulative mass
/// crosses `u · total`; then only that block's probabilities are fetched to pick the token.
fn inverse_cdf_blocked(logp: &Tensor, uniforms: &[f64]) -> Result<Vec<u32>> {
    let (rows, vocab) = logp.dims2()?;
    let num_blocks = vocab.div_ceil(SAMPLE_BLOCK);
    let mut probs = logp.exp()?;
    if num_blocks * SAMPLE_BLOCK != vocab {
        probs = probs.pad_with_zeros(1, 0, num_blocks * SAMPLE_BLOCK - vocab)?;
    }
    let blocks = probs.reshape((rows, num_blocks, SAMPLE_BLOCK))?;
    let block_mass = blocks.sum(2)?.to_vec2::<f32>()?;
    let mut chosen_block = Vec::with_capacity(rows);
    let mut remaining = Vec::with_capacity(rows);
    for (masses, &u) in block_mass.iter().zip(uniforms) {
        let total: f64 = masses.iter().map(|&m| m as f64).sum();
        let mut target = u * total;
        // Rounding can leave `target` past the last block: take the last one with mass.
        let mut block = masses.iter().rposition(|&m| m > 0.0).unwrap_or(0);
        for (j, &m) in masses.iter().enumerate() {
            if target < m as f64 {
                block = j;
                break;
            }
            target -= m as f64;
        }
        chosen_block.push(block);
        remaining.push(target);
    }
    let flat_index: Vec<u32> = chosen_block
        .iter()
        .enumerate()
        .map(|(i, &j)| (i * num_blocks + j) as u32)
        .collect();
    let index = Tensor::from_vec(flat_index, rows, logp.device())?;
    let block_probs = blocks
        .reshape((rows * num_blocks, SAMPLE_BLOCK))?
        .index_select(&index, 0)?
        .to_vec2::<f32>()?;
    let mut tokens = Vec::with_capacity(rows);
    for ((probs, &block), &target) in block_probs.iter().zip(&chosen_block).zip(&remaining) {
        let mut acc = 0f64;
        let mut pick = probs.iter().rposition(|&p| p > 0.0).unwrap_or(0);
        for (k, &p) in probs.iter().enumerate() {
            acc += p as f64;
            if acc > target && p > 0.0 {
                pick = k;
                break;
            }
        }
        tokens.push((block * SAMPLE_BLOCK + pick) as u32);
    }
    Ok(tokens)
}

/// Draws a token from `exp(logp)` restricted to the top-k / top-p set (renormalised), on the
/// host.
fn sample_token(logp: &[f32], top_k: usize, top_p: f64, rng: &mut ChaCha8Rng) -> u32 {
    let u: f64 = rng.random::<f64>();
    let v = logp.len();
    // Candidate set. For top-p alone, tokens with p < (1 - top_p) / V can never be in the
    // nucleus (all of them together weigh less than 1 - top_p), so only the rest is sorted.
    let mut cand: Vec<(f32, u32)> = if top_p < 1.0 {
        let thresh = ((1.0 - top_p) / v as f64).ln() as f32;
        logp.iter()
            .enumerate()
            .filter(|(_, &l)| l >= thresh)
            .map(|(i, &l)| (l, i as u32))
            .collect()
    } else {
        logp.iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect()
    };
    let by_desc = |a: &(f32, u32), b: &(f32, u32)| {
        b.0.partial_cmp(&a.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.1.cmp(&b.1))
    };
    if top_k > 0 && top_k < cand.len() {
        cand.select_nth_unstable_by(top_k - 1, by_desc);
        cand.truncate(top_k);
    }
    cand.sort_by(by_desc);
    if top_p < 1.0 {
        // Keep the smallest prefix whose mass reaches top_p (renormalised over the top-k set
        // when both are on, as transformers applies top-k then top-p).
        let total: f64 = cand.iter().map(|(l, _)| (*l as f64).exp()).sum();
        let mut acc = 0f64;
        let mut cut = cand.len();
        for (i, (l, _)) in cand.iter().enumerate() {
            acc += (*l as f64).exp() / total;
            if acc >= top_p {
                cut = i + 1;
                break;
            }
        }
        cand.truncate(cut.max(1));
    }
    let total: f64 = cand.iter().map(|(l, _)| (*l as f64).exp()).sum();
    let target = u * total;
    let mut acc = 0f64;
    for (l, i) in &cand {
        acc += (*l as f64).exp();
        if acc > target {
            return *i;
        }
    }
    cand.last().map(|c| c.1).unwrap_or(0)
}
