//! The async layout (`[train] mode = "async"`): generator, rewarder and trainer as actors
//! under composer-actors' [`Controller`], with bounded queues between them and a staleness
//! bound `[train] max_staleness = k`.
//!
//! - The **generator** thread samples each step's rollouts with the newest *published*
//!   weights (a snapshot the trainer hands over after each update) while the trainer trains;
//!   it runs at most k versions ahead.
//! - The **rewarder** thread scores them with the recipe's verifiers.
//! - The **trainer** (this thread) consumes one scored step at a time in generation order. A
//!   rollout whose policy version lags the trainer by more than k is dropped and counted
//!   (`staleness/dropped`), never trained on. Off-policy tokens are corrected by the loss's
//!   sampler importance weights (sampler vs trainer log-probs, recorded per token).
//!
//! Everything after the update (metrics, eval, checkpoint, Ctrl-C) is the same
//! [`end_step`] the sync loop calls, with the controller's walls, idle times and staleness
//! added to the metrics line.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use composer_actors::{
    CancelToken, Controller, ControllerConfig, ControllerError, GenerateContext, Generator, Hooks,
    Mode, PolicyVersion, Rewarder, RunEnd, ScoreContext, StepRecord, TrainContext, Trainer,
    Versioned,
};
use tokenizers::Tokenizer;

use crate::data::PromptRow;
use crate::model::PolicyModel;
use crate::recipe::Recipe;
use crate::trainer::{
    end_step, sample_rollouts, save, score_rollouts, step_advantages, train_on_batch, NoHook,
    Rewards, RolloutBatch, RunLog, Session, StepDone, TrainStats,
};
use crate::verifiers::RewardFn;

/// One step's rollouts, all sampled by one published weights version.
pub struct StepRollout {
    /// The rollouts.
    pub batch: RolloutBatch,
    /// Version of the weights that sampled every token of the batch.
    pub policy_version: PolicyVersion,
    /// Seconds the generator spent on it.
    pub rollout_s: f64,
}

impl Versioned for StepRollout {
    fn oldest_policy_version(&self) -> PolicyVersion {
        self.policy_version
    }
}

/// A scored [`StepRollout`].
pub struct ScoredStep {
    /// The rollouts.
    pub rollout: StepRollout,
    /// Their rewards.
    pub rewards: Rewards,
}

impl Versioned for ScoredStep {
    fn oldest_policy_version(&self) -> PolicyVersion {
        self.rollout.policy_version
    }
}

/// Samples rollouts with the published weights.
struct RolloutActor {
    recipe: Recipe,
    train_rows: Vec<PromptRow>,
    tok: Tokenizer,
    stop_ids: Vec<u32>,
    /// RL step whose prompt draw batch 0 uses (resumed runs start later).
    first_step: usize,
}

impl Generator<PolicyModel> for RolloutActor {
    type Item = StepRollout;

    fn generate(&mut self, ctx: &GenerateContext<'_, PolicyModel>) -> Result<Vec<StepRollout>> {
        let t0 = Instant::now();
        let step = self.first_step + ctx.batch_index as usize;
        let batch = sample_rollouts(
            &ctx.weights.weights,
            ctx.weights.policy_version,
            &self.recipe,
            &self.train_rows,
            &self.tok,
            &self.stop_ids,
            step,
            0,
        )?;
        Ok(vec![StepRollout {
            batch,
            policy_version: ctx.weights.policy_version,
            rollout_s: t0.elapsed().as_secs_f64(),
        }])
    }
}

/// Scores rollouts with the recipe's verifiers.
struct RewardActor {
    reward: RewardFn,
    train_rows: Vec<PromptRow>,
    num_generations: usize,
    added_latency_s: f64,
    /// Test hook: fail on this scored batch (1-based).
    fail_at_batch: Option<usize>,
    batches_scored: usize,
}

impl Rewarder<StepRollout> for RewardActor {
    type Scored = ScoredStep;

    fn score(&mut self, items: Vec<StepRollout>, _: &ScoreContext<'_>) -> Result<Vec<ScoredStep>> {
        self.batches_scored += 1;
        if self.fail_at_batch == Some(self.batches_scored) {
            bail!(
                "injected verifier failure on batch {} ({})",
                self.batches_scored,
                crate::trainer::REWARD_ERROR_HOOK_ENV
            );
        }
        Ok(items
            .into_iter()
            .map(|rollout| {
                let rewards = score_rollouts(
                    &self.reward,
                    &self.train_rows,
                    self.num_generations,
                    self.added_latency_s,
                    &rollout.batch,
                );
                ScoredStep { rollout, rewards }
            })
            .collect())
    }
}

/// What one async step trained on and how it went, for [`end_step`].
struct StepReport {
    step: usize,
    batch: RolloutBatch,
    rewards: Rewards,
    stats: TrainStats,
}

