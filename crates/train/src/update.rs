//! The update of a step: hint prompts, mini-/micro-batches, μ passes of optimizer steps
//! with gradient accumulation (the loss of each micro-batch is built by
//! [`crate::step_loss::micro_loss`]), the non-finite guard; and the supervised warm-up.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::Tensor;
use composer_loss::hint::{build_hint_prompts, RolloutForHint};
use composer_loss::LossScale;

use crate::batch::{self, scalar};
use crate::data::SftRow;
use crate::optim::{self, AdamW};
use crate::rewards::Rewards;
use crate::sampling::RolloutBatch;
use crate::seed::mix_seed;
use crate::session::Session;
use crate::step_loss::{micro_loss, Frozen};
use crate::tokenizer as chartok;

/// What one `train_on_batch` did.
#[derive(Debug, Default, Clone)]
pub struct TrainStats {
    /// Mean RLVR loss over micro-batches.
    pub loss_rlvr: f64,
    /// Mean hint loss.
    pub loss_hint: f64,
    /// Mean replay loss (DPO + token KL, weighted).
    pub loss_replay: f64,
    /// Mean DPO part.
    pub loss_dpo: f64,
    /// Mean token-KL part.
    pub loss_teacher_kl: f64,
    /// RLVR's KL to the reference (0 without one).
    pub kl: f64,
    /// Max |log π_old − log μ| over every trained token of the step.
    pub mismatch_max_abs: f64,
    /// k3 sampler/trainer KL, mean over micro-batches.
    pub mismatch_kl: f64,
    /// Mean token entropy.
    pub entropy: f64,
    /// Clip fractions.
    pub clip_low: f64,
    /// Clip fractions.
    pub clip_high: f64,
    /// Last pre-clip gradient norm.
    pub grad_norm: f64,
    /// Last learning rate.
    pub lr: f64,
    /// Optimizer steps taken.
    pub updates: usize,
    /// A non-finite loss or gradient made this step skip its updates.
    pub non_finite: bool,
    /// Samples that received a hint.
    pub hinted: usize,
    /// DPO pairs.
    pub dpo_pairs: usize,
}

/// Supervised warm-up: cross-entropy on completion tokens (+ EOS) only, constant lr, its own
/// AdamW. Returns the last step's loss.
pub fn warmup(s: &mut Session, w: &crate::recipe::WarmupSection) -> Result<f64> {
    let rows: Vec<SftRow> = match &s.warmup_rows {
        Some(rows) => rows.clone(),
        None => s
            .train_rows
            .iter()
            .map(|r| SftRow {
                prompt: r.prompt.clone(),
                completion: r.answer.clone(),
            })
            .collect(),
    };
    let seed = s.recipe.train.seed;
    let mut opt = AdamW::new(s.opt.vars.clone(), s.opt.params)?;
    let tmpl = &s.recipe.loss.hint.template;
    let mut last = f64::NAN;
    let signal_at = crate::test_hooks::hook_steps(crate::test_hooks::WARMUP_SIGINT_HOOK_ENV);
    for step in 0..w.steps {
        if signal_at.contains(&step) {
            crate::signals::raise(crate::signals::Interrupt::Sigint);
        }
        if crate::signals::pending().is_some() {
            // The caller reports it; the partial warm-up is not kept.
            break;
        }
        let mut pairs_owned = Vec::with_capacity(w.batch_size);
        for i in 0..w.batch_size {
            let r = mix_seed(seed, 2_000_000_000 + step as u64, i as u64);
            let row = &rows[(r % rows.len() as u64) as usize];
            // A fraction of generated examples is shown in the hint format so the model learns
            // to read a hint (the hinted teacher of the hint channel).
            let hinted =
                w.dataset.is_none() && ((r >> 32) as f64 / u32::MAX as f64) < w.hint_fraction;
            let prompt = if hinted {
                tmpl.reprompt
                    .replace(
                        "{solution}",
                        &tmpl
                            .solution
                            .replace("{successful_previous_attempt}", &row.completion),
                    )
                    .replace("{feedback}", "")
                    .replace("{prompt}", &row.prompt)
            } else {
                row.prompt.clone()
            };
            let p = chartok::encode(&s.tok, &prompt)?;
            let mut c = chartok::encode(&s.tok, &row.completion)?;
            c.push(s.eos);
            pairs_owned.push((p, c));
        }
        let pairs: Vec<(&[u32], &[u32])> = pairs_owned
            .iter()
            .map(|(p, c)| (p.as_slice(), c.as_slice()))
            .collect();
        let tb = batch::token_batch(&pairs, s.eos, s.model.device())?;
        let lp = batch::token_stats(&s.model, &tb, 1.0, None, 0)?.logprobs;
        let loss = batch::masked_mean(&lp.neg()?, &tb.mask)?;
        last = scalar(&loss)?;
        let mut grads = s.model.master_grads(&loss.backward()?)?;
        let names: Vec<String> = opt.vars.iter().map(|(n, _)| n.clone()).collect();
        let norm = optim::grad_norm(&names, &grads)?;
        if !last.is_finite() || !norm.is_finite() {
            continue;
        }
        optim::clip_grads(&mut grads, norm, s.recipe.optimizer.max_grad_norm)?;
        opt.step(&grads, w.lr)?;
        s.model.refresh_compute()?;
    }
    Ok(last)
}

