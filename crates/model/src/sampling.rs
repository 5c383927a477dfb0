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
    /// Keep only the k most likely tokens (ties with the k-th kept, as transformers); 0 = off.
    pub top_k: usize,
    /// Min-p (transformers' `min_p`): keep tokens with `p ≥ min_p · p_max`; 0 = off.
    #[serde(default)]
    pub min_p: f64,
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
    if !(0.0..=1.0).contains(&params.min_p) {
        bail!("min_p must be in [0, 1], got {}", params.min_p);
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
/// The log-softmax stays on the model's device. Greedy decoding takes the argmax there;
/// sampling draws by inverse CDF in id order ([`inverse_cdf_blocked`]) from the distribution
/// restricted to the tokens the filters keep (top-k, top-p, min-p: [`filter_cuts`], on the
/// host), so per step only O(rows · V / SAMPLE_BLOCK) numbers reach the host when no filter
/// is on. The log-prob returned is the unfiltered `log softmax(logits / T)` at the token.
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
    } else {
        let uniforms: Vec<f64> = active.iter_mut().map(|a| a.rng.random::<f64>()).collect();
        let filter = SampleFilter::of(params);
        if filter.is_off() {
            inverse_cdf_blocked(&logp, &uniforms)?
        } else {
            let cuts = filter_cuts(&logp.to_vec2::<f32>()?, &filter);
            let cuts = Tensor::from_vec(cuts, (uniforms.len(), 1), logp.device())?;
            let kept = logp.broadcast_ge(&cuts)?;
            let neg_inf =
                Tensor::new(f32::NEG_INFINITY, logp.device())?.broadcast_as(logp.shape())?;
            inverse_cdf_blocked(&kept.where_cond(&logp, &neg_inf)?, &uniforms)?
        }
    };
    let token_logprobs = chosen_logprobs(&logp, &tokens)?;
    Ok((tokens, token_logprobs))
}

/// As [`next_tokens`], for the rollout engine: on CUDA (f32/bf16 logits, built with
/// `--features cuda`) sampling (temperature > 0, with or without top-k / top-p / min-p) draws
/// on the device with [`sample_inverse_cdf`]'s kernel, the same uniforms from the same
/// streams, so only `rows` numbers cross each way. Deterministic mode keeps [`next_tokens`],
/// whose log-probs are the deterministic scorer's bit for bit.
pub(crate) fn next_tokens_on_device(
    logits: &Tensor,
    params: &SamplingParams,
    active: &mut [Active],
) -> Result<(Vec<u32>, Vec<f32>)> {
    if params.temperature > 0.0 && logits.device().is_cuda() && crate::ops::kernels_apply(logits) {
        let uniforms: Vec<f64> = active.iter_mut().map(|a| a.rng.random::<f64>()).collect();
        return sample_inverse_cdf(
            logits,
            params.temperature,
            &SampleFilter::of(params),
            &uniforms,
        );
    }
    next_tokens(logits, params, active)
}

/// The filters of sampling, applied as transformers' warpers do (temperature, then top-k,
/// then top-p renormalised over the top-k set, then min-p); every filter keeps ties at its
/// boundary, and each row keeps at least its most likely token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleFilter {
    /// Keep the `top_k` most likely tokens (and ties); 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-likely set whose mass reaches `top_p` (and ties); 1 = off.
    pub top_p: f64,
    /// Keep tokens with `p ≥ min_p · p_max`; 0 = off.
    pub min_p: f64,
}

impl SampleFilter {
    /// No filter: the whole distribution.
    pub const OFF: SampleFilter = SampleFilter {
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
    };

    /// The filters of `params`.
    pub fn of(params: &SamplingParams) -> SampleFilter {
        SampleFilter {
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
        }
    }

    /// Whether every token is kept whatever the distribution.
    pub fn is_off(&self) -> bool {
        self.top_k == 0 && self.top_p >= 1.0 && self.min_p <= 0.0
    }
}

