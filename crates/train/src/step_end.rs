//! The end of every step, whichever layout ran it (the sync loop, the async actors, a DiLoCo
//! replica: [`crate::trainer`]): [`end_step`] records the step in the session state, writes the
//! metrics line (the walls `time/...` among them) and the step's samples, runs eval, reports
//! progress, applies the non-finite guard, checkpoints, and answers SIGINT/SIGTERM. [`RunLog`]
//! is what the loops carry from step to step.

use std::time::Instant;

use anyhow::{bail, Result};
use composer_actors::record::StepWalls;
use composer_telemetry::{keys, MetricsWriter, StepSnapshot, TrainProgress};
use serde_json::json;

use crate::checkpoint;
use crate::rewards::Rewards;
use crate::rollout::evaluate;
use crate::sampling::RolloutBatch;
use crate::session::{save, Session};
use crate::signals::{self, Interrupt};
use crate::step_hook::StepHook;
use crate::update::TrainStats;

/// What the step loop carries between steps, whichever layout runs it.
pub(crate) struct RunLog {
    pub(crate) metrics: MetricsWriter,
    pub(crate) progress: TrainProgress,
    pub(crate) started: Instant,
    /// Eval accuracy that counts as reaching the target.
    pub(crate) target: f64,
    pub(crate) total_steps: usize,
    /// Steps whose loss the NaN test hook replaces.
    pub(crate) nan_steps: Vec<usize>,
    /// Steps at whose end the signal test hooks raise a signal.
    pub(crate) signal_steps: Vec<(usize, Interrupt)>,
    pub(crate) final_accuracy: Option<f64>,
    /// (step, samples, seconds) when eval first reached `target`.
    pub(crate) reached_target: Option<(usize, u64, f64)>,
    /// Stopped by this signal (a checkpoint was written).
    pub(crate) interrupted: Option<Interrupt>,
}

/// What one step trained on and how it went, for [`end_step`].
pub(crate) struct StepDone<'a> {
    pub(crate) step: usize,
    pub(crate) batch: &'a RolloutBatch,
    pub(crate) rewards: &'a Rewards,
    pub(crate) advantages: &'a [f64],
    pub(crate) stats: &'a TrainStats,
    pub(crate) walls: &'a StepWalls,
}

