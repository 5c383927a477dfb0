//! The training loop. [`run_train`] reads top to bottom: set up ([`open_session`]: recipe,
//! data, tokenizer, model, reference policy, traces, optimizer, resume), supervised warm-up,
//! then per step [`rollout_and_score`] (rollouts, rewards, DAPO dynamic sampling) →
//! advantages → [`train_on_batch`] (μ passes of mini-batch updates through composer-loss) →
//! [`publish_weights`] → eval → metrics and the step's samples → checkpoint.
//!
//! One step loop serves every layout, and both loops are in this file: sync mode
//! (`run_sync`, staleness 0), async mode (`run_async`: the actors of [`crate::async_mode`]
//! under composer-actors' controller, bounded staleness) and DiLoCo replicas (the sync loop
//! with a [`StepHook`] for the outer step). Every step ends in the same `end_step`, so the
//! NaN/Inf guard, the walls (`time/...`), metrics, eval, checkpoints and SIGINT/SIGTERM
//! ([`crate::signals`]: checkpoint, stop, exit 130/143) behave the same in all three.
//!
//! The step's pieces live in their own modules, none of which depends on this one:
//! [`crate::session`], [`crate::rollout`] (and [`crate::env_batch`] for `[env]`),
//! [`crate::rewards`], [`crate::update`] / [`crate::step_loss`], [`crate::checkpoint`]. The
//! `pub use`s below are the step's public face for the binary, DiLoCo and the tests.
//!
//! Every random draw is ChaCha8 seeded by `mix_seed(seed, step, index)`, so a run is a pure
//! function of (recipe, seed) and a resumed run continues bit-identically.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use composer_actors::record::StepWalls;
use composer_actors::{
    CancelToken, Controller, ControllerConfig, ControllerError, Hooks, Mode, RunEnd, StepRecord,
};
use composer_telemetry::{keys, MetricsWriter, StepSnapshot, TrainProgress};
use serde_json::json;

use crate::async_mode::{AsyncActors, SnapshotSaver, StepReport, TrainActor};
use crate::checkpoint;
pub use crate::options::{RunOutcome, TrainOptions};
use crate::recipe::TrainMode;
pub use crate::rewards::{reward_batch, score_rollouts, step_advantages, Rewards};
pub use crate::rollout::{evaluate, rollout_and_score, rollout_batch, sample_rollouts};
pub use crate::sampling::RolloutBatch;
pub use crate::session::{open_session, save, Session};
use crate::signals::{self, Interrupt};
pub use crate::step_hook::{NoHook, StepExtras, StepHook};
use crate::test_hooks::hook_steps;
pub use crate::test_hooks::{
    NAN_HOOK_ENV, REWARD_ERROR_HOOK_ENV, SIGINT_HOOK_ENV, SIGTERM_HOOK_ENV, WARMUP_SIGINT_HOOK_ENV,
};
pub use crate::update::{train_on_batch, warmup, TrainStats};

/// Train the policy as the recipe says. See the module docs for the order of things.
pub fn run_train(opts: &TrainOptions) -> Result<RunOutcome> {
    run_train_with(opts, &mut NoHook)
}