/// The trainer actor: the session's optimizer step, and snapshots for publishing.
struct TrainActor<'a> {
    session: &'a mut Session,
    nan_steps: Vec<usize>,
}

impl Trainer<PolicyModel> for TrainActor<'_> {
    type Scored = ScoredStep;
    type Report = StepReport;

    fn train(&mut self, items: Vec<ScoredStep>, _: &TrainContext) -> Result<StepReport> {
        let s = &mut *self.session;
        let step = s.state.step + 1;
        let (batch, rewards) = merge_steps(items);
        let advantages = step_advantages(s, &batch, &rewards)?;
        let inject_nan = self.nan_steps.contains(&step);
        let stats = train_on_batch(s, step, &batch, &rewards, &advantages, inject_nan)?;
        Ok(StepReport {
            step,
            batch,
            rewards,
            stats,
        })
    }

    fn publish(&mut self, policy_version: PolicyVersion) -> Result<Arc<PolicyModel>> {
        // The controller numbers versions by published steps; a skipped (non-finite) step
        // publishes unchanged weights under the next number, which is harmless.
        self.session.state.policy_version = policy_version;
        Ok(Arc::new(self.session.model.snapshot()?))
    }
}

/// Concatenates scored steps (more than one only when a batch came back empty), renumbering
/// sample groups so that they index the merged prompt list.
fn merge_steps(items: Vec<ScoredStep>) -> (RolloutBatch, Rewards) {
    let mut batch = RolloutBatch {
        prompts: vec![],
        samples: vec![],
        texts: vec![],
    };
    let mut rewards = Rewards {
        total: vec![],
        per_func: vec![],
        passed: vec![],
        latency_s: vec![],
    };
    for item in items {
        let offset = batch.prompts.len();
        let b = item.rollout.batch;
        batch.prompts.extend(b.prompts);
        batch.samples.extend(b.samples.into_iter().map(|mut smp| {
            smp.group += offset;
            smp
        }));
        batch.texts.extend(b.texts);
        rewards.total.extend(item.rewards.total);
        rewards.per_func.extend(item.rewards.per_func);
        rewards.passed.extend(item.rewards.passed);
        rewards.latency_s.extend(item.rewards.latency_s);
    }
    (batch, rewards)
}

/// Per-step bookkeeping on the trainer's thread.
struct StepHooks<'a> {
    run: &'a mut RunLog,
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
        let extra = record.metrics();
        let done = StepDone {
            step: r.step,
            batch: &r.batch,
            rewards: &r.rewards,
            stats: &r.stats,
            walls: &walls,
        };
        let stop = end_step(trainer.session, self.run, &done, extra, vec![], &mut NoHook)?;
        if stop {
            self.stopped_by_loop = true;
            self.cancel.cancel();
        }
        Ok(())
    }

    fn on_shutdown(&mut self, trainer: &mut TrainActor<'s>, end: &RunEnd) -> Result<()> {
        // Ctrl-C while the trainer waited for data: keep the last completed step.
        if *end == RunEnd::Cancelled && !self.stopped_by_loop && trainer.session.state.step > 0 {
            save(trainer.session)?;
            let sig = crate::signals::pending().unwrap_or(crate::signals::Interrupt::Sigint);
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

/// Runs the remaining steps of `s` in the async layout.
pub(crate) fn run_async(s: &mut Session, run: &mut RunLog) -> Result<()> {
    let remaining = run.total_steps.saturating_sub(s.state.step);
    if remaining == 0 {
        return Ok(());
    }
    let k = s.recipe.train.max_staleness;
    let mode = Mode::Async {
        max_staleness: k,
        queue_capacity: (k as usize).max(1),
    };
    let mut generator = RolloutActor {
        recipe: s.recipe.clone(),
        train_rows: s.train_rows.clone(),
        tok: s.tok.clone(),
        stop_ids: s.stop_ids.clone(),
        first_step: s.state.step + 1,
    };
    let mut rewarder = RewardActor {
        reward: s.reward.clone(),
        train_rows: s.train_rows.clone(),
        num_generations: s.recipe.rollout.num_generations,
        added_latency_s: s.recipe.train.reward_latency_s,
        fail_at_batch: std::env::var(crate::trainer::REWARD_ERROR_HOOK_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok()),
        batches_scored: 0,
    };
    let initial = Arc::new(s.model.snapshot()?);
    let mut controller = Controller::new(
        ControllerConfig::new(mode, remaining as u64),
        s.state.policy_version,
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
                if crate::signals::pending().is_some() {
                    cancel.cancel();
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let mut trainer = TrainActor {
        session: s,
        nan_steps: run.nan_steps.clone(),
    };
    let mut hooks = StepHooks {
        run,
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
            let last_good = crate::checkpoint::find_checkpoint(&trainer.session.run_dir)
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "none yet (no checkpoint was written)".into());
            bail!("async run stopped: {e}; the last good checkpoint is {last_good}")
        }
    }
}