/// The end of every step, whichever layout ran it: state, the metrics line (plus the
/// layout's own keys, e.g. staleness, and the hook's lines), eval, progress, the non-finite
/// guard, checkpoint and SIGINT/SIGTERM. Returns whether the run should stop now.
pub(crate) fn end_step(
    s: &mut Session,
    run: &mut RunLog,
    done: &StepDone<'_>,
    extra: serde_json::Map<String, serde_json::Value>,
    lines: Vec<serde_json::Value>,
    hook: &mut dyn StepHook,
) -> Result<bool> {
    let StepDone {
        step,
        batch,
        rewards,
        advantages,
        stats,
        walls,
    } = *done;
    let lengths: Vec<usize> = batch
        .samples
        .iter()
        .map(|x| x.completion_ids.len())
        .collect();
    let (rollout_s, reward_s, train_s, sync_s, step_s) = (
        walls.rollout_s,
        walls.reward_s,
        walls.train_s,
        walls.sync_s,
        walls.step_s,
    );
    let total_steps = run.total_steps;
    let target = run.target;
    s.state.step = step;
    s.state.samples_generated += batch.samples.len() as u64;
    let gen_tokens: usize = lengths.iter().sum();
    s.state.trained_tokens += if stats.non_finite {
        0
    } else {
        gen_tokens as u64
    };
    if stats.non_finite {
        s.state.skipped_steps += 1;
        s.state.consecutive_skipped += 1;
    } else {
        s.state.consecutive_skipped = 0;
    }

    let n = rewards.total.len() as f64;
    let mean = rewards.total.iter().sum::<f64>() / n;
    let std = (rewards
        .total
        .iter()
        .map(|r| (r - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    let mut line = json!({
        (keys::STEP): step,
        (keys::KIND): keys::KIND_TRAIN,
        (keys::POLICY_VERSION): s.state.policy_version,
        (keys::REWARD_MEAN): mean,
        (keys::REWARD_STD): std,
        (keys::COMPLETION_MEAN_LENGTH): gen_tokens as f64 / n,
        (keys::COMPLETION_CLIPPED_RATIO): batch.samples.iter().filter(|x| x.truncated).count() as f64 / n,
        (keys::COMPLETION_LENGTHS): lengths,
        (keys::LOSS_RLVR): stats.loss_rlvr,
        (keys::LOSS_HINT): stats.loss_hint,
        (keys::LOSS_REPLAY): stats.loss_replay,
        (keys::LOSS_REPLAY_DPO): stats.loss_dpo,
        (keys::LOSS_REPLAY_KL): stats.loss_teacher_kl,
        (keys::KL): stats.kl,
        (keys::MISMATCH_MAX_ABS): stats.mismatch_max_abs,
        (keys::MISMATCH_KL): stats.mismatch_kl,
        (keys::ENTROPY): stats.entropy,
        (keys::CLIP_RATIO_LOW): stats.clip_low,
        (keys::CLIP_RATIO_HIGH): stats.clip_high,
        (keys::GRAD_NORM): stats.grad_norm,
        (keys::LR): stats.lr,
        (keys::HINT_SAMPLES): stats.hinted,
        (keys::REPLAY_DPO_PAIRS): stats.dpo_pairs,
        (keys::REPLAY_ROWS_WITHOUT_TRACE): s.rows_without_trace,
        (keys::TIME_ROLLOUT): rollout_s,
        (keys::TIME_REWARD): reward_s,
        (keys::TIME_TRAIN): train_s,
        (keys::TIME_SYNC): sync_s,
        (keys::TIME_STEP): step_s,
        (keys::TOKENS_PER_S): gen_tokens as f64 / rollout_s.max(1e-9),
        (keys::TRAINED_TOKENS): s.state.trained_tokens,
        (keys::SAMPLES): s.state.samples_generated,
        (keys::SKIPPED_STEPS): s.state.skipped_steps,
        (keys::ENV_LATENCY): rewards.latency_s,
    });
    if stats.non_finite {
        line[keys::SKIPPED] = json!(true);
    }
    let baselines = rewards.remax_baseline_totals(&s.reward);
    if !baselines.is_empty() {
        line[keys::REMAX_BASELINE_REWARD] = json!(baselines.iter().sum::<f64>() / n);
    }
    if let Some(obj) = line.as_object_mut() {
        obj.extend(extra);
    }
    run.metrics.write(&line)?;
    for l in &lines {
        run.metrics.write(l)?;
    }
    crate::rewards::record_samples(&s.run_dir, step, batch, rewards, advantages, &baselines)?;

    let every = s.recipe.train.eval_every;
    let mut eval_acc = None;
    if (every > 0 && step.is_multiple_of(every)) || step == total_steps {
        let acc = evaluate(s)?;
        eval_acc = Some(acc);
        run.final_accuracy = Some(acc);
        run.metrics.write(&json!({(keys::STEP): step, (keys::KIND): keys::KIND_EVAL, (keys::POLICY_VERSION): s.state.policy_version, (keys::EVAL_ACCURACY): acc, (keys::SAMPLES): s.state.samples_generated}))?;
        if acc >= target && run.reached_target.is_none() {
            run.reached_target = Some((
                step,
                s.state.samples_generated,
                run.started.elapsed().as_secs_f64(),
            ));
        }
    }
    run.progress.update(&StepSnapshot {
        step: step as u64,
        reward_mean: mean,
        eval_accuracy: eval_acc,
        tokens_per_s: gen_tokens as f64 / rollout_s.max(1e-9),
        extra: if stats.non_finite {
            Some("skipped: non-finite".to_string())
        } else {
            hook.note()
        },
    });

    let ck = s.recipe.train.checkpoint_every;
    for &(_, sig) in run.signal_steps.iter().filter(|(x, _)| *x == step) {
        signals::raise(sig);
    }
    let interrupted = signals::pending();
    run.interrupted = interrupted;
    let stop_early = hook.allows_early_stop()
        && s.recipe.train.stop_at_accuracy > 0.0
        && eval_acc.is_some_and(|a| a >= target);
    if s.state.consecutive_skipped >= s.recipe.train.max_nonfinite_steps.max(1) {
        let last_good = checkpoint::find_checkpoint(&s.run_dir)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "none yet (no checkpoint was written)".into());
        bail!(
            "stopping at step {step}: {} consecutive steps had a non-finite loss or gradient \
         (limit `[train] max_nonfinite_steps` = {}); the last good checkpoint is {last_good}",
            s.state.consecutive_skipped,
            s.recipe.train.max_nonfinite_steps
        );
    }
    if (ck > 0 && step.is_multiple_of(ck))
        || step == total_steps
        || interrupted.is_some()
        || stop_early
    {
        save(s, hook.checkpoint_files(s)?)?;
    }
    if let Some(sig) = interrupted {
        run.progress.println(format!(
            "interrupted by {}: checkpoint written at step {step}; continue with --resume {}",
            sig.name(),
            s.run_dir.display()
        ));
        return Ok(true);
    }
    Ok(stop_early)
}
