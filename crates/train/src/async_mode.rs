//! The async layout (`[train] mode = "async"`): generator, rewarder and trainer as actors
//! under composer-actors' [`composer_actors::Controller`], with bounded queues between them
//! and a staleness bound `[train] max_staleness = k`.
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
//! **Determinism.** The generator does not take whatever weights are newest (that would depend
//! on timing): step t always samples with the weights of version `max(t − 1 − k, c)`, where c
//! is the last `checkpoint_every` step before t (a barrier: right after a checkpoint the
//! generator waits for the checkpointed weights). So a run is a function of (recipe, seed)
//! as in sync mode, and a run resumed from a checkpoint continues bit-identically: from a
//! `checkpoint_every` boundary no later step needs older weights, and a checkpoint written
//! between boundaries (Ctrl-C, SIGTERM) carries the older weights later steps sample with
//! ([`crate::async_resume`]). The trainer keeps the few snapshots still needed in a `History`.
//!
//! This module holds the actors; the step loop in `trainer.rs` runs them under the controller
//! and ends every step with the same `end_step` as the sync loop (metrics, eval, checkpoint,
//! Ctrl-C), with the controller's walls, idle times and staleness added to the metrics line.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use composer_actors::{
    GenerateContext, Generator, PolicyVersion, Rewarder, ScoreContext, TrainContext, Trainer,
    Versioned,
};
use tokenizers::Tokenizer;

use crate::async_resume::{read_snapshots, sampling_step, snapshot_files, steps_needed_after};
use crate::data::PromptRow;
use crate::model::PolicyModel;
use crate::recipe::Recipe;
use crate::rewards::{score_rollouts, step_advantages, Rewards};
use crate::rollout::{fill_groups, sample_rollouts};
use crate::sampling::RolloutBatch;
use crate::session::Session;
use crate::step_hook::StepHook;
use crate::update::{train_on_batch, TrainStats};
use crate::verifiers::RewardFn;

/// One step's rollouts, all sampled by one published weights version.
pub struct StepRollout {
    /// The rollouts.
    pub batch: RolloutBatch,
    /// Version of the weights that sampled every token of the batch.
    pub policy_version: PolicyVersion,
    /// Seconds the generator spent on it.
    pub rollout_s: f64,
    /// With `[loss] dynamic_sampling`: the generator's own scoring of its rounds (it needs the
    /// rewards to know which groups to replace), which the rewarder then passes on.
    pub dynamic: Option<DynamicScored>,
}

/// A batch assembled by DAPO dynamic sampling on the generator, already scored.
pub struct DynamicScored {
    /// The kept groups' rewards.
    pub rewards: Rewards,
    /// Zero-variance groups dropped.
    pub dropped_groups: usize,
    /// Sampling rounds used.
    pub rounds: usize,
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
    /// With dynamic sampling: (zero-variance groups dropped, sampling rounds).
    pub dynamic_sampling: Option<(usize, usize)>,
}

impl Versioned for ScoredStep {
    fn oldest_policy_version(&self) -> PolicyVersion {
        self.rollout.policy_version
    }
}

/// Published snapshots by policy version, kept until no later step samples with them.
#[derive(Default)]
struct History {
    snapshots: Mutex<BTreeMap<PolicyVersion, Arc<PolicyModel>>>,
    changed: Condvar,
}

impl History {
    fn insert(&self, version: PolicyVersion, weights: Arc<PolicyModel>) {
        let mut map = self.snapshots.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(version, weights);
        self.changed.notify_all();
    }

