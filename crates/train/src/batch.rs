//! Teacher-forcing batches and the per-token quantities the loss reads, all computed on the
//! tensors' device (nothing of size `[B, L, V]` is copied to the host).

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};

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
    }
    Ok(TokenBatch {
        input: Tensor::from_vec(input, (b, l), device)?,
        targets: Tensor::from_vec(targets, (b, l), device)?,
        mask: Tensor::from_vec(mask, (b, l), device)?,
        completion_positions: positions,
        len: l,
    })
}

/// Per-token log-probs of the targets `[B, L]` and the full log-softmax `[B, L, V]` of
/// `model`, at temperature `t` (logits divided by t, as TRL's trainer does). Differentiable.
pub fn token_logprobs(
    model: &PolicyModel,
    batch: &TokenBatch,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    let logits = model.forward(&batch.input)?;
    let logits = if temperature > 0.0 && temperature != 1.0 {
        (logits / temperature)?
    } else {
        logits
    };
    let ls = composer_model::log_softmax(&logits)?;
    let lp = ls.gather(&batch.targets.unsqueeze(2)?, 2)?.squeeze(2)?;
    Ok((lp, ls))
}

/// Per-token entropy `[B, L]` of log-probs `[B, L, V]`.
pub fn entropies(ls: &Tensor) -> Result<Tensor> {
    Ok((ls.exp()? * ls)?.sum(D::Minus1)?.neg()?)
}

/// The `k` most likely token ids per position `[B, L, K]` (u32) of log-probs `[B, L, V]`,
/// selected on the tensor's device.
pub fn topk_ids(ls: &Tensor, k: usize) -> Result<Tensor> {
    let v = ls.dim(D::Minus1)?;
    let order = ls.detach().contiguous()?.arg_sort_last_dim(false)?;
    Ok(order.narrow(D::Minus1, 0, k.min(v))?.contiguous()?)
}

/// Sum of masked values divided by the mask's sum (0 when the mask is empty).
pub fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let n = mask.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    let s = (x * mask)?.sum_all()?;
    Ok((s / (n.max(1.0) as f64))?)
}

/// f32 scalar value.
pub fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topk_ids_are_the_k_largest_in_order_and_stay_on_the_device() {
        let v: Vec<f32> = vec![0.1, 2.0, -1.0, 0.5, 3.0, 1.5, -2.0, 0.0];
        let t = Tensor::from_vec(v, (1, 2, 4), &Device::Cpu).unwrap();
        let ids = topk_ids(&t, 2).unwrap();
        assert_eq!(ids.dims(), &[1, 2, 2]);
        assert!(ids.device().same_device(t.device()));
        assert_eq!(
            ids.to_vec3::<u32>().unwrap(),
            vec![vec![vec![1, 3], vec![0, 1]]]
        );
    }

    #[test]
    fn token_batch_masks_completion_targets_only() {
        let tb = token_batch(&[(&[5, 6], &[7, 8]), (&[5], &[9])], 0, &Device::Cpu).unwrap();
        assert_eq!(tb.len, 3);
        assert_eq!(tb.completion_positions, vec![vec![1, 2], vec![3]]);
        let m: Vec<Vec<f32>> = tb.mask.to_vec2().unwrap();
        assert_eq!(m, vec![vec![0.0, 1.0, 1.0], vec![1.0, 0.0, 0.0]]);
    }
}
