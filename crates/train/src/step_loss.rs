//! One micro-batch's loss: the trainer turns rollouts, hint prompts, teacher traces and the
//! reference policy into composer-loss's [`LossInputs`] and calls
//! [`composer_loss::composer_loss`] for all three channels. No loss maths lives here: only
//! forward passes, gathers and index bookkeeping, all on the tensors' device.

use anyhow::{Context, Result};
use candle_core::Tensor;
use composer_loss::{
    composer_loss, sequence_logprobs, ComposerConfig, DpoConfig, DpoInputs, HintInputs, LossInputs,
    LossScale, ReplayConfig, ReplayInputs, TeacherKlInputs,
};

use crate::batch::{self, scalar, TokenBatch};
use crate::rewards::Rewards;
use crate::sampling::Rollout;
use crate::sampling::RolloutBatch;
use crate::session::Session;

/// Per micro-batch tensors fixed before the first update (μ > 1): the old log-probs.
pub struct Frozen {
    /// `[B, L]` log π_old of the rollouts.
    pub old_logprobs: Option<Tensor>,
}

/// One micro-batch's combined loss `L_rlvr + α·L_hint + β·L_replay` and its parts.
pub struct MicroOut {
    /// The loss (with gradient).
    pub loss: Tensor,
    /// RLVR channel value (this micro-batch's share × the number of micro-batches).
    pub rlvr: f64,
    /// Hint channel value (unweighted).
    pub hint: f64,
    /// Replay channel value (unweighted).
    pub replay: f64,
    /// Its DPO part.
    pub dpo: f64,
    /// Its teacher-KL part.
    pub teacher_kl: f64,
    /// KL to the reference (`beta != 0`), else 0.
    pub kl: f64,
    /// Max |log π_old − log μ| over the micro-batch's trained tokens.
    pub mismatch_max_abs: f64,
    /// k3 sampler/trainer KL, mean over the micro-batch's trained tokens.
    pub mismatch_kl: f64,
    /// Mean token entropy.
    pub entropy: f64,
    /// Clip fractions.
    pub clip_low: f64,
    /// Clip fractions.
    pub clip_high: f64,
    /// Samples with a hint.
    pub hinted: usize,
    /// DPO pairs.
    pub dpo_pairs: usize,
}

