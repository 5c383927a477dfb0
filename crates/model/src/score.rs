//! Teacher-forced scoring: per-token log-probs of given token sequences, in batches.

use crate::chunked_logprobs::HeadOptions;
use crate::transformer::Transformer;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

/// Upper bound on rows × len × vocab of one scoring batch: it bounds the head's work per
/// forward (the fused head itself holds only one chunk of logits).
const MAX_LOGITS_PER_BATCH: usize = 64 << 20;

/// The checks every scorer makes before any forward: temperature > 0, sequences within the
/// model's positions, token ids inside its vocabulary (each error names the sequence).
pub(crate) fn check_score_inputs(
    model: &Transformer,
    seqs: &[Vec<u32>],
    temperature: f64,
) -> Result<()> {
    if temperature.is_nan() || temperature <= 0.0 {
        bail!("scoring temperature must be > 0, got {temperature}");
    }
    let max_pos = model.cfg.max_position_embeddings;
    let vocab = model.cfg.vocab_size;
    for (i, s) in seqs.iter().enumerate() {
        if s.len() > max_pos {
            bail!(
                "sequence {i} has {} tokens, more than max_position_embeddings ({max_pos})",
                s.len()
            );
        }
        if let Some(&bad) = s.iter().find(|&&t| t as usize >= vocab) {
            bail!("sequence {i}: token id {bad} is outside the vocabulary ({vocab})");
        }
    }
    Ok(())
}

/// Next-token log-probs by teacher forcing: for each sequence `s`, entry `t` is
/// `log p(s[t+1] | s[..=t])` (length `len - 1`; empty for sequences shorter than 2).
pub fn score(model: &Transformer, seqs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
    score_with_temperature(model, seqs, 1.0)
}

/// As [`score`] under `log softmax(logits / temperature)`, the sampler's distribution at
/// temperature T (T must be > 0).
pub fn score_with_temperature(
    model: &Transformer,
    seqs: &[Vec<u32>],
    temperature: f64,
) -> Result<Vec<Vec<f32>>> {
    check_score_inputs(model, seqs, temperature)?;
    let vocab = model.cfg.vocab_size;
    let model = model.detached();
    let mut out: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
    // Batch sequences of similar length together (sorted), right-padded: the causal mask
    // makes padding after a sequence irrelevant to its tokens.
    let mut order: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].len() >= 2).collect();
    order.sort_by_key(|&i| seqs[i].len());
    let mut start = 0;
    while start < order.len() {
        let mut end = start + 1;
        while end < order.len() {
            let len = seqs[order[end]].len();
            if (end + 1 - start) * len * vocab > MAX_LOGITS_PER_BATCH {
                break;
            }
            end += 1;
        }
        let batch = &order[start..end];
        let t = seqs[batch[batch.len() - 1]].len();
        let mut ids = Vec::with_capacity(batch.len() * t);
        let mut targets = Vec::with_capacity(batch.len() * (t - 1));
        for &i in batch {
            let s = &seqs[i];
            ids.extend_from_slice(s);
            ids.extend(std::iter::repeat_n(0u32, t - s.len()));
            targets.extend_from_slice(&s[1..]);
            targets.extend(std::iter::repeat_n(0u32, t - s.len()));
        }
        let dev = model.device();
        let input = Tensor::from_vec(ids, (batch.len(), t), dev)?;
        let targets = Tensor::from_vec(targets, (batch.len(), t - 1), dev)?;
        // The fused head: no [rows, len, vocab] logits beyond one chunk.
        let hidden = model
            .forward_hidden(&input, None, None, false)?
            .narrow(1, 0, t - 1)?
            .reshape((batch.len() * (t - 1), model.cfg.hidden_size))?;
        let opts = HeadOptions {
            temperature,
            ..HeadOptions::default()
        };
        let lp = model
            .head_logprobs(
                &hidden,
                &targets.reshape((batch.len() * (t - 1), 1))?,
                &opts,
            )?
            .at_ids
            .to_dtype(DType::F32)?
            .reshape((batch.len(), t - 1))?
            .to_vec2::<f32>()?;
        for (row, &i) in batch.iter().enumerate() {
            out[i] = lp[row][..seqs[i].len() - 1].to_vec();
        }
        start = end;
    }
    Ok(out)
}
