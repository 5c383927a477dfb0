//! The three actor traits the trainer implements, and what the controller tells them.

use std::sync::Arc;

use crate::cancel::CancelToken;
use crate::version::{PolicyVersion, Versioned};
use crate::weights::{Published, PublishedWeights};

/// Which actor (or hook) an error or an idle time belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActorKind {
    /// Rollout generation.
    Generator,
    /// Environments, verifiers, rewards.
    Rewarder,
    /// Loss, backward, optimizer, weight publishing.
    Trainer,
    /// The per-step or shutdown hook (metrics, checkpoints).
    Hooks,
}

impl ActorKind {
    /// Lower-case name used in messages and metric keys.
    pub fn name(self) -> &'static str {
        match self {
            ActorKind::Generator => "generator",
            ActorKind::Rewarder => "rewarder",
            ActorKind::Trainer => "trainer",
            ActorKind::Hooks => "hooks",
        }
    }

    /// What an index attached to this actor counts: generator batches or trainer steps.
    pub(crate) fn unit(self) -> &'static str {
        match self {
            ActorKind::Generator | ActorKind::Rewarder => "batch",
            ActorKind::Trainer | ActorKind::Hooks => "step",
        }
    }
}

impl std::fmt::Display for ActorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the generator gets for one batch.
pub struct GenerateContext<'a, W> {
    /// Index of this batch within the run (0, 1, 2, ...), in generation order.
    pub batch_index: u64,
    /// The newest published weights when the batch started. Record
    /// `weights.policy_version` on every trajectory.
    pub weights: Published<W>,
    pub(crate) slot: &'a PublishedWeights<W>,
    pub(crate) cancel: &'a CancelToken,
}

impl<W> GenerateContext<'_, W> {
    /// Whether the run is stopping (cancelled, finished or failed): a generator waiting for
    /// something of its own should give up.
    pub fn is_stopping(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Newer weights than `than`, if the trainer has published some since. A long rollout
    /// may call this between decode chunks, switch to them and start a new
    /// [`crate::VersionSegments`] segment (async mode; in sync mode this is always `None`).
    pub fn newer_weights(&self, than: PolicyVersion) -> Option<Published<W>> {
        self.slot.newer_than(than)
    }

    /// Waits until `version` (or a newer one) is published; false if the run stops first.
    /// A generator that keeps its own copies of older weights (async mode's pinned versions)
    /// calls this before sampling with `version`: the trainer hands its copy out before the
    /// controller publishes the version, and a trajectory may not claim an unpublished one.
    pub fn wait_published(&self, version: PolicyVersion) -> bool {
        while !self.is_stopping() {
            if self
                .slot
                .wait_for(version, std::time::Duration::from_millis(20))
                .is_some()
            {
                return true;
            }
        }
        false
    }

    /// Whether the run is stopping (Ctrl-C, another actor failed, last step done): a long
    /// rollout may return early (any result it returns is then discarded).
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }
}

/// Produces rollouts with the weights it is given.
pub trait Generator<W>: Send {
    /// One trajectory (or one group of trajectories that must be kept or dropped together).
    type Item: Versioned + Send;
    /// Generates one batch. Each item must report the policy version(s) that produced it
    /// ([`Versioned`]); the controller rejects versions newer than any published one.
    fn generate(&mut self, ctx: &GenerateContext<'_, W>) -> anyhow::Result<Vec<Self::Item>>;
}

/// What the rewarder gets for one batch.
pub struct ScoreContext<'a> {
    /// Index of the generator batch being scored.
    pub batch_index: u64,
    pub(crate) cancel: &'a CancelToken,
}

impl ScoreContext<'_> {
    /// Whether the run is stopping; a slow environment pool may return early.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }
}

/// Scores rollouts: environment pool, verifiers, reward functions.
pub trait Rewarder<I>: Send {
    /// A scored item; it keeps the policy versions of the rollout it came from.
    type Scored: Versioned + Send;
    /// Scores one batch. It may return fewer items (e.g. dynamic sampling); an empty result
    /// makes the controller use the next batch for the same step.
    fn score(&mut self, items: Vec<I>, ctx: &ScoreContext<'_>)
        -> anyhow::Result<Vec<Self::Scored>>;
}

/// What the trainer gets for one step.
pub struct TrainContext {
    /// Index of the step within this run (0, 1, 2, ...).
    pub step: u64,
    /// Version of the weights being trained (the last published); this step publishes
    /// `policy_version + 1`.
    pub policy_version: PolicyVersion,
    /// Per consumed item, in batch order: `policy_version - item.oldest_policy_version()`.
    /// The loss's importance weights (sampler vs trainer log-probs) correct for it.
    pub staleness: Vec<u64>,
    /// Generator batches this step's items came from.
    pub batch_indices: Vec<u64>,
    /// Set when the run is stopping.
    pub cancel: CancelToken,
}

/// Trains on scored batches and publishes weights.
pub trait Trainer<W> {
    /// Scored item it consumes (the rewarder's output).
    type Scored;
    /// Per-step metrics it returns (losses, rewards, ...), carried in the step record.
    type Report;
    /// One optimizer step on `batch` (never empty; stale items already dropped).
    fn train(
        &mut self,
        batch: Vec<Self::Scored>,
        ctx: &TrainContext,
    ) -> anyhow::Result<Self::Report>;
    /// Snapshots the updated weights as `policy_version` for the generator. Its duration is
    /// τ_S (`time/sync_s`); colocated, return a cheap shared snapshot rather than a deep copy.
    fn publish(&mut self, policy_version: PolicyVersion) -> anyhow::Result<Arc<W>>;
}