/// Draws one token per row of `logits` `[rows, V]` from `softmax(logits / temperature)`
/// restricted to what `filter` keeps, by inverse CDF in id order at `uniforms[row]` (in
/// [0, 1)): the first kept token whose cumulative probability exceeds `u · Σ p_kept`; returns
/// the tokens and their sampler log-probs `log softmax(logits / temperature)[token]` (of the
/// whole distribution). On CUDA with f32/bf16 logits (built with `--features cuda`) one
/// kernel does it on the device (`decode_kernels.cu`, the filters' cuts found by bisection);
/// elsewhere [`filter_cuts`] and the two-stage [`inverse_cdf_blocked`]. Both draw the same
/// token from the same uniform up to float rounding at the CDF's and the filters' boundaries.
pub fn sample_inverse_cdf(
    logits: &Tensor,
    temperature: f64,
    filter: &SampleFilter,
    uniforms: &[f64],
) -> Result<(Vec<u32>, Vec<f32>)> {
    if !(temperature > 0.0 && temperature.is_finite()) {
        bail!("inverse-CDF sampling needs a temperature > 0, got {temperature}");
    }
    let top_p_ok = filter.top_p > 0.0 && filter.top_p <= 1.0;
    if !(top_p_ok && (0.0..=1.0).contains(&filter.min_p)) {
        bail!("sampling filter out of range: top_p must be in (0, 1] and min_p in [0, 1], got {filter:?}");
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
            filter,
        )?);
    }
    let logp = sampler_log_softmax(logits, temperature)?;
    let sampled = if filter.is_off() {
        logp.clone()
    } else {
        let cuts = filter_cuts(&logp.to_vec2::<f32>()?, filter);
        let cuts = Tensor::from_vec(cuts, (rows, 1), logp.device())?;
        let neg_inf = Tensor::new(f32::NEG_INFINITY, logp.device())?.broadcast_as(logp.shape())?;
        logp.broadcast_ge(&cuts)?.where_cond(&logp, &neg_inf)?
    };
    let tokens = inverse_cdf_blocked(&sampled, uniforms)?;
    let token_logprobs = chosen_logprobs(&logp, &tokens)?;
    Ok((tokens, token_logprobs))
}

/// Per row of log-probs, the smallest log-prob `filter` keeps (the row keeps every token at
/// or above it): the largest of the top-k cut (the k-th largest value), the top-p cut (the
/// smallest value of the shortest most-likely prefix whose mass, renormalised over the top-k
/// set, reaches `top_p`) and the min-p cut (`max + ln min_p`).
pub fn filter_cuts(rows: &[Vec<f32>], filter: &SampleFilter) -> Vec<f32> {
    rows.iter().map(|row| filter_cut(row, filter)).collect()
}

fn filter_cut(logp: &[f32], filter: &SampleFilter) -> f32 {
    let max = logp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut cut = f32::NEG_INFINITY;
    if filter.min_p > 0.0 {
        cut = cut.max(max + (filter.min_p as f32).ln());
    }
    let mut cut_k = f32::NEG_INFINITY;
    let mut desc: Vec<f32> = Vec::new();
    if filter.top_k > 0 && filter.top_k < logp.len() {
        desc = logp.to_vec();
        let k = filter.top_k;
        desc.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        cut_k = desc[k - 1];
        desc.truncate(k);
    }
    if filter.top_p < 1.0 {
        if desc.is_empty() {
            // Tokens below (1 − top_p) / V together weigh less than 1 − top_p: never needed.
            let floor = ((1.0 - filter.top_p) / logp.len() as f64).ln() as f32;
            desc = logp
                .iter()
                .copied()
                .filter(|&l| l >= floor.min(max))
                .collect();
        }
        desc.sort_by(|a, b| b.total_cmp(a));
        // The top-k set's mass includes every tie of the k-th value.
        let ties = logp.iter().filter(|&&l| l == cut_k).count();
        let k_mass: f64 = desc
            .iter()
            .filter(|&&l| l > cut_k)
            .map(|&l| (l as f64).exp())
            .sum::<f64>()
            + if cut_k > f32::NEG_INFINITY {
                ties as f64 * (cut_k as f64).exp()
            } else {
                0.0
            };
        let total = if cut_k > f32::NEG_INFINITY {
            k_mass
        } else {
            logp.iter().map(|&l| (l as f64).exp()).sum()
        };
        let mut acc = 0f64;
        let mut cut_p = max;
        for &l in &desc {
            acc += (l as f64).exp();
            cut_p = l;
            if acc >= filter.top_p * total {
                break;
            }
        }
        cut = cut.max(cut_p);
    }
    cut.max(cut_k)
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