/// [`run_train`] with `hook` around the steps (sync mode only).
pub fn run_train_with(opts: &TrainOptions, hook: &mut dyn StepHook) -> Result<RunOutcome> {
    let started = Instant::now();
    let mut s = open_session(opts)?;
    // Also forgets a signal of an earlier run in this process (library use, tests).
    signals::install();
    composer_fsutil::write_atomic(&s.run_dir.join("recipe.toml"), s.recipe_text.as_bytes())
        .with_context(|| format!("writing {}", s.run_dir.join("recipe.toml").display()))?;
    let metrics_path = s.run_dir.join("metrics.jsonl");
    let mut metrics = if opts.resume.is_some() {
        MetricsWriter::open_resume(&metrics_path, s.state.step as u64)?
    } else {
        MetricsWriter::create(&metrics_path)?
    };
    let total_steps = s.recipe.train.steps;
    let mut progress = TrainProgress::new(total_steps as u64, opts.quiet);
    progress.resume_from(s.state.step as u64);
    let target = if s.recipe.train.stop_at_accuracy > 0.0 {
        s.recipe.train.stop_at_accuracy
    } else {
        0.9
    };
    if !s.traces.is_empty() {
        progress.println(format!(
            "replay: {} traces; {} of {} training prompts have no passing trace",
            s.traces.len(),
            s.rows_without_trace,
            s.train_rows.len()
        ));
    }
    let nan_steps = hook_steps(NAN_HOOK_ENV);
    let signal_steps: Vec<(usize, Interrupt)> = hook_steps(SIGINT_HOOK_ENV)
        .into_iter()
        .map(|x| (x, Interrupt::Sigint))
        .chain(
            hook_steps(SIGTERM_HOOK_ENV)
                .into_iter()
                .map(|x| (x, Interrupt::Sigterm)),
        )
        .collect();

    // Supervised warm-up (fresh runs only).
    if s.state.step == 0 && opts.resume.is_none() {
        if let Some(w) = s.recipe.warmup.clone() {
            let loss = warmup(&mut s, &w)?;
            if let Some(sig) = signals::pending() {
                // Nothing of RL exists yet: a checkpoint would only hold a partial warm-up.
                progress.println(format!(
                    "interrupted by {} during the supervised warm-up: no checkpoint written; \
                     start the run again",
                    sig.name()
                ));
                return Ok(RunOutcome {
                    run_dir: s.run_dir.clone(),
                    steps_completed: 0,
                    warmup_accuracy: None,
                    final_accuracy: None,
                    reached_target: None,
                    samples_generated: 0,
                    skipped_steps: 0,
                    wall_s: started.elapsed().as_secs_f64(),
                    interrupted: Some(sig),
                });
            }
            let acc = evaluate(&s)?;
            s.state.warmup_accuracy = Some(acc);
            progress.println(format!(
                "warm-up: {} steps, final loss {loss:.4}, greedy accuracy {:.1}%",
                w.steps,
                acc * 100.0
            ));
            metrics.write(&json!({(keys::STEP): 0, (keys::KIND): keys::KIND_EVAL, (keys::EVAL_ACCURACY): acc, (keys::POLICY_VERSION): 0, (keys::WARMUP_LOSS): loss}))?;
        }
    }
    // The frozen reference policy is the policy as RL starts (or `ref_model_path`).
    s.ensure_reference()?;
    hook.before_loop(&mut s, &progress)?;

    let mut run = RunLog {
        metrics,
        progress,
        started,
        target,
        total_steps,
        nan_steps,
        signal_steps,
        final_accuracy: None,
        reached_target: None,
        interrupted: None,
    };
    let looped = match s.recipe.train.mode {
        TrainMode::Sync => run_sync(&mut s, &mut run, hook),
        TrainMode::Async => run_async(&mut s, &mut run),
    };
    // Every env server stayed down past `[env] server_down_budget_s`: the run cannot go on,
    // but it ends like an interrupted one — a final checkpoint of the last completed step
    // (the failed step's rollouts changed nothing yet), the summary and the report — and
    // then fails. Any other error fails at once.
    let env_lost = match looped {
        Ok(()) => None,
        Err(e) if s.env_rollout.as_ref().is_some_and(|e| e.all_servers_gone()) => Some(e),
        Err(e) => return Err(e),
    };
    if env_lost.is_some() {
        save(&s, hook.checkpoint_files(&s)?)?;
    }
    let RunLog {
        progress,
        final_accuracy,
        reached_target,
        interrupted,
        ..
    } = run;
    let summary = format!(
        "{} steps, warm-up accuracy {}, final accuracy {}, {} samples, {} skipped, {:.1}s",
        s.state.step,
        fmt_pct(s.state.warmup_accuracy),
        fmt_pct(final_accuracy),
        s.state.samples_generated,
        s.state.skipped_steps,
        started.elapsed().as_secs_f64()
    );
    progress.finish(&summary);
    let report = composer_telemetry::write_report(&s.run_dir);
    if let Err(e) = &report {
        progress.println(format!("report not written: {e:#}"));
    }
    if let Some(e) = env_lost {
        let budget = s
            .recipe
            .env
            .as_ref()
            .map_or(0.0, |e| e.server_down_budget_s);
        bail!(
            "{e:#}\nstopped after step {}: every env server stayed down longer than `[env] \
             server_down_budget_s` = {budget} s; final checkpoint {}, report {}; continue with \
             `--resume {}` once the server is back",
            s.state.step,
            checkpoint::find_checkpoint(&s.run_dir)?.display(),
            report.map_or_else(
                |e| format!("not written ({e:#})"),
                |p| p.display().to_string()
            ),
            s.run_dir.display()
        );
    }
    Ok(RunOutcome {
        run_dir: s.run_dir.clone(),
        steps_completed: s.state.step,
        warmup_accuracy: s.state.warmup_accuracy,
        final_accuracy,
        reached_target,
        samples_generated: s.state.samples_generated,
        skipped_steps: s.state.skipped_steps,
        wall_s: started.elapsed().as_secs_f64(),
        interrupted,
    })
}

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