/// Builds the micro-batch `idx`'s loss. With `freeze_only`, returns only the detached old
/// log-probs instead (the μ > 1 pre-pass).
#[allow(clippy::too_many_arguments)]
pub fn micro_loss(
    s: &Session,
    idx: &[usize],
    batch: &RolloutBatch,
    rewards: &Rewards,
    advantages: &[f64],
    hint_ids: &[Option<Vec<u32>>],
    frozen: Option<&Frozen>,
    freeze_only: bool,
    rlvr_scale: Option<&LossScale>,
) -> Result<(Option<MicroOut>, Option<Tensor>)> {
    let dev = s.model.device().clone();
    let temp = s.recipe.rollout.temperature;
    let temp = if temp > 0.0 { temp } else { 1.0 };
    let samples: Vec<&Rollout> = idx.iter().map(|&i| &batch.samples[i]).collect();
    let tb = rollout_batch_tensors(s, &samples)?;
    let (b, l) = tb.input.dims2()?;
    // Deterministic mode: log π_old comes from the batch-invariant scorer, equal bitwise to
    // the deterministic sampler's log-probs.
    let det_old = if s.recipe.rollout.deterministic {
        Some(deterministic_old_logprobs(s, &samples, &tb, temp)?)
    } else {
        None
    };
    if freeze_only && det_old.is_some() {
        return Ok((None, det_old));
    }
    if freeze_only {
        let st = batch::token_stats(&s.model, &tb, temp, None, 0)?;
        return Ok((None, Some(st.logprobs.detach())));
    }
    // The hint channel reads the student's own top-K at each completion position.
    let alpha = s.recipe.loss.hint_weight;
    let has_hint: Vec<bool> = idx.iter().map(|&i| hint_ids[i].is_some()).collect();
    let hinted = has_hint.iter().filter(|h| **h).count();
    let hint_on = alpha > 0.0 && hinted > 0;
    let top_k = if hint_on {
        s.recipe.loss.hint.top_k.min(s.model.vocab_size())
    } else {
        0
    };
    let st = batch::token_stats(&s.model, &tb, temp, None, top_k)?;
    let lp = st.logprobs.clone();

    // RLVR inputs.
    let mut sampler = vec![0f32; b * l];
    for (r, smp) in samples.iter().enumerate() {
        for (k, &pos) in tb.completion_positions[r].iter().enumerate() {
            sampler[pos] = smp.sampler_logprobs[k];
        }
    }
    let sampler = Tensor::from_vec(sampler, (b, l), &dev)?;
    let adv: Vec<f32> = idx.iter().map(|&i| advantages[i] as f32).collect();
    let adv = Tensor::from_vec(adv, b, &dev)?;
    let entropies = st.entropy.clone();
    let mut inputs = LossInputs::new(lp.clone(), adv, tb.mask.clone());
    inputs.old_logprobs = frozen.and_then(|f| f.old_logprobs.clone()).or(det_old);
    inputs.sampler_logprobs = Some(sampler);
    inputs.truncated = Some(samples.iter().map(|x| x.truncated).collect());
    inputs.entropies = Some(entropies.clone());
    let mut rlvr = s.recipe.loss.rlvr.clone();
    rlvr.max_completion_length = s.recipe.rollout.max_completion_length;
    // The step's normaliser (global token count across gradient-accumulation micro-batches),
    // or this micro-batch alone.
    let scale = match rlvr_scale {
        Some(sc) => *sc,
        None => LossScale::local(&inputs, rlvr.mask_truncated_completions)?,
    };
    // Hint and replay are per-micro-batch means: averaged over the step's micro-batches.
    let per_micro = 1.0 / scale.num_micro_batches;

    // Teacher traces of this micro-batch's prompts: chosen = passing trace, rejected =
    // failing rollouts of the same prompt.
    let trace_ids = traces_of(s, idx, batch);
    let mut pairs: Vec<(usize, usize)> = Vec::new(); // (trace row, rollout row)
    for (ti, &t) in trace_ids.iter().enumerate() {
        for (r, &i) in idx.iter().enumerate() {
            if !rewards.passed[i] && batch.samples[i].prompt_ids == s.traces[t].prompt_ids {
                pairs.push((ti, r));
            }
        }
    }
    let dpo_on = s.recipe.loss.replay.dpo_weight > 0.0 && !pairs.is_empty();

    // The frozen reference policy: KL term (beta != 0) and DPO's rejected rollouts.
    let reference = if s.recipe.loss.rlvr.beta != 0.0 || dpo_on {
        Some(
            s.reference
                .as_ref()
                .context("the loss needs a reference policy but none was built")?,
        )
    } else {
        None
    };
    let ref_lp = match reference {
        Some(r) => Some(batch::token_stats(r, &tb, temp, None, 0)?.logprobs.detach()),
        None => None,
    };
    if s.recipe.loss.rlvr.beta != 0.0 {
        inputs.ref_logprobs = ref_lp.clone();
    }

    // Hint: the same weights score the student's completion after the hinted prompt.
    if hint_on {
        inputs.hint = Some(hint_inputs(
            s, idx, &samples, hint_ids, &tb, &st, temp, has_hint,
        )?);
    }

    // Replay: DPO on (passing teacher trace, failing rollout) pairs + forward KL to the
    // teachers' recorded top-K on the traces (log-probs at temperature 1, as recorded).
    if s.recipe.loss.replay_weight > 0.0 && !trace_ids.is_empty() {
        let trace_pairs: Vec<(&[u32], &[u32])> = trace_ids
            .iter()
            .map(|&t| {
                (
                    s.traces[t].prompt_ids.as_slice(),
                    s.traces[t].completion_ids.as_slice(),
                )
            })
            .collect();
        let mut ttb = batch::token_batch(&trace_pairs, s.eos, &dev)?;
        // A multi-turn teacher episode's tool results are the environment's: not trained.
        let trace_masks: Vec<Option<&[u8]>> = trace_ids
            .iter()
            .map(|&t| s.traces[t].loss_mask.as_deref())
            .collect();
        mask_completions(&mut ttb, &trace_masks)?;
        let mut replay = ReplayInputs::default();
        // The student's log-probs at the teachers' recorded top-K ids come out of the same
        // fused pass as the trace tokens' log-probs.
        let recorded = if s.recipe.loss.replay.kl_weight > 0.0 {
            Some(recorded_topk(s, &trace_ids, &ttb)?)
        } else {
            None
        };
        let tst = batch::token_stats(
            &s.model,
            &ttb,
            1.0,
            recorded.as_ref().map(|(ids, _)| ids),
            0,
        )?;
        let tlp = tst.logprobs;
        if let (Some((_, teacher_lps)), Some(student)) = (recorded, tst.at_ids) {
            replay.teacher_kl = Some(TeacherKlInputs {
                student_topk_logprobs: student,
                teacher_topk_logprobs: teacher_lps,
                loss_mask: ttb.mask.clone(),
                teachers: trace_ids
                    .iter()
                    .map(|&t| s.traces[t].teacher.clone())
                    .collect(),
            });
        }
        if dpo_on {
            let reference = reference.context("DPO needs the reference policy")?;
            let ref_lp = ref_lp.as_ref().context("DPO needs reference log-probs")?;
            let ref_tlp = batch::token_stats(reference, &ttb, 1.0, None, 0)?.logprobs;
            let pc = Tensor::from_vec(
                pairs.iter().map(|p| p.0 as u32).collect::<Vec<_>>(),
                pairs.len(),
                &dev,
            )?;
            let pr = Tensor::from_vec(
                pairs.iter().map(|p| p.1 as u32).collect::<Vec<_>>(),
                pairs.len(),
                &dev,
            )?;
            let seq = |x: &Tensor, m: &Tensor, rows: &Tensor| -> Result<Tensor> {
                Ok(sequence_logprobs(x, m)?.index_select(rows, 0)?)
            };
            replay.dpo = Some(DpoInputs {
                policy_chosen_logps: seq(&tlp, &ttb.mask, &pc)?,
                ref_chosen_logps: seq(&ref_tlp.detach(), &ttb.mask, &pc)?,
                policy_rejected_logps: seq(&lp, &tb.mask, &pr)?,
                ref_rejected_logps: seq(ref_lp, &tb.mask, &pr)?,
                chosen_lengths: pairs
                    .iter()
                    .map(|p| s.traces[trace_ids[p.0]].completion_ids.len())
                    .collect(),
                rejected_lengths: pairs
                    .iter()
                    .map(|p| samples[p.1].completion_ids.len())
                    .collect(),
            });
        }
        if replay.dpo.is_some() || replay.teacher_kl.is_some() {
            inputs.replay = Some(replay);
        }
    }

    let rc = &s.recipe.loss.replay;
    let cfg = ComposerConfig {
        use_rlvr: true,
        use_hint: inputs.hint.is_some(),
        use_replay: inputs.replay.is_some(),
        hint_coef: alpha * per_micro,
        replay_coef: s.recipe.loss.replay_weight * per_micro,
        rlvr,
        hint: s.recipe.loss.hint.config.clone(),
        replay: ReplayConfig {
            dpo: DpoConfig {
                beta: rc.dpo_beta,
                loss_type: rc.dpo_loss_type,
            },
            dpo_coef: rc.dpo_weight,
            kl_coef: rc.kl_weight,
            teacher_weights: s.teacher_weights.clone(),
            kl_loss_agg_mode: rc.kl_loss_agg_mode,
            ..Default::default()
        },
    };
    let (loss, m) = composer_loss(&inputs, &cfg, &scale).context("composer loss")?;
    let m_rlvr = m.rlvr.unwrap_or_default();
    let ent = scalar(&batch::masked_mean(&entropies.detach(), &tb.mask)?)?;
    let replay = m.replay.unwrap_or_default();
    Ok((
        Some(MicroOut {
            loss,
            // This micro-batch's share times their number: the mean over micro-batches is
            // the step's RLVR loss.
            rlvr: m_rlvr.loss * scale.num_micro_batches,
            hint: m.hint.map(|h| h.loss).unwrap_or(0.0),
            replay: replay.loss,
            dpo: replay.dpo.as_ref().map(|d| d.loss).unwrap_or(0.0),
            teacher_kl: replay.teacher_kl.as_ref().map(|k| k.loss).unwrap_or(0.0),
            kl: m_rlvr.kl.unwrap_or(0.0),
            mismatch_max_abs: m_rlvr.mismatch_max_abs.unwrap_or(0.0),
            mismatch_kl: m_rlvr.mismatch_kl.unwrap_or(0.0),
            entropy: ent,
            clip_low: m_rlvr.clip_ratio_low,
            clip_high: m_rlvr.clip_ratio_high,
            hinted,
            dpo_pairs: pairs.len(),
        }),
        None,
    ))
}

