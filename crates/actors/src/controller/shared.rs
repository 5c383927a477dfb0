//! What the controller's threads share (the failure slot, idle counters) and the
//! bookkeeping of one step's input (staleness checks, dropping stale items).
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::actor::ActorKind;
use crate::cancel::CancelToken;
use crate::version::{PolicyVersion, Versioned};
use crate::weights::PublishedWeights;

/// A generated batch on its way to the trainer.
pub(super) struct Envelope<T> {
    pub(super) batch_index: u64,
    pub(super) items: Vec<T>,
    pub(super) rollout_s: f64,
    pub(super) reward_s: f64,
    /// Dropped as stale before scoring.
    pub(super) dropped: u64,
}

/// The first failure of a run (later ones are consequences of the stop).
pub(super) struct Failure {
    pub(super) actor: ActorKind,
    pub(super) index: u64,
    pub(super) error: anyhow::Error,
}

/// Shared state of one async run.
pub(super) struct Shared<'a, W> {
    pub(super) slot: &'a PublishedWeights<W>,
    pub(super) stop: CancelToken,
    pub(super) failure: Mutex<Option<Failure>>,
    pub(super) idle_generator_ns: AtomicU64,
    pub(super) idle_rewarder_ns: AtomicU64,
}

impl<W> Shared<'_, W> {
    pub(super) fn fail(&self, actor: ActorKind, index: u64, error: anyhow::Error) {
        let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            tracing::error!(actor = actor.name(), index, "actor failed: {error:#}");
            *slot = Some(Failure {
                actor,
                index,
                error,
            });
        }
        drop(slot);
        self.stop.cancel();
    }
}

pub(super) fn add_idle(counter: &AtomicU64, since: Instant) {
    counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

pub(super) fn take_idle_s(counter: &AtomicU64) -> f64 {
    counter.swap(0, Ordering::Relaxed) as f64 * 1e-9
}

/// Runs an actor call, turning a panic into an error so one actor's panic stops the run
/// cleanly instead of leaving the others waiting.
pub(super) fn guarded<T>(call: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(result) => result,
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".to_string());
            Err(anyhow::anyhow!("panicked: {message}"))
        }
    }
}

/// Rejects items claiming a version no one has published yet.
pub(super) fn check_not_future<T: Versioned>(
    items: &[T],
    published: PolicyVersion,
) -> anyhow::Result<()> {
    if let Some(v) = items
        .iter()
        .map(Versioned::oldest_policy_version)
        .find(|&v| v > published)
    {
        anyhow::bail!(
            "a trajectory reports policy version {v}, newer than the newest published version \
             {published}: record the version of the weights given in GenerateContext"
        );
    }
    Ok(())
}

/// Keeps the items within `bound` of `trainer_version`; returns them, their lags, and the
/// dropped count. Order is preserved.
pub(super) fn drop_stale<T: Versioned>(
    items: Vec<T>,
    trainer_version: PolicyVersion,
    bound: u64,
) -> (Vec<T>, Vec<u64>, u64) {
    let mut kept = Vec::with_capacity(items.len());
    let mut lags = Vec::with_capacity(items.len());
    let mut dropped = 0;
    for item in items {
        let lag = trainer_version.saturating_sub(item.oldest_policy_version());
        if lag > bound {
            dropped += 1;
        } else {
            kept.push(item);
            lags.push(lag);
        }
    }
    (kept, lags, dropped)
}

/// A step's input, assembled from one or more envelopes.
pub(super) struct StepInput<T> {
    pub(super) items: Vec<T>,
    pub(super) lags: Vec<u64>,
    pub(super) batch_indices: Vec<u64>,
    pub(super) rollout_s: f64,
    pub(super) reward_s: f64,
    pub(super) dropped: u64,
    pub(super) empty_batches: u32,
}

impl<T: Versioned> StepInput<T> {
    pub(super) fn new() -> Self {
        Self {
            items: Vec::new(),
            lags: Vec::new(),
            batch_indices: Vec::new(),
            rollout_s: 0.0,
            reward_s: 0.0,
            dropped: 0,
            empty_batches: 0,
        }
    }

    /// Adds an envelope's fresh items; returns whether the step now has something to train on.
    pub(super) fn absorb(
        &mut self,
        envelope: Envelope<T>,
        trainer_version: PolicyVersion,
        bound: u64,
    ) -> bool {
        let (items, lags, dropped) = drop_stale(envelope.items, trainer_version, bound);
        self.batch_indices.push(envelope.batch_index);
        self.rollout_s += envelope.rollout_s;
        self.reward_s += envelope.reward_s;
        self.dropped += envelope.dropped + dropped;
        if items.is_empty() {
            self.empty_batches += 1;
            false
        } else {
            self.items = items;
            self.lags = lags;
            true
        }
    }
}