/// The sync layout: generate, score, train, publish — one after the other, on this thread.
fn run_sync(s: &mut Session, run: &mut RunLog, hook: &mut dyn StepHook) -> Result<()> {
    while s.state.step < run.total_steps {
        let step = s.state.step + 1;
        let t_step = Instant::now();

        let scored = rollout_and_score(s, hook.sample_stream(step))?;
        let (batch, rewards) = (scored.batch, scored.rewards);
        let (rollout_s, reward_s) = (scored.rollout_s, scored.reward_s);

        let advantages = step_advantages(s, &batch, &rewards)?;

        let t0 = Instant::now();
        let inject_nan = run.nan_steps.contains(&step);
        let stats = train_on_batch(s, step, &batch, &rewards, &advantages, inject_nan)?;
        let train_s = t0.elapsed().as_secs_f64();

        let t0 = Instant::now();
        publish_weights(s, &stats);
        let sync_s = t0.elapsed().as_secs_f64();
        let extras = hook.after_step(s, step)?;

        let walls = StepWalls {
            rollout_s,
            reward_s,
            train_s,
            sync_s,
            step_s: t_step.elapsed().as_secs_f64(),
        };
        // Sync rollouts are always on-policy: staleness 0, logged for the same checks.
        let mut extra = serde_json::Map::new();
        extra.insert(keys::STALENESS_MEAN.into(), json!(0.0));
        extra.insert(keys::STALENESS_MAX.into(), json!(0));
        extra.insert(keys::STALENESS_DROPPED.into(), json!(0));
        if s.recipe.loss.advantage.dynamic_sampling {
            extra.insert(
                keys::DYNAMIC_SAMPLING_DROPPED_GROUPS.into(),
                json!(scored.dropped_groups),
            );
            extra.insert(keys::DYNAMIC_SAMPLING_ROUNDS.into(), json!(scored.rounds));
        }
        if let Some(env) = &s.env_rollout {
            extra.extend(env.step_metrics());
        }
        extra.extend(extras.keys);
        let done = StepDone {
            step,
            batch: &batch,
            rewards: &rewards,
            advantages: &advantages,
            stats: &stats,
            walls: &walls,
        };
        if end_step(s, run, &done, extra, extras.lines, hook)? {
            break;
        }
    }
    Ok(())
}