/// The teacher-forcing batch of rollouts, with environment observation tokens (multi-turn
/// episodes) masked out of the loss.
fn rollout_batch_tensors(s: &Session, samples: &[&Rollout]) -> Result<TokenBatch> {
    let pairs: Vec<(&[u32], &[u32])> = samples
        .iter()
        .map(|x| (x.prompt_ids.as_slice(), x.completion_ids.as_slice()))
        .collect();
    let dev = s.model.device();
    let mut tb = batch::token_batch(&pairs, s.eos, dev)?;
    let masks: Vec<Option<&[u8]>> = samples.iter().map(|x| x.loss_mask.as_deref()).collect();
    mask_completions(&mut tb, &masks)?;
    Ok(tb)
}

/// Zeroes `tb.mask` at the completion positions a per-row completion mask marks 0 (the
/// environment's tokens of a multi-turn episode: a rollout's or a teacher trace's).
fn mask_completions(tb: &mut TokenBatch, masks: &[Option<&[u8]>]) -> Result<()> {
    if masks.iter().all(Option::is_none) {
        return Ok(());
    }
    let (b, l) = tb.input.dims2()?;
    let mut keep = vec![1f32; b * l];
    for (r, mask) in masks.iter().enumerate() {
        if let Some(mask) = mask {
            for (k, &pos) in tb.completion_positions[r].iter().enumerate() {
                if mask.get(k) == Some(&0) {
                    keep[pos] = 0.0;
                }
            }
        }
    }
    let keep = Tensor::from_vec(keep, (b, l), tb.input.device())?.to_dtype(tb.mask.dtype())?;
    tb.mask = (&tb.mask * keep)?;
    Ok(())
}