    /// Waits for `version` (or the cancel).
    fn take(
        &self,
        version: PolicyVersion,
        stopping: impl Fn() -> bool,
    ) -> Option<Arc<PolicyModel>> {
        let mut map = self.snapshots.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(w) = map.get(&version).cloned() {
                return Some(w);
            }
            if stopping() {
                return None;
            }
            map = self
                .changed
                .wait_timeout(map, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl History {
    /// The snapshot of `version`, if still kept.
    fn get(&self, version: PolicyVersion) -> Option<Arc<PolicyModel>> {
        let map = self.snapshots.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&version).cloned()
    }

    /// Drops every snapshot older than `version` (no untrained step samples with them).
    fn retain_from(&self, version: PolicyVersion) {
        let mut map = self.snapshots.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|v, _| *v >= version);
    }
}

/// Samples rollouts with the published weights of the step's pinned version.
pub(crate) struct RolloutActor {
    recipe: Recipe,
    train_rows: Vec<PromptRow>,
    tok: Tokenizer,
    stop_ids: Vec<u32>,
    /// RL step whose prompt draw batch 0 uses (resumed runs start later).
    first_step: usize,
    /// Policy version of the weights at the start (after step `first_step − 1`).
    first_version: PolicyVersion,
    /// The oldest step whose weights the run holds (`first_step − 1`, or older ones a
    /// checkpoint carried).
    floor_step: usize,
    history: Arc<History>,
    /// Scores dynamic sampling's rounds (only used with `[loss] dynamic_sampling`).
    reward: RewardFn,
}

impl Generator<PolicyModel> for RolloutActor {
    type Item = StepRollout;

    fn generate(&mut self, ctx: &GenerateContext<'_, PolicyModel>) -> Result<Vec<StepRollout>> {
        let step = self.first_step + ctx.batch_index as usize;
        let k = self.recipe.train.max_staleness as usize;
        let at = sampling_step(step, k, self.recipe.train.checkpoint_every, self.floor_step);
        // Every step publishes one version (skipped steps too).
        let version = self.first_version + at as u64 + 1 - self.first_step as u64;
        let Some(weights) = self.history.take(version, || ctx.is_stopping()) else {
            bail!("cancelled while waiting for the weights of version {version}");
        };
        if !ctx.wait_published(version) {
            bail!("cancelled while waiting for version {version} to be published");
        }
        let t0 = Instant::now();
        let round = |round: usize| {
            sample_rollouts(
                &weights,
                version,
                &self.recipe,
                &self.train_rows,
                &self.tok,
                &self.stop_ids,
                step,
                round,
            )
        };
        let batch = round(0)?;
        if !self.recipe.loss.advantage.dynamic_sampling {
            return Ok(vec![StepRollout {
                batch,
                policy_version: version,
                rollout_s: t0.elapsed().as_secs_f64(),
                dynamic: None,
            }]);
        }
        // The same rounds, prompts and seeds as the sync loop's `rollout_and_score`, all
        // sampled with this step's pinned weights.
        let score = |batch: &RolloutBatch| {
            score_rollouts(
                &self.reward,
                &self.train_rows,
                self.recipe.rollout.num_generations,
                self.recipe.train.reward_latency_s,
                batch,
            )
        };
        let rewards = score(&batch);
        let filled = fill_groups(&self.recipe, batch, rewards, |r| {
            let more = round(r)?;
            let more_rewards = score(&more);
            Ok((more, more_rewards))
        })?;
        Ok(vec![StepRollout {
            batch: filled.batch,
            policy_version: version,
            rollout_s: t0.elapsed().as_secs_f64(),
            dynamic: Some(DynamicScored {
                rewards: filled.rewards,
                dropped_groups: filled.dropped_groups,
                rounds: filled.rounds,
            }),
        }])
    }
}

/// Scores rollouts with the recipe's verifiers.
pub(crate) struct RewardActor {
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
                crate::test_hooks::REWARD_ERROR_HOOK_ENV
            );
        }
        Ok(items
            .into_iter()
            .map(|mut rollout| match rollout.dynamic.take() {
                Some(d) => ScoredStep {
                    rollout,
                    rewards: d.rewards,
                    dynamic_sampling: Some((d.dropped_groups, d.rounds)),
                },
                None => {
                    let rewards = score_rollouts(
                        &self.reward,
                        &self.train_rows,
                        self.num_generations,
                        self.added_latency_s,
                        &rollout.batch,
                    );
                    ScoredStep {
                        rollout,
                        rewards,
                        dynamic_sampling: None,
                    }
                }
            })
            .collect())
    }
}

