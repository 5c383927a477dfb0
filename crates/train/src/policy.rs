//! Rollout sampling and per-token log-probs for the built-in tiny policy.
//!
//! Decoding recomputes the full (short) sequence each token instead of keeping a KV cache:
//! the built-in task's sequences are ~10 tokens, where a cache saves nothing measurable. HF
//! checkpoints go through composer-model's KV-cached `generate`.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::tiny::TinyModel;

/// Sampling knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Temperature (0 = greedy).
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: f64,
    /// Top-k (0 = off).
    pub top_k: usize,
    /// Longest completion.
    pub max_new_tokens: usize,
}

/// One sampled completion, with what the loss and the audit need.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Index of its prompt in the step's prompt list (its group).
    pub group: usize,
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Completion token ids (ending with EOS unless truncated).
    pub completion_ids: Vec<u32>,
    /// Sampler log-prob of each completion token (after temperature, before top-k/top-p).
    pub sampler_logprobs: Vec<f32>,
    /// Hit `max_new_tokens` without EOS.
    pub truncated: bool,
    /// Weights version that produced it.
    pub policy_version: u64,
    /// Per completion token, 1 = trained on, 0 = not (environment observation tokens between
    /// model turns of a multi-turn episode). `None`: every completion token is trained on.
    pub loss_mask: Option<Vec<u8>>,
}

