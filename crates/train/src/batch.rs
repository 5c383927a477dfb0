//! Teacher-forcing batches and the per-token quantities the loss reads, all computed on the
//! tensors' device (nothing of size `[B, L, V]` is copied to the host).

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use composer_model::PackedBatch;

use crate::model::PolicyModel;

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
    /// Per row, its real (non-padding) input ids, kept from construction: the padding-free
    /// forward packs exactly these without reading `input` back from the device.
    pub row_inputs: Vec<Vec<u32>>,
}

/// Builds a batch from (prompt, completion) id pairs, right-padded with `pad`.
pub fn token_batch(pairs: &[(&[u32], &[u32])], pad: u32, device: &Device) -> Result<TokenBatch> {
    let l = pairs
        .iter()
        .map(|(p, c)| (p.len() + c.len()).saturating_sub(1))
        .max()
        .unwrap_or(1)
        .max(1);
    let b = pairs.len();
    let mut input = vec![pad; b * l];
    let mut targets = vec![pad; b * l];
    let mut mask = vec![0f32; b * l];
    let mut positions = Vec::with_capacity(b);
    let mut row_inputs = Vec::with_capacity(b);
    for (r, (p, c)) in pairs.iter().enumerate() {
        let seq: Vec<u32> = p.iter().chain(c.iter()).copied().collect();
        let mut pos = Vec::new();
        for j in 0..seq.len().saturating_sub(1) {
            input[r * l + j] = seq[j];
            targets[r * l + j] = seq[j + 1];
            if j + 1 >= p.len() {
                mask[r * l + j] = 1.0;
                pos.push(r * l + j);
            }
        }
        positions.push(pos);
        row_inputs.push(seq[..seq.len().saturating_sub(1)].to_vec());
    }
    Ok(TokenBatch {
        input: Tensor::from_vec(input, (b, l), device)?,
        targets: Tensor::from_vec(targets, (b, l), device)?,
        mask: Tensor::from_vec(mask, (b, l), device)?,
        completion_positions: positions,
        len: l,
        row_inputs,
    })
}

/// Per-token quantities of one teacher-forcing batch, all `[B, L, ..]` and differentiable,
/// computed at completion-target positions only (every other entry is 0).
pub struct TokenStats {
    /// `[B, L]` log-probs of the targets.
    pub logprobs: Tensor,
    /// `[B, L]` entropy of each position's distribution.
    pub entropy: Tensor,
    /// `[B, L, K]` log-probs at the `extra_ids` passed in (None when none were).
    pub at_ids: Option<Tensor>,
    /// `[B, L, k]` u32 ids of each position's `top_k` most likely tokens (None when 0).
    pub topk_ids: Option<Tensor>,
    /// `[B, L, k]` log-probs at `topk_ids`.
    pub topk_logprobs: Option<Tensor>,
}

