//! The input structs of the loss: [`LossInputs`] with the per-channel inputs it carries
//! ([`HintInputs`], [`ReplayInputs`] = [`DpoInputs`] + [`TeacherKlInputs`]), and the
//! gradient-accumulation normaliser ([`LossScale`]).
//!
//! A leaf module: it imports nothing from the loss functions, so the channels (`rlvr`, `hint`,
//! `replay`) depend on it and never the other way round.
use crate::util::{check_float, check_shape, row_column, value};
use crate::{LossError, Result};
use candle_core::{DType, Tensor};

/// Everything the loss reads for one micro-batch of `B` completions padded to `T` tokens
/// (right padding). Modelled on PRIME-RL's `LossInputs`: named per-token tensors.
///
/// Only `trainer_logprobs` should carry gradients; every other tensor is detached inside the
/// loss functions whatever the caller passes.
#[derive(Debug, Clone)]
pub struct LossInputs {
    /// `[B, T]` log π(y_t) of the trainer's current weights, **with gradient**.
    pub trainer_logprobs: Tensor,
    /// `[B, T]` log π_old(y_t): the trainer's log-probs before this step's updates. `None`
    /// means "one update per generation" and is treated as `trainer_logprobs.detach()` (TRL).
    pub old_logprobs: Option<Tensor>,
    /// `[B, T]` log μ(y_t) recorded by the sampler at generation time. Used by the
    /// sampler/trainer mismatch correction and as PRIME-RL's `inference_logprobs`.
    pub sampler_logprobs: Option<Tensor>,
    /// `[B, T]` reference-model log-probs; only needed when the KL coefficient `beta != 0`.
    pub ref_logprobs: Option<Tensor>,
    /// `[B]` per-completion advantages, or `[B, T]` per-token advantages (accepted by every loss
    /// type; TRL/verl/PRIME-RL broadcast `[B]` to `[B, T]` the same way).
    pub advantages: Tensor,
    /// `[B, T]` 0/1 floats: which completion tokens are trained on (0 for padding, tool
    /// output, ...).
    pub loss_mask: Tensor,
    /// Per-completion truncation flags (`len == B`), read when `mask_truncated_completions`.
    pub truncated: Option<Vec<bool>>,
    /// `[B, T]` per-token entropies of the trainer's distribution (with gradient if the
    /// entropy bonus should train). Needed for `entropy_coef != 0`, `top_entropy_quantile < 1`
    /// and the entropy metric.
    pub entropies: Option<Tensor>,
    /// Inputs of the hint self-distillation channel (same `B`, `T` as above).
    pub hint: Option<HintInputs>,
    /// Inputs of the trace-replay channel (teacher traces: their own batch).
    pub replay: Option<ReplayInputs>,
}

impl LossInputs {
    /// Inputs with only the required tensors; set the optional fields directly.
    pub fn new(trainer_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor) -> Self {
        Self {
            trainer_logprobs,
            old_logprobs: None,
            sampler_logprobs: None,
            ref_logprobs: None,
            advantages,
            loss_mask,
            truncated: None,
            entropies: None,
            hint: None,
            replay: None,
        }
    }

    /// `(B, T)` of this micro-batch.
    pub fn dims(&self) -> Result<(usize, usize)> {
        self.trainer_logprobs.dims2().map_err(|_| LossError::Shape {
            tensor: "trainer_logprobs",
            expected: "[B, T]".into(),
            got: self.trainer_logprobs.dims().to_vec(),
        })
    }

    /// Check every present tensor against `[B, T]` / `[B]` and the dtypes.
    pub fn validate(&self) -> Result<(usize, usize)> {
        let (b, t) = self.dims()?;
        check_float(&self.trainer_logprobs, "trainer_logprobs")?;
        if self.advantages.dims() != [b, t] {
            check_shape(&self.advantages, "advantages", &[b])?;
        }
        check_shape(&self.loss_mask, "loss_mask", &[b, t])?;
        for (name, x) in [
            ("old_logprobs", &self.old_logprobs),
            ("sampler_logprobs", &self.sampler_logprobs),
            ("ref_logprobs", &self.ref_logprobs),
            ("entropies", &self.entropies),
        ] {
            if let Some(x) = x {
                check_shape(x, name, &[b, t])?;
            }
        }
        if let Some(tr) = &self.truncated {
            if tr.len() != b {
                return Err(LossError::Input {
                    field: "truncated",
                    message: format!("has {} flags for a batch of {b}", tr.len()),
                });
            }
        }
        Ok((b, t))
    }

