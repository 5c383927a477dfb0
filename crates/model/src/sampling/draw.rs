//! Drawing each row's next token: greedy, or inverse CDF in id order over what the sampling
//! filters keep ([`SampleFilter`]). One algorithm with three implementations of the same
//! arithmetic: the CUDA kernel (`sample_kernels.cuh`), its CPU twin ([`draw_rows`]: one
//! task per row, no `[rows, V]` temporaries), and for other devices and dtypes a candle
//! composition ([`inverse_cdf_blocked`]).

use super::{sampler_log_softmax, Active, SamplingParams};
use crate::ops::{par_map, row_sums, with_slice, Real};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};
use rand::Rng;

/// Tokens per block of the two-stage inverse-CDF sampler.
const SAMPLE_BLOCK: usize = 128;

/// Draws the next token of every active row and returns `(tokens, sampler log-probs)`.
///
/// The log-probs are [`sampler_log_softmax`]'s (the deterministic scorer's function, so
/// deterministic mode's are the scorer's bit for bit), on the model's device. Greedy decoding
/// takes the argmax there; sampling draws the rollout engine's token ([`sample_inverse_cdf`]:
/// inverse CDF in id order over what the filters keep). The log-prob returned is the
/// unfiltered `log softmax(logits / T)` at the token.
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
        // The rollout engine's draw; the log-probs below stay the scorer's.
        sample_inverse_cdf(logits, temperature, &SampleFilter::of(params), &uniforms)?.0
    };
    let token_logprobs = chosen_logprobs(&logp, &tokens)?;
    Ok((tokens, token_logprobs))
}

/// As [`next_tokens`], for the rollout engine: sampling (temperature > 0, with or without
/// top-k / top-p / min-p) on the CPU or on CUDA (f32/bf16 logits, built with `--features
/// cuda`) is [`sample_inverse_cdf`]'s single pass per row — the CUDA kernel or its CPU twin —
/// with the same uniforms from the same streams, its log-probs from the same pass (no
/// `[rows, V]` log-softmax). Deterministic mode keeps [`next_tokens`], whose log-probs are
/// the deterministic scorer's bit for bit.
pub(crate) fn next_tokens_on_device(
    logits: &Tensor,
    params: &SamplingParams,
    active: &mut [Active],
) -> Result<(Vec<u32>, Vec<f32>)> {
    let on_kernel = logits.device().is_cpu()
        || (logits.device().is_cuda() && crate::ops::kernels_apply(logits));
    if params.temperature > 0.0 && on_kernel {
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
/// kernel does it on the device (`sample_kernels.cuh`, the filters' cuts found by bisection);
/// on the CPU its twin [`draw_rows`]; elsewhere [`filter_cuts`] and the two-stage
/// [`inverse_cdf_blocked`]. All draw the same token from the same uniform up to float
/// rounding at the CDF's and the filters' boundaries.
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
    if logits.device().is_cpu() {
        return draw_rows_cpu(logits, temperature, filter, uniforms);
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

/// [`sample_inverse_cdf`] on CPU logits: [`draw_rows`] on f32 (f64 for f64; half precision
/// widened).
fn draw_rows_cpu(
    logits: &Tensor,
    temperature: f64,
    filter: &SampleFilter,
    uniforms: &[f64],
) -> Result<(Vec<u32>, Vec<f32>)> {
    let (rows, v) = logits.dims2()?;
    if rows == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    if v == 0 {
        bail!("sampling: an empty vocabulary");
    }
    let inv_t = 1.0 / temperature;
    let drawn = if logits.dtype() == DType::F64 {
        with_slice::<f64, _>(logits, "sampling", |x| {
            draw_rows(x, v, inv_t, filter, uniforms)
        })?
    } else {
        let x = logits.to_dtype(DType::F32)?;
        with_slice::<f32, _>(&x, "sampling", |x| draw_rows(x, v, inv_t, filter, uniforms))?
    };
    Ok(drawn.into_iter().unzip())
}

/// The CPU twin of the CUDA sampler (`sample_kernels.cuh`: `sample_inverse_cdf`, or the part
/// kernels `sample_parts` / `sample_part_mass` / `sample_pick` without top-k/top-p), a task per
/// row: `x = logits·inv_t`, `lse = m + ln Σ e^{x−m}` ([`row_sums`]), the filters' cut ([`filter_cut`] on
/// `x − m`), then the first kept id whose cumulative `p = e^{x − lse}` (summed in f64)
/// exceeds `u · Σ p_kept`; a target past the end (rounding) takes the last kept id with
/// `p > 0`. Returns each row's token and its unfiltered log-prob.
fn draw_rows<T: Real>(
    x: &[T],
    v: usize,
    inv_t: f64,
    filter: &SampleFilter,
    uniforms: &[f64],
) -> Vec<(u32, f32)> {
    let inv_t = T::from_f64(inv_t);
    par_map(x.len() / v, |r| {
        let row = &x[r * v..(r + 1) * v];
        let (m, sum, _) = row_sums(row, inv_t);
        let lse = m + T::from_f64(sum.ln());
        // The cut as an offset from m: a token is kept when x − m ≥ it.
        let cut_from_max = if filter.is_off() {
            f32::NEG_INFINITY
        } else {
            let shifted: Vec<f32> = row
                .iter()
                .map(|&z| (z * inv_t - m).to_f64() as f32)
                .collect();
            filter_cut(&shifted, filter)
        };
        let kept = |z: T| ((z * inv_t - m).to_f64() as f32) >= cut_from_max;
        let p = |z: T| (z * inv_t - lse).exp().to_f64();
        let total: f64 = row.iter().filter(|&&z| kept(z)).map(|&z| p(z)).sum();
        let target = uniforms[r] * total;
        let (mut acc, mut pick, mut last) = (0f64, None, 0);
        for (i, &z) in row.iter().enumerate() {
            if !kept(z) {
                continue;
            }
            let pi = p(z);
            if pi > 0.0 {
                last = i;
            }
            acc += pi;
            if acc > target && pi > 0.0 {
                pick = Some(i);
                break;
            }
        }
        let pick = pick.unwrap_or(last);
        (pick as u32, (row[pick] * inv_t - lse).to_f64() as f32)
    })
}

/// `logp[row, tokens[row]]` for every row.
pub(crate) fn chosen_logprobs(logp: &Tensor, tokens: &[u32]) -> Result<Vec<f32>> {
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