/// Passing traces of the micro-batch's prompts (each prompt's group once).
fn traces_of(s: &Session, idx: &[usize], batch: &RolloutBatch) -> Vec<usize> {
    let mut out = Vec::new();
    if s.recipe.loss.replay_weight <= 0.0 || s.traces.is_empty() {
        return out;
    }
    let mut seen = std::collections::BTreeSet::new();
    for &i in idx {
        let smp = &batch.samples[i];
        if seen.insert(smp.group) {
            if let Some(ts) = s.traces_by_prompt.get(&smp.prompt_ids) {
                out.extend(ts.iter().copied());
            }
        }
    }
    out
}

/// Hint channel inputs: the same weights score the completion after the hinted prompt
/// (detached teacher) at the targets and at the student's top-K ids (selected on the device
/// in the student's fused pass `st`).
#[allow(clippy::too_many_arguments)]
fn hint_inputs(
    s: &Session,
    idx: &[usize],
    samples: &[&Rollout],
    hint_ids: &[Option<Vec<u32>>],
    tb: &TokenBatch,
    st: &batch::TokenStats,
    temp: f64,
    has_hint: Vec<bool>,
) -> Result<HintInputs> {
    let dev = s.model.device();
    let (b, l) = tb.input.dims2()?;
    let topk = st
        .topk_ids
        .clone()
        .context("the hint channel needs the student's top-K ids")?;
    let k = topk.dim(2)?;
    let tpairs: Vec<(&[u32], &[u32])> = idx
        .iter()
        .zip(samples)
        .map(|(&i, smp)| {
            (
                hint_ids[i].as_deref().unwrap_or(smp.prompt_ids.as_slice()),
                smp.completion_ids.as_slice(),
            )
        })
        .collect();
    let ttb = batch::token_batch(&tpairs, s.eos, dev)?;
    let (bt, lt) = ttb.input.dims2()?;
    // Each student position ↔ the teacher position predicting the same token.
    let mut to_teacher = vec![0u32; b * l];
    let mut to_student = vec![0u32; bt * lt];
    for r in 0..b {
        for (kk, &pos) in tb.completion_positions[r].iter().enumerate() {
            let tpos = ttb.completion_positions[r][kk];
            to_teacher[pos] = tpos as u32;
            to_student[tpos] = pos as u32;
        }
    }
    let to_teacher = Tensor::from_vec(to_teacher, b * l, dev)?;
    let to_student = Tensor::from_vec(to_student, bt * lt, dev)?;
    let teacher_ids = topk
        .reshape((b * l, k))?
        .index_select(&to_student, 0)?
        .reshape((bt, lt, k))?;
    let tst = batch::token_stats(&s.model, &ttb, temp, Some(&teacher_ids), 0)?;
    let at_student = |x: &Tensor, w: usize| -> Result<Tensor> {
        Ok(x.detach()
            .reshape((bt * lt, w))?
            .index_select(&to_teacher, 0)?
            .reshape((b, l, w))?)
    };
    let teacher_topk = tst
        .at_ids
        .context("teacher log-probs at the student's top-K")?;
    Ok(HintInputs {
        student_topk_logprobs: st.topk_logprobs.clone(),
        teacher_topk_logprobs: Some(at_student(&teacher_topk, k)?),
        topk_ids: Some(topk),
        teacher_token_logprobs: Some(at_student(&tst.logprobs, 1)?.squeeze(2)?),
        has_hint,
    })
}