/// μ passes over the batch; each pass splits it into `mini_batches` optimizer steps (by prompt
/// group), each accumulating gradients over `gradient_accumulation_steps` micro-batches (split
/// further to `max_tokens_per_microbatch` tokens each when set).
pub fn train_on_batch(
    s: &mut Session,
    step: usize,
    batch: &RolloutBatch,
    rewards: &Rewards,
    advantages: &[f64],
    inject_nan: bool,
) -> Result<TrainStats> {
    let g = s.recipe.rollout.num_generations;
    let n_groups = batch.prompts.len();
    let tr = s.recipe.train.clone();
    s.ensure_reference()?;
    // LoRA dropout masks of this step: a function of (seed, step), like every other draw.
    s.model
        .transformer
        .reseed_lora_dropout(crate::seed::mix_seed(
            tr.seed,
            step as u64,
            crate::model::LORA_SEED_STREAM,
        ))?;

    // Hint prompts: for each sample, the teacher prompt with a successful peer's completion.
    let mut hint_ids: Vec<Option<Vec<u32>>> = vec![None; batch.samples.len()];
    if s.recipe.loss.hint_weight > 0.0 {
        for gi in 0..n_groups {
            // Env rollouts: the prompt the student saw and the env's feedback (e.g. the
            // failing test); otherwise the `[data]` prompt row, without feedback.
            let env_group = s
                .env_rollout
                .as_ref()
                .and_then(|e| e.hint_group(batch, rewards, gi, g));
            let group: Vec<RolloutForHint> = match env_group {
                Some(group) => group,
                None => {
                    let prompt_text = &s.train_rows[batch.prompts[gi]].prompt;
                    (gi * g..(gi + 1) * g)
                        .map(|i| RolloutForHint {
                            prompt_text: prompt_text.clone(),
                            completion_text: batch.texts[i].clone(),
                            reward: rewards.total[i],
                            passed: rewards.passed[i],
                            feedback: None,
                        })
                        .collect()
                }
            };
            for (k, hp) in build_hint_prompts(&group, &s.recipe.loss.hint.template)
                .into_iter()
                .enumerate()
            {
                let i = gi * g + k;
                if s.recipe.loss.hint.only_failed && rewards.passed[i] {
                    continue;
                }
                if let Some(text) = hp {
                    hint_ids[i] = Some(chartok::encode(&s.tok, &text)?);
                }
            }
        }
    }

    // Mini-batches and micro-batches as lists of sample indices (whole groups), each
    // micro-batch split further by the token budget when one is set.
    let groups_per_mb = n_groups.div_ceil(tr.mini_batches);
    let row_len = |i: usize| {
        let smp = &batch.samples[i];
        (smp.prompt_ids.len() + smp.completion_ids.len()).saturating_sub(1)
    };
    let mini: Vec<Vec<Vec<usize>>> = (0..n_groups)
        .collect::<Vec<_>>()
        .chunks(groups_per_mb.max(1))
        .map(|gs| {
            let per_micro = gs.len().div_ceil(tr.gradient_accumulation_steps).max(1);
            gs.chunks(per_micro)
                .flat_map(|c| {
                    let micro: Vec<usize> = c.iter().flat_map(|&gi| gi * g..(gi + 1) * g).collect();
                    match tr.max_tokens_per_microbatch {
                        Some(budget) => split_by_tokens(&micro, &row_len, budget, !tr.padding_free),
                        None => vec![micro],
                    }
                })
                .collect()
        })
        .collect();

    // Old log-probs (and DPO reference) recomputed once before the first update when μ > 1;
    // with μ = 1 the detached current values are used (ratio 1 at the single update).
    let mut frozen: Vec<Vec<Frozen>> = Vec::new();
    for mb in &mini {
        let mut v = Vec::new();
        for micro in mb {
            let old_logprobs = if tr.num_iterations > 1 {
                micro_loss(
                    s, micro, batch, rewards, advantages, &hint_ids, None, true, None,
                )?
                .1
            } else {
                None
            };
            v.push(Frozen { old_logprobs });
        }
        frozen.push(v);
    }

    let names: Vec<String> = s.opt.vars.iter().map(|(n, _)| n.clone()).collect();
    let mut stats = TrainStats::default();
    let mut n_micro = 0f64;
    let total_updates = tr.steps * tr.num_iterations * tr.mini_batches;
    for _pass in 0..tr.num_iterations {
        for (mb_i, mb) in mini.iter().enumerate() {
            let mut grads: HashMap<String, Tensor> = HashMap::new();
            let mut finite = true;
            let scale = optimizer_step_scale(s, batch, mb);
            for (mi, micro) in mb.iter().enumerate() {
                let fz = &frozen[mb_i][mi];
                let (out, _) = micro_loss(
                    s,
                    micro,
                    batch,
                    rewards,
                    advantages,
                    &hint_ids,
                    Some(fz),
                    false,
                    Some(&scale),
                )?;
                let Some(out) = out else { continue };
                let loss = if inject_nan {
                    (&out.loss * f64::NAN)?
                } else {
                    out.loss.clone()
                };
                let value = scalar(&loss)?;
                stats.loss_rlvr += out.rlvr;
                stats.loss_hint += out.hint;
                stats.loss_replay += out.replay;
                stats.loss_dpo += out.dpo;
                stats.loss_teacher_kl += out.teacher_kl;
                stats.kl += out.kl;
                stats.mismatch_max_abs = stats.mismatch_max_abs.max(out.mismatch_max_abs);
                stats.mismatch_kl += out.mismatch_kl;
                stats.entropy += out.entropy;
                stats.clip_low += out.clip_low;
                stats.clip_high += out.clip_high;
                stats.hinted += out.hinted;
                stats.dpo_pairs += out.dpo_pairs;
                n_micro += 1.0;
                if !value.is_finite() {
                    finite = false;
                    continue;
                }
                // In f32 even when the forward ran in bf16: the accumulators are f32.
                for (k, gk) in s.model.master_grads(&loss.backward()?)? {
                    let acc = match grads.remove(&k) {
                        Some(a) => (a + gk)?,
                        None => gk,
                    };
                    grads.insert(k, acc);
                }
            }
            let norm = optim::grad_norm(&names, &grads)?;
            stats.grad_norm = norm;
            if !finite || !norm.is_finite() {
                stats.non_finite = true;
                continue;
            }
            optim::clip_grads(&mut grads, norm, s.recipe.optimizer.max_grad_norm)?;
            let o = &s.recipe.optimizer;
            let lr = optim::lr_at(
                o.lr,
                s.opt.step as usize,
                o.warmup_steps,
                total_updates,
                o.schedule == "cosine",
            );
            stats.lr = lr;
            s.opt.step(&grads, lr)?;
            // The next micro-batch's forward (and the next rollouts) read the new weights.
            s.model.refresh_compute()?;
            stats.updates += 1;
        }
    }
    if n_micro > 0.0 {
        for x in [
            &mut stats.loss_rlvr,
            &mut stats.loss_hint,
            &mut stats.loss_replay,
            &mut stats.loss_dpo,
            &mut stats.loss_teacher_kl,
            &mut stats.kl,
            &mut stats.mismatch_kl,
            &mut stats.entropy,
            &mut stats.clip_low,
            &mut stats.clip_high,
        ] {
            *x /= n_micro;
        }
        stats.hinted /= tr.num_iterations;
        stats.dpo_pairs /= tr.num_iterations;
    }
    if stats.updates > 0 {
        s.sync_reference(step)?;
    }
    Ok(stats)
}