    /// The advantages as a `[B, T]` tensor on their device (a `[B]` tensor is repeated over
    /// each row).
    pub fn advantage_tensor(&self) -> Result<Tensor> {
        let (b, t) = self.dims()?;
        if self.advantages.rank() == 2 {
            return Ok(self.advantages.detach());
        }
        Ok(self
            .advantages
            .detach()
            .unsqueeze(1)?
            .broadcast_as((b, t))?
            .contiguous()?)
    }

    /// The effective `[B, T]` loss mask, on the mask's device: `loss_mask`, with truncated
    /// completions zeroed when `mask_truncated_completions` (TRL zeroes their
    /// `completion_mask`).
    pub fn effective_mask(&self, mask_truncated_completions: bool) -> Result<Tensor> {
        let m = self.loss_mask.detach();
        match (&self.truncated, mask_truncated_completions) {
            (Some(tr), true) => {
                let keep: Vec<f64> = tr.iter().map(|&x| if x { 0.0 } else { 1.0 }).collect();
                Ok(m.broadcast_mul(&row_column(&keep, &m)?)?)
            }
            _ => Ok(m),
        }
    }
}

/// Normalisers that span the whole optimizer step (all gradient-accumulation micro-batches),
/// so that accumulating micro-batch losses equals the loss of one big batch.
///
/// * `dapo`, `cispo`, `vespo`, `dppo` and verl's `token-mean` divide by
///   `global_active_tokens` (TRL's `num_items_in_batch`, PRIME-RL's `rl_scale`).
/// * verl's `seq-mean-*` modes divide by `global_sequences`.
/// * `grpo`, `bnpo`, `dr_grpo`, `luspo`, `sapo` are per-micro-batch means divided by
///   `num_micro_batches` (TRL divides by `gradient_accumulation_steps`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    /// Active (mask = 1) completion tokens summed over all micro-batches of the step.
    pub global_active_tokens: f64,
    /// Sequences with at least one active token, over all micro-batches of the step.
    pub global_sequences: f64,
    /// Number of gradient-accumulation micro-batches in the step.
    pub num_micro_batches: f64,
}

impl LossScale {
    /// The normaliser of a single micro-batch that is the whole step (no accumulation).
    pub fn local(inputs: &LossInputs, mask_truncated_completions: bool) -> Result<Self> {
        Self::from_micro_batches(&[inputs], mask_truncated_completions)
    }

    /// The normaliser of a step made of these micro-batches.
    pub fn from_micro_batches(
        micro_batches: &[&LossInputs],
        mask_truncated_completions: bool,
    ) -> Result<Self> {
        let mut tokens = 0.0;
        let mut seqs = 0.0;
        for mb in micro_batches {
            let per_row = mb.effective_mask(mask_truncated_completions)?.sum(1)?;
            tokens += value(&per_row.sum_all()?)?;
            seqs += value(&per_row.gt(0.0)?.to_dtype(DType::F64)?.sum_all()?)?;
        }
        Ok(Self {
            global_active_tokens: tokens,
            global_sequences: seqs,
            num_micro_batches: micro_batches.len().max(1) as f64,
        })
    }
}

/// Per-token inputs of the hint channel (same `B`, `T` as the RLVR batch: the student's own
/// completions re-scored by the hinted teacher).
#[derive(Debug, Clone)]
pub struct HintInputs {
    /// `[B, T, K]` student log-probs at its top-K ids, **with gradient** (or `[B, T, V]` full
    /// distributions with `support = full`). Not needed for `sampled_token`.
    pub student_topk_logprobs: Option<Tensor>,
    /// `[B, T, K]` teacher log-probs at the *same* ids (or `[B, T, V]`).
    pub teacher_topk_logprobs: Option<Tensor>,
    /// `[B, T, K]` the top-K token ids (u32), informational (the teacher was scored at them).
    pub topk_ids: Option<Tensor>,
    /// `[B, T]` teacher log-prob of the sampled token; needed for `sampled_token`.
    pub teacher_token_logprobs: Option<Tensor>,
    /// Per sample: whether it received a hint (samples without one are excluded).
    pub has_hint: Vec<bool>,
}