/// A seed that depends only on (seed, step, index): SplitMix64 over the three.
pub fn mix_seed(seed: u64, step: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(step.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(index.wrapping_mul(0x94D0_49BB_1331_11EB))
        .wrapping_add(0x2545_F491_4F6C_DD1D);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Right-pad rows with `pad` into a `[B, L]` u32 tensor.
pub fn pad_batch(rows: &[Vec<u32>], pad: u32, device: &Device) -> Result<Tensor> {
    let l = rows.iter().map(|r| r.len()).max().unwrap_or(1).max(1);
    let mut flat = Vec::with_capacity(rows.len() * l);
    for r in rows {
        flat.extend_from_slice(r);
        flat.extend(std::iter::repeat_n(pad, l - r.len()));
    }
    Ok(Tensor::from_vec(flat, (rows.len(), l), device)?)
}

/// Sample `n` completions for every prompt; row `i` (prompt `i / n`) draws from
/// ChaCha8(seed_of(i)).
pub fn generate(
    model: &TinyModel,
    prompts: &[Vec<u32>],
    n: usize,
    params: &SamplingParams,
    eos: u32,
    policy_version: u64,
    seed_of: impl Fn(usize) -> u64,
) -> Result<Vec<Sample>> {
    let rows = prompts.len() * n;
    let mut seqs: Vec<Vec<u32>> = (0..rows).map(|i| prompts[i / n].clone()).collect();
    let mut out: Vec<Sample> = (0..rows)
        .map(|i| Sample {
            group: i / n,
            prompt_ids: prompts[i / n].clone(),
            completion_ids: vec![],
            sampler_logprobs: vec![],
            truncated: false,
            policy_version,
            loss_mask: None,
        })
        .collect();
    let mut rngs: Vec<ChaCha8Rng> = (0..rows)
        .map(|i| ChaCha8Rng::seed_from_u64(seed_of(i)))
        .collect();
    let mut active: Vec<usize> = (0..rows).collect();
    for _ in 0..params.max_new_tokens {
        if active.is_empty() {
            break;
        }
        let batch: Vec<Vec<u32>> = active.iter().map(|&i| seqs[i].clone()).collect();
        let ids = pad_batch(&batch, eos, model.device())?;
        let (b, l) = ids.dims2()?;
        let logits = model.forward_inference(&ids)?;
        let v = logits.dim(2)?;
        let last: Vec<u32> = batch
            .iter()
            .enumerate()
            .map(|(r, s)| (r * l + s.len() - 1) as u32)
            .collect();
        let last = Tensor::from_vec(last, b, model.device())?;
        let rows_logits: Vec<Vec<f32>> = logits
            .reshape((b * l, v))?
            .index_select(&last, 0)?
            .to_vec2()?;
        let mut still = Vec::new();
        for (r, &i) in active.iter().enumerate() {
            let (tok, lp) = sample_token(&rows_logits[r], params, &mut rngs[i]);
            seqs[i].push(tok);
            out[i].completion_ids.push(tok);
            out[i].sampler_logprobs.push(lp);
            if tok != eos {
                still.push(i);
            }
        }
        active = still;
    }
    for i in active {
        out[i].truncated = true;
    }
    Ok(out)
}

/// Draw one token: greedy at temperature 0; else softmax(logits / T) filtered by top-k/top-p.
/// Returns the token and its log-prob under softmax(logits / T).
fn sample_token(logits: &[f32], p: &SamplingParams, rng: &mut ChaCha8Rng) -> (u32, f32) {
    let t = if p.temperature <= 0.0 {
        1.0
    } else {
        p.temperature
    };
    let scaled: Vec<f64> = logits.iter().map(|&x| x as f64 / t).collect();
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + scaled.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    let logp: Vec<f64> = scaled.iter().map(|x| x - lse).collect();
    if p.temperature <= 0.0 {
        let (i, _) =
            logp.iter().enumerate().fold(
                (0, f64::NEG_INFINITY),
                |a, (i, &x)| if x > a.1 { (i, x) } else { a },
            );
        return (i as u32, logp[i] as f32);
    }
    let mut order: Vec<usize> = (0..logp.len()).collect();
    order.sort_by(|&a, &b| logp[b].total_cmp(&logp[a]));
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = 0;
        for &i in &order {
            cum += logp[i].exp();
            keep += 1;
            if cum >= p.top_p {
                break;
            }
        }
        order.truncate(keep.max(1));
    }
    let total: f64 = order.iter().map(|&i| logp[i].exp()).sum();
    let mut u = rng.random::<f64>() * total;
    for &i in &order {
        u -= logp[i].exp();
        if u <= 0.0 {
            return (i as u32, logp[i] as f32);
        }
    }
    let i = *order.last().unwrap_or(&0);
    (i as u32, logp[i] as f32)
}

/// A padded teacher-forcing batch: position j predicts token j+1.
pub struct TokenBatch {
    /// Input ids `[B, L]`.
    pub input: Tensor,
    /// Target ids `[B, L]`.
    pub targets: Tensor,
    /// 1 on completion-token targets, 0 elsewhere `[B, L]` (f32).
    pub mask: Tensor,
    /// Per row, the flat (row·L + j) positions of its completion targets, in order.
    pub completion_positions: Vec<Vec<usize>>,
    /// L.
    pub len: usize,
}

/// Build a batch from (prompt, completion) id pairs.
pub fn token_batch(pairs: &[(&[u32], &[u32])], pad: u32, device: &Device) -> Result<TokenBatch> {
    let l = pairs
        .iter()
        .map(|(p, c)| p.len() + c.len() - 1)
        .max()
        .unwrap_or(1)
        .max(1);
    let b = pairs.len();
    let mut input = vec![pad; b * l];
    let mut targets = vec![pad; b * l];
    let mut mask = vec![0f32; b * l];
    let mut positions = Vec::with_capacity(b);
    for (r, (p, c)) in pairs.iter().enumerate() {
        let seq: Vec<u32> = p.iter().chain(c.iter()).copied().collect();
        let mut pos = Vec::new();
        for j in 0..seq.len() - 1 {
            input[r * l + j] = seq[j];
            targets[r * l + j] = seq[j + 1];
            if j + 1 >= p.len() {
                mask[r * l + j] = 1.0;
                pos.push(r * l + j);
            }
        }
        positions.push(pos);
    }
    Ok(TokenBatch {
        input: Tensor::from_vec(input, (b, l), device)?,
        targets: Tensor::from_vec(targets, (b, l), device)?,
        mask: Tensor::from_vec(mask, (b, l), device)?,
        completion_positions: positions,
        len: l,
    })
}

/// Differentiable log-softmax over the last dim: x − (max.detach() + log Σ exp(x − max)).
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&m)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// Per-token log-probs of the targets `[B, L]` and the full log-softmax `[B, L, V]`, at
/// temperature `t` (logits divided by t, as TRL's trainer does).
pub fn token_logprobs(
    model: &TinyModel,
    batch: &TokenBatch,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    let logits = model.forward(&batch.input)?;
    let logits = if temperature > 0.0 && temperature != 1.0 {
        (logits / temperature)?
    } else {
        logits
    };
    let ls = log_softmax(&logits)?;
    let lp = ls.gather(&batch.targets.unsqueeze(2)?, 2)?.squeeze(2)?;
    Ok((lp, ls))
}

/// Rows of `[B, L, V]` at flat positions → `[N, V]`.
pub fn rows_at(ls: &Tensor, positions: &[usize]) -> Result<Tensor> {
    let (b, l, v) = ls.dims3()?;
    let idx = Tensor::from_vec(
        positions.iter().map(|&p| p as u32).collect::<Vec<_>>(),
        positions.len(),
        ls.device(),
    )?;
    Ok(ls.reshape((b * l, v))?.index_select(&idx, 0)?)
}

/// Sum of masked values divided by the mask's sum (0 when the mask is empty).
pub fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let n = mask.sum_all()?.to_scalar::<f32>()?;
    let s = (x * mask)?.sum_all()?;
    Ok((s / (n.max(1.0) as f64))?)
}

/// f32 scalar value.
pub fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64)
}