/// What one async step trained on and how it went, for [`crate::step_end::end_step`].
pub(crate) struct StepReport {
    pub(crate) step: usize,
    pub(crate) batch: RolloutBatch,
    pub(crate) rewards: Rewards,
    pub(crate) advantages: Vec<f64>,
    pub(crate) stats: TrainStats,
    /// With dynamic sampling: (zero-variance groups dropped, sampling rounds).
    pub(crate) dynamic_sampling: Option<(usize, usize)>,
}

/// The trainer actor: the session's optimizer step, and snapshots for publishing.
pub(crate) struct TrainActor<'a> {
    pub(crate) session: &'a mut Session,
    nan_steps: Vec<usize>,
    history: Arc<History>,
}

impl Trainer<PolicyModel> for TrainActor<'_> {
    type Scored = ScoredStep;
    type Report = StepReport;

    fn train(&mut self, items: Vec<ScoredStep>, _: &TrainContext) -> Result<StepReport> {
        let s = &mut *self.session;
        let step = s.state.step + 1;
        let (batch, rewards, dynamic_sampling) = merge_steps(items);
        let advantages = step_advantages(s, &batch, &rewards)?;
        let inject_nan = self.nan_steps.contains(&step);
        let stats = train_on_batch(s, step, &batch, &rewards, &advantages, inject_nan)?;
        Ok(StepReport {
            step,
            batch,
            rewards,
            advantages,
            stats,
            dynamic_sampling,
        })
    }

    fn publish(&mut self, policy_version: PolicyVersion) -> Result<Arc<PolicyModel>> {
        // The controller numbers versions by published steps; a skipped (non-finite) step
        // publishes unchanged weights under the next number, which is harmless.
        self.session.state.policy_version = policy_version;
        let snapshot = Arc::new(self.session.model.sampling_copy()?);
        self.history.insert(policy_version, snapshot.clone());
        Ok(snapshot)
    }
}

/// Concatenates scored steps (more than one only when a batch came back empty), renumbering
/// sample groups so that they index the merged prompt list; dynamic sampling's counts add up.
fn merge_steps(items: Vec<ScoredStep>) -> (RolloutBatch, Rewards, Option<(usize, usize)>) {
    let mut batch = RolloutBatch {
        prompts: vec![],
        samples: vec![],
        texts: vec![],
        // The baselines are already in the rewards.
        greedy_texts: None,
    };
    let mut rewards = Rewards::default();
    let mut dynamic: Option<(usize, usize)> = None;
    for item in items {
        if let Some((d, r)) = item.dynamic_sampling {
            let (d0, r0) = dynamic.unwrap_or((0, 0));
            dynamic = Some((d0 + d, r0 + r));
        }
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
        rewards.remax_baseline.extend(item.rewards.remax_baseline);
    }
    (batch, rewards, dynamic)
}

/// The async layout's actors, ready for the controller, and the weights it starts from.
pub(crate) struct AsyncActors<'a> {
    /// The weights every actor starts from (published as the session's version).
    pub(crate) initial: Arc<PolicyModel>,
    pub(crate) generator: RolloutActor,
    pub(crate) rewarder: RewardActor,
    pub(crate) trainer: TrainActor<'a>,
    /// The trainer's [`StepHook`]: writes the older weights later steps need.
    pub(crate) snapshots: SnapshotSaver,
}