/// Sequence-level inputs of DPO for P pairs. Build the sums with [`crate::replay::sequence_logprobs`].
#[derive(Debug, Clone)]
pub struct DpoInputs {
    /// `[P]` Σ_t log π(chosen), **with gradient**.
    pub policy_chosen_logps: Tensor,
    /// `[P]` Σ_t log π(rejected), **with gradient**.
    pub policy_rejected_logps: Tensor,
    /// `[P]` reference sums on the chosen (frozen reference model, or the teacher's recorded
    /// token log-probs, see `Trace::recorded_token_logprobs`).
    pub ref_chosen_logps: Tensor,
    /// `[P]` reference sums on the rejected (frozen reference, or the sampler's log-probs).
    pub ref_rejected_logps: Tensor,
    /// Completion lengths of the chosen (for `ipo`).
    pub chosen_lengths: Vec<usize>,
    /// Completion lengths of the rejected (for `ipo`).
    pub rejected_lengths: Vec<usize>,
}

/// Inputs of the teacher-KL replay loss on a batch of teacher traces.
#[derive(Debug, Clone)]
pub struct TeacherKlInputs {
    /// `[B, T, K]` the student's log-probs at the teacher's recorded top-K ids, **with gradient**.
    pub student_topk_logprobs: Tensor,
    /// `[B, T, K]` the teacher's recorded log-probs (see `traces::collate_topk`).
    pub teacher_topk_logprobs: Tensor,
    /// `[B, T]` 0/1 mask of real completion positions.
    pub loss_mask: Tensor,
    /// Teacher name per trace (`len == B`), for the per-teacher weights.
    pub teachers: Vec<String>,
}

/// Inputs of the replay channel; either part may be absent (then it contributes nothing).
#[derive(Debug, Clone, Default)]
pub struct ReplayInputs {
    /// Preference pairs.
    pub dpo: Option<DpoInputs>,
    /// Teacher traces' top-K distributions.
    pub teacher_kl: Option<TeacherKlInputs>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn effective_mask_and_advantages_are_tensors_on_the_inputs_device() {
        let dev = Device::Cpu;
        let lp = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
        let mask = Tensor::new(
            &[[1f32, 1., 0., 0.], [1., 1., 1., 1.], [1., 0., 0., 0.]],
            &dev,
        )
        .unwrap();
        let adv = Tensor::new(&[0.5f32, -1.0, 2.0], &dev).unwrap();
        let mut inputs = LossInputs::new(lp, adv, mask.clone());
        inputs.truncated = Some(vec![false, true, false]);
        let kept = inputs.effective_mask(true).unwrap();
        assert!(kept.device().same_device(&dev));
        assert_eq!(
            kept.to_vec2::<f32>().unwrap(),
            vec![
                vec![1., 1., 0., 0.],
                vec![0., 0., 0., 0.],
                vec![1., 0., 0., 0.]
            ]
        );
        assert_eq!(
            inputs
                .effective_mask(false)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap(),
            mask.to_vec2::<f32>().unwrap()
        );
        let a = inputs.advantage_tensor().unwrap();
        assert_eq!(a.dims(), &[3, 4]);
        assert_eq!(a.to_vec2::<f32>().unwrap()[1], vec![-1.0; 4]);
        let scale = LossScale::local(&inputs, true).unwrap();
        assert_eq!(
            (scale.global_active_tokens, scale.global_sequences),
            (3.0, 2.0)
        );
        let scale = LossScale::local(&inputs, false).unwrap();
        assert_eq!(
            (scale.global_active_tokens, scale.global_sequences),
            (7.0, 3.0)
        );
    }
}
