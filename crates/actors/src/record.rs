//! Per-step records: the walls, idle times and staleness of every step, as typed structs that
//! render to the metric keys of `composer-telemetry` (`metrics::keys`).

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::version::PolicyVersion;

/// Metric keys written by [`StepRecord::metrics`]: re-exported from the typed schema in
/// `composer_telemetry::metric_keys`, so the writer here and the readers there cannot drift.
pub mod keys {
    pub use composer_telemetry::keys::{
        IDLE_GENERATOR, IDLE_REWARDER, IDLE_TRAINER, POLICY_VERSION, STALENESS_BOUND,
        STALENESS_DROPPED, STALENESS_MAX, STALENESS_MEAN, STALENESS_VALUES, TIME_REWARD,
        TIME_ROLLOUT, TIME_STEP, TIME_SYNC, TIME_TRAIN,
    };
    /// Number of items trained on in this step (`actors/consumed`).
    pub const CONSUMED: &str = composer_telemetry::keys::ACTORS_CONSUMED;
}

/// Where the step's time went, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepWalls {
    /// τ_R: generating the batch(es) this step consumed (in async mode, time spent on the
    /// generator thread, overlapping earlier steps).
    pub rollout_s: f64,
    /// τ_V: scoring them.
    pub reward_s: f64,
    /// τ_T: `Trainer::train`.
    pub train_s: f64,
    /// τ_S: `Trainer::publish` and the slot swap.
    pub sync_s: f64,
    /// Wall time of the step, from the end of the previous step (or the run's start).
    pub step_s: f64,
}

/// Seconds each actor spent blocked on queues or on the staleness gate since the previous
/// step record (async mode only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct IdleTimes {
    /// Generator: waiting for weights within the bound, or for room in its output queue.
    pub generator_s: f64,
    /// Rewarder: waiting for a generated batch, or for room in its output queue.
    pub rewarder_s: f64,
    /// Trainer: waiting for a scored batch.
    pub trainer_s: f64,
}

/// Staleness of the items a step consumed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StalenessStats {
    /// Per consumed item, `trainer version - item's oldest version`, in batch order.
    pub values: Vec<u64>,
    /// Items dropped (before scoring or at consumption) for exceeding `bound`.
    pub dropped: u64,
    /// The bound k (0 in sync mode).
    pub bound: u64,
}

impl StalenessStats {
    /// Mean of `values` (0 when empty).
    pub fn mean(&self) -> f64 {
        if self.values.is_empty() {
            0.0
        } else {
            self.values.iter().sum::<u64>() as f64 / self.values.len() as f64
        }
    }

    /// Max of `values` (0 when empty).
    pub fn max(&self) -> u64 {
        self.values.iter().copied().max().unwrap_or(0)
    }
}

/// Everything the controller measured for one step, plus the trainer's own report.
#[derive(Debug, Clone)]
pub struct StepRecord<R> {
    /// Index of the step within this run (0-based).
    pub step: u64,
    /// Version published at the end of the step.
    pub policy_version: PolicyVersion,
    /// Generator batches the step's items came from (more than one when batches came back
    /// empty after scoring or dropping).
    pub batch_indices: Vec<u64>,
    /// Items trained on.
    pub consumed: usize,
    /// The four walls and the step's wall time.
    pub walls: StepWalls,
    /// Idle time per actor (async mode only).
    pub idle: Option<IdleTimes>,
    /// Lags of the consumed items and the dropped count.
    pub staleness: StalenessStats,
    /// What `Trainer::train` returned.
    pub report: R,
}

impl<R> StepRecord<R> {
    /// The controller's metrics under the `composer-telemetry` keys, for the trainer to merge
    /// into its `metrics.jsonl` line (it adds `kind`, `step` and its own metrics).
    pub fn metrics(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert(keys::POLICY_VERSION.into(), json!(self.policy_version));
        m.insert(keys::TIME_ROLLOUT.into(), json!(self.walls.rollout_s));
        m.insert(keys::TIME_REWARD.into(), json!(self.walls.reward_s));
        m.insert(keys::TIME_TRAIN.into(), json!(self.walls.train_s));
        m.insert(keys::TIME_SYNC.into(), json!(self.walls.sync_s));
        m.insert(keys::TIME_STEP.into(), json!(self.walls.step_s));
        if let Some(idle) = &self.idle {
            m.insert(keys::IDLE_GENERATOR.into(), json!(idle.generator_s));
            m.insert(keys::IDLE_REWARDER.into(), json!(idle.rewarder_s));
            m.insert(keys::IDLE_TRAINER.into(), json!(idle.trainer_s));
        }
        m.insert(keys::STALENESS_MEAN.into(), json!(self.staleness.mean()));
        m.insert(keys::STALENESS_MAX.into(), json!(self.staleness.max()));
        m.insert(
            keys::STALENESS_DROPPED.into(),
            json!(self.staleness.dropped),
        );
        m.insert(keys::STALENESS_VALUES.into(), json!(self.staleness.values));
        m.insert(keys::STALENESS_BOUND.into(), json!(self.staleness.bound));
        m.insert(keys::CONSUMED.into(), json!(self.consumed));
        m
    }
}

/// How a run ended, given to [`crate::Hooks::on_shutdown`] after every actor thread joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// All steps done.
    Completed,
    /// The cancel token was set (Ctrl-C).
    Cancelled,
    /// An actor or hook failed; `message` is the error chain.
    Failed {
        /// Which one.
        actor: crate::ActorKind,
        /// The error, formatted with its causes.
        message: String,
    },
}

/// What a finished run returns.
#[derive(Debug, Clone, PartialEq)]
pub struct ControllerSummary {
    /// Steps completed (trained and published).
    pub steps: u64,
    /// The last published version.
    pub policy_version: PolicyVersion,
    /// Items trained on, over all steps.
    pub consumed: u64,
    /// Items dropped as stale, over all steps.
    pub dropped: u64,
    /// Wall seconds of the whole run, shutdown included.
    pub wall_s: f64,
}