impl<'a> AsyncActors<'a> {
    /// Builds the actors of the remaining steps of `s` (up to `total_steps`); on a resumed
    /// run, loads the older weights its checkpoint carries. `nan_steps`: the NaN test hook.
    pub(crate) fn new(
        s: &'a mut Session,
        nan_steps: Vec<usize>,
        total_steps: usize,
    ) -> Result<Self> {
        let k = s.recipe.train.max_staleness as usize;
        let rewarder = RewardActor {
            reward: s.reward.clone(),
            train_rows: s.train_rows.clone(),
            num_generations: s.recipe.rollout.num_generations,
            added_latency_s: s.recipe.train.reward_latency_s,
            fail_at_batch: std::env::var(crate::test_hooks::REWARD_ERROR_HOOK_ENV)
                .ok()
                .and_then(|v| v.trim().parse().ok()),
            batches_scored: 0,
        };
        let initial = Arc::new(s.model.sampling_copy()?);
        let history = Arc::new(History::default());
        history.insert(s.state.policy_version, initial.clone());
        let floor_step = load_snapshots(s, &history)?;
        let generator = RolloutActor {
            recipe: s.recipe.clone(),
            train_rows: s.train_rows.clone(),
            tok: s.tok.clone(),
            stop_ids: s.stop_ids.clone(),
            first_step: s.state.step + 1,
            first_version: s.state.policy_version,
            floor_step,
            history: history.clone(),
            reward: s.reward.clone(),
        };
        let snapshots = SnapshotSaver {
            history: history.clone(),
            k,
            checkpoint_every: s.recipe.train.checkpoint_every,
            total_steps,
        };
        let trainer = TrainActor {
            session: s,
            nan_steps,
            history,
        };
        Ok(AsyncActors {
            initial,
            generator,
            rewarder,
            trainer,
            snapshots,
        })
    }
}

/// The version of step `j`'s weights, given that step `m` published `version_m` (every step
/// publishes one version).
fn version_of(j: usize, m: usize, version_m: PolicyVersion) -> PolicyVersion {
    (version_m + j as u64).saturating_sub(m as u64)
}

/// On a resumed run, puts the older weights its checkpoint carries into `history`; returns
/// the oldest step whose weights the run now holds.
fn load_snapshots(s: &Session, history: &History) -> Result<usize> {
    let m = s.state.step;
    let Ok(checkpoint) = crate::checkpoint::find_checkpoint(&s.run_dir) else {
        return Ok(m);
    };
    let mut floor = m;
    for (j, tensors, path) in read_snapshots(&checkpoint, m, s.model.device())? {
        let weights = s.model.sampling_copy()?;
        weights.set_weights(&tensors, &path)?;
        history.insert(version_of(j, m, s.state.policy_version), Arc::new(weights));
        floor = floor.min(j);
    }
    Ok(floor)
}

/// The async layout's [`StepHook`]: after a checkpoint between `checkpoint_every` steps,
/// writes the older weights later steps sample with ([`crate::async_resume`]).
pub(crate) struct SnapshotSaver {
    history: Arc<History>,
    k: usize,
    checkpoint_every: usize,
    total_steps: usize,
}

impl SnapshotSaver {
    /// After step `s.state.step`: drops the snapshots no later step samples with.
    pub(crate) fn forget_before(&self, s: &Session) {
        let m = s.state.step;
        let oldest = sampling_step(m + 1, self.k, self.checkpoint_every, 0).min(m);
        self.history
            .retain_from(version_of(oldest, m, s.state.policy_version));
    }
}

impl StepHook for SnapshotSaver {
    fn checkpoint_files(&mut self, s: &Session) -> Result<Vec<(String, Vec<u8>)>> {
        let m = s.state.step;
        let needed = steps_needed_after(m, self.k, self.checkpoint_every);
        if m >= self.total_steps || needed.is_empty() {
            return Ok(vec![]);
        }
        let mut snapshots = Vec::new();
        for j in needed {
            // Older than a resume without them (see crate::async_resume): never sampled with.
            let Some(w) = self.history.get(version_of(j, m, s.state.policy_version)) else {
                continue;
            };
            snapshots.push((j, w.weights()?.into_iter().collect()));
        }
        snapshot_files(m, &snapshots)
    }
}