/// The async layout: the generator, rewarder and trainer actors of [`crate::async_mode`] under
/// composer-actors' controller (bounded staleness); every step ends in [`end_step`].
fn run_async(s: &mut Session, run: &mut RunLog) -> Result<()> {
    let remaining = run.total_steps.saturating_sub(s.state.step);
    if remaining == 0 {
        return Ok(());
    }
    let k = s.recipe.train.max_staleness;
    let mode = Mode::Async {
        max_staleness: k,
        queue_capacity: (k as usize).max(1),
    };
    let first_version = s.state.policy_version;
    let AsyncActors {
        initial,
        mut generator,
        mut rewarder,
        mut trainer,
        snapshots,
    } = AsyncActors::new(s, run.nan_steps.clone(), run.total_steps)?;
    let mut controller = Controller::new(
        ControllerConfig::new(mode, remaining as u64),
        first_version,
        initial,
    );
    let cancel = controller.cancel_token();
    // Ctrl-C sets a process-wide flag (the signal handler may only store an atomic); this
    // watcher turns it into a controller cancel, so waiting actors notice within 50 ms.
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (cancel, done) = (cancel.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                if signals::pending().is_some() {
                    cancel.cancel();
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let mut hooks = StepHooks {
        run,
        snapshots,
        cancel,
        stopped_by_loop: false,
    };
    let result = controller.run(&mut generator, &mut rewarder, &mut trainer, &mut hooks);
    done.store(true, Ordering::SeqCst);
    let _ = watcher.join();
    match result {
        Ok(_) => Ok(()),
        Err(ControllerError::Cancelled { .. }) => Ok(()),
        Err(e) => {
            let last_good = checkpoint::find_checkpoint(&trainer.session.run_dir)
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "none yet (no checkpoint was written)".into());
            bail!("async run stopped: {e}; the last good checkpoint is {last_good}")
        }
    }
}

/// Per-step bookkeeping on the trainer's thread.
struct StepHooks<'a> {
    run: &'a mut RunLog,
    /// Writes the older weights later steps need into a checkpoint between boundaries.
    snapshots: SnapshotSaver,
    cancel: CancelToken,
    /// Set when [`end_step`] asked to stop (target reached, Ctrl-C): the controller is then
    /// cancelled, which is a normal end here.
    stopped_by_loop: bool,
}

impl<'s> Hooks<TrainActor<'s>, StepReport> for StepHooks<'_> {
    fn on_step(
        &mut self,
        trainer: &mut TrainActor<'s>,
        record: &StepRecord<StepReport>,
    ) -> Result<()> {
        let r = &record.report;
        let walls = record.walls;
        let mut extra = record.metrics();
        if let Some((dropped, rounds)) = r.dynamic_sampling {
            extra.insert(keys::DYNAMIC_SAMPLING_DROPPED_GROUPS.into(), json!(dropped));
            extra.insert(keys::DYNAMIC_SAMPLING_ROUNDS.into(), json!(rounds));
        }
        let done = StepDone {
            step: r.step,
            batch: &r.batch,
            rewards: &r.rewards,
            advantages: &r.advantages,
            stats: &r.stats,
            walls: &walls,
        };
        let stop = end_step(
            trainer.session,
            self.run,
            &done,
            extra,
            vec![],
            &mut self.snapshots,
        )?;
        self.snapshots.forget_before(trainer.session);
        if stop {
            self.stopped_by_loop = true;
            self.cancel.cancel();
        }
        Ok(())
    }

    fn on_shutdown(&mut self, trainer: &mut TrainActor<'s>, end: &RunEnd) -> Result<()> {
        // Ctrl-C while the trainer waited for data: keep the last completed step.
        if *end == RunEnd::Cancelled && !self.stopped_by_loop && trainer.session.state.step > 0 {
            save(
                trainer.session,
                self.snapshots.checkpoint_files(trainer.session)?,
            )?;
            let sig = signals::pending().unwrap_or(Interrupt::Sigint);
            self.run.interrupted = Some(sig);
            self.run.progress.println(format!(
                "interrupted by {}: checkpoint written at step {}; continue with --resume {}",
                sig.name(),
                trainer.session.state.step,
                trainer.session.run_dir.display()
            ));
        }
        Ok(())
    }
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

fn fmt_pct(x: Option<f64>) -> String {
    x.map(|a| format!("{:.1}%", a * 100.0))
        .unwrap_or_else(|| "n/a".into())
}

/// Bump the policy version (colocated synchronous layout: the generator reads the trainer's
/// weights directly, so publishing is the version bump).
pub fn publish_weights(s: &mut Session, stats: &TrainStats) {
    if stats.updates > 0 {
        s.state.policy_version += 1;
    }
}
