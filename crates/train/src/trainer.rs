//! The training loop. [`run_train`] reads top to bottom: set up ([`open_session`]: recipe,
//! data, tokenizer, model, reference policy, traces, optimizer, resume), supervised warm-up,
//! then per step [`rollout_and_score`] (rollouts, rewards, DAPO dynamic sampling) →
//! advantages → [`train_on_batch`] (μ passes of mini-batch updates through composer-loss) →
//! [`publish_weights`] → eval → metrics and the step's samples → checkpoint.
//!
//! One step loop serves every layout, and both loops are in this file: sync mode
//! (`run_sync`, staleness 0), async mode (`run_async`: the actors of [`crate::async_mode`]
//! under composer-actors' controller, bounded staleness) and DiLoCo replicas (the sync loop
//! with a [`StepHook`] for the outer step). Every step ends in the same `end_step`
//! ([`crate::step_end`]), so the NaN/Inf guard, the walls (`time/...`), metrics, eval,
//! checkpoints and SIGINT/SIGTERM ([`crate::signals`]: checkpoint, stop, exit 130/143) behave
//! the same in all three.
//!
//! The step's pieces live in their own modules, none of which depends on this one:
//! [`crate::session`], [`crate::rollout`] (and [`crate::env_batch`] for `[env]`),
//! [`crate::rewards`], [`crate::update`] / [`crate::step_loss`], [`crate::step_end`],
//! [`crate::checkpoint`]. The
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
use composer_telemetry::{keys, MetricsWriter, TrainProgress};
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
use crate::step_end::{end_step, RunLog, StepDone};
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