/// Splits `samples` in order into micro-batches whose size stays within `budget` tokens: the
/// padded size (rows × the longest row's `row_len`) when `padded`, else the real tokens (the
/// sum of `row_len`, `[train] padding_free`); a row longer than the budget forms its own.
pub fn split_by_tokens(
    samples: &[usize],
    row_len: &dyn Fn(usize) -> usize,
    budget: usize,
    padded: bool,
) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let (mut longest, mut total) = (0, 0);
    for &i in samples {
        let len = row_len(i);
        let size = if padded {
            (cur.len() + 1) * longest.max(len)
        } else {
            total + len
        };
        if !cur.is_empty() && size > budget {
            out.push(std::mem::take(&mut cur));
            (longest, total) = (0, 0);
        }
        longest = longest.max(len);
        total += len;
        cur.push(i);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The RLVR normaliser of one optimizer step made of the micro-batches `micro` (lists of
/// sample indices): active completion tokens and sequences over all of them, counted as
/// `LossScale::from_micro_batches` counts them (truncated samples excluded when
/// `mask_truncated_completions`, observation tokens excluded by `loss_mask`). With it the
/// summed micro-batch losses equal the loss of the step's whole batch (DAPO, CISPO, DPPO...).
fn optimizer_step_scale(s: &Session, batch: &RolloutBatch, micro: &[Vec<usize>]) -> LossScale {
    let mask_truncated = s.recipe.loss.rlvr.mask_truncated_completions;
    let (mut tokens, mut sequences) = (0.0, 0.0);
    for &i in micro.iter().flatten() {
        let smp = &batch.samples[i];
        let active = if mask_truncated && smp.truncated {
            0
        } else {
            match &smp.loss_mask {
                Some(mask) => mask.iter().filter(|&&m| m != 0).count(),
                None => smp.completion_ids.len(),
            }
        };
        tokens += active as f64;
        if active > 0 {
            sequences += 1.0;
        }
    }
    LossScale {
        global_active_tokens: tokens,
        global_sequences: sequences,
        num_micro_batches: micro.len().max(1) as f64,
    }
}