/// The teachers' recorded top-K ids `[Bt, Lt, K]` of each trace position and their recorded
/// log-probs (positions with fewer than K recorded ids are padded with a log-prob of −1e4,
/// i.e. no mass).
fn recorded_topk(s: &Session, trace_ids: &[usize], ttb: &TokenBatch) -> Result<(Tensor, Tensor)> {
    let (bt, lt) = ttb.input.dims2()?;
    let kmax = trace_ids
        .iter()
        .flat_map(|&t| s.traces[t].topk_ids.iter().map(|x| x.len()))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut ids = vec![0u32; bt * lt * kmax];
    let mut tlps = vec![-1e4f32; bt * lt * kmax];
    for (r, &t) in trace_ids.iter().enumerate() {
        let tr = &s.traces[t];
        for (kk, &pos) in ttb.completion_positions[r].iter().enumerate() {
            for (j, (&id, &lpv)) in tr.topk_ids[kk]
                .iter()
                .zip(&tr.topk_logprobs[kk])
                .enumerate()
            {
                ids[pos * kmax + j] = id;
                tlps[pos * kmax + j] = lpv;
            }
        }
    }
    let dev = s.model.device();
    Ok((
        Tensor::from_vec(ids, (bt, lt, kmax), dev)?,
        Tensor::from_vec(tlps, (bt, lt, kmax), dev)?,
    ))
}

/// `[B, L]` log π_old of the rollouts' completion tokens (0 elsewhere) from composer-model's
/// batch-invariant scorer at the sampling temperature.
fn deterministic_old_logprobs(
    s: &Session,
    samples: &[&Rollout],
    tb: &TokenBatch,
    temperature: f64,
) -> Result<Tensor> {
    let (b, l) = tb.input.dims2()?;
    let seqs: Vec<Vec<u32>> = samples
        .iter()
        .map(|x| [x.prompt_ids.as_slice(), &x.completion_ids].concat())
        .collect();
    let scored = composer_model::score_deterministic(&s.model.transformer, &seqs, temperature)?;
    let mut old = vec![0f32; b * l];
    for (r, (smp, lps)) in samples.iter().zip(&scored).enumerate() {
        for (k, &pos) in tb.completion_positions[r].iter().enumerate() {
            old[pos] = lps[smp.prompt_ids.len() - 1 + k];
        }
    }
    Ok(Tensor::from_vec(old, (b, l), s.model.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_masks_zero_only_the_marked_positions() {
        // Row 0: a multi-turn trace whose second completion token is a tool result; row 1:
        // no mask (every completion token trained).
        let pairs: Vec<(&[u32], &[u32])> = vec![(&[1, 2], &[3, 4, 5]), (&[1], &[6, 7])];
        let mut tb = batch::token_batch(&pairs, 0, &candle_core::Device::Cpu).unwrap();
        let before = tb.mask.to_vec2::<f32>().unwrap();
        mask_completions(&mut tb, &[Some(&[1, 0, 1]), None]).unwrap();
        let after = tb.mask.to_vec2::<f32>().unwrap();
        let l = tb.len;
        let masked = tb.completion_positions[0][1];
        for (r, row) in after.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                let want = if r * l + j == masked {
                    0.0
                } else {
                    before[r][j]
                };
                assert_eq!(v, want, "row {r} position {j}");
            }
        }
        assert_eq!(after.iter().flatten().sum::<f32>(), 4.0);
    }
}