/// Log-probs of the targets, entropies, optionally log-probs at `extra_ids` `[B, L, K]`
/// (u32) and each position's own top-`top_k`, of `model` at temperature `t` (logits divided
/// by t, as TRL's trainer does). The LM head runs fused and chunked
/// ([`composer_model::head_logprobs`]) over the completion-target positions, so no
/// `[B, L, V]` logits exist and prompt positions cost no head FLOPs. With the model's
/// `padding_free`, the decoder runs on the rows packed without padding (one row of
/// `Σ_r |row_inputs[r]|` tokens) and the values land in the same `[B, L]` layout.
pub fn token_stats(
    model: &PolicyModel,
    batch: &TokenBatch,
    temperature: f64,
    extra_ids: Option<&Tensor>,
    top_k: usize,
) -> Result<TokenStats> {
    let (b, l) = batch.input.dims2()?;
    let dev = batch.input.device();
    // Final hidden states one row per token, and the row of each (b, l) slot's token.
    let (hidden, hidden_row): (Tensor, Box<dyn Fn(usize) -> usize>) =
        if model.padding_free && batch.row_inputs.iter().any(|r| !r.is_empty()) {
            let seqs: Vec<&[u32]> = batch.row_inputs.iter().map(Vec::as_slice).collect();
            let packed = PackedBatch::from_sequences(&seqs);
            let starts = packed.cu_seqlens.clone();
            let hidden = model.transformer.forward_hidden_packed(&packed)?;
            (hidden, Box::new(move |slot| starts[slot / l] + slot % l))
        } else {
            let hidden = model.hidden(&batch.input)?;
            let hsz = hidden.dim(D::Minus1)?;
            (hidden.reshape((b * l, hsz))?, Box::new(|slot| slot))
        };
    // The slots the head runs on, and for every (b, l) slot its head row (or the zero row N).
    let slots: Vec<usize> = batch
        .completion_positions
        .iter()
        .flatten()
        .copied()
        .collect();
    let n = slots.len();
    let mut slot_to_row = vec![n as u32; b * l];
    for (j, &p) in slots.iter().enumerate() {
        slot_to_row[p] = j as u32;
    }
    let hidden_rows: Vec<u32> = slots.iter().map(|&p| hidden_row(p) as u32).collect();
    let hidden_rows = Tensor::from_vec(hidden_rows, n, dev)?;
    let rows: Vec<u32> = slots.iter().map(|&p| p as u32).collect();
    let rows = Tensor::from_vec(rows, n, dev)?;
    let slot_to_row = Tensor::from_vec(slot_to_row, b * l, dev)?;
    let hidden = hidden.index_select(&hidden_rows, 0)?;
    let targets = batch.targets.reshape((b * l, 1))?.index_select(&rows, 0)?;
    let k_extra = match extra_ids {
        Some(x) => x.dim(D::Minus1)?,
        None => 0,
    };
    let ids = match extra_ids {
        Some(x) => Tensor::cat(
            &[
                &targets,
                &x.reshape((b * l, k_extra))?.index_select(&rows, 0)?,
            ],
            1,
        )?,
        None => targets,
    };
    let temperature = if temperature > 0.0 { temperature } else { 1.0 };
    let out = model.transformer.head_logprobs(
        &hidden,
        &ids,
        &composer_model::HeadOptions {
            temperature,
            top_k,
            ..Default::default()
        },
    )?;
    // Back to [B, L, ..]: row N of the padded values is zero (positions not computed).
    let spread = |x: &Tensor| -> Result<Tensor> {
        let x = if x.rank() == 1 {
            x.unsqueeze(1)?
        } else {
            x.clone()
        };
        let w = x.dim(1)?;
        let zero = Tensor::zeros((1, w), x.dtype(), dev)?;
        Ok(Tensor::cat(&[&x, &zero], 0)?
            .index_select(&slot_to_row, 0)?
            .reshape((b, l, w))?)
    };
    let logprobs = spread(&out.at_ids.narrow(1, 0, 1)?)?.squeeze(2)?;
    let entropy = spread(&out.entropy)?.squeeze(2)?;
    let at_ids = match extra_ids {
        Some(_) => Some(spread(&out.at_ids.narrow(1, 1, k_extra)?)?),
        None => None,
    };
    Ok(TokenStats {
        logprobs,
        entropy,
        at_ids,
        topk_ids: out.topk_ids.as_ref().map(&spread).transpose()?,
        topk_logprobs: out.topk_logprobs.as_ref().map(&spread).transpose()?,
    })
}

/// Sum of masked values divided by the mask's sum (0 when the mask is empty).
pub fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let n = mask.sum_all()?.maximum(1.0)?;
    Ok(((x * mask)?.sum_all()? / n)?)
}

/// f32 scalar value.
pub fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_batch_masks_completion_targets_only() {
        let tb = token_batch(&[(&[5, 6], &[7, 8]), (&[5], &[9])], 0, &Device::Cpu).unwrap();
        assert_eq!(tb.len, 3);
        assert_eq!(tb.completion_positions, vec![vec![1, 2], vec![3]]);
        assert_eq!(tb.row_inputs, vec![vec![5, 6, 7], vec![5]]);
        let ids: Vec<Vec<u32>> = tb.input.to_vec2().unwrap();
        for (row, real) in ids.iter().zip(&tb.row_inputs) {
            assert_eq!(&row[..real.len()], real.as_slice());
        }
        let m: Vec<Vec<f32>> = tb.mask.to_vec2().unwrap();
        assert_eq!(m, vec![vec![0.0, 1.0, 1.0], vec![1.0, 0.0, 0.0]]);
    }

    #[test]
    fn masked_mean_divides_by_the_mask_sum_on_the_device() {
        let x = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu).unwrap();
        let m = Tensor::new(&[[1f32, 0., 1.], [0., 0., 1.]], &Device::Cpu).unwrap();
        assert_eq!(
            scalar(&masked_mean(&x, &m).unwrap()).unwrap(),
            (10f32 / 3.0) as f64
        );
        let empty = m.zeros_like().unwrap();
        assert_eq!(scalar(&masked_mean(&x, &empty).unwrap()).unwrap(), 0.0);
    }
}
