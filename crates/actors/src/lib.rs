//! composer-actors: generator, rewarder and trainer as actors under one controller, with
//! bounded queues, policy versions on every trajectory and a staleness bound (issue 6 §1–4).
//!
//! # Layout
//!
//! The trainer crate implements three traits — [`Generator`] (rollouts), [`Rewarder`]
//! (environment pool + verifiers) and [`Trainer`] (loss/optimizer step + [`Trainer::publish`])
//! — and hands them to [`Controller::run`] with a [`Hooks`] implementation (metrics line,
//! checkpoint). Weights of any type `W` travel as `Arc<W>` through a [`PublishedWeights`]
//! slot: publishing swaps a pointer, so colocated publishing copies nothing beyond what the
//! trainer snapshots in `publish`; the time of `publish` plus the swap is τ_S (`time/sync_s`).
//!
//! # Modes
//!
//! * [`Mode::Sync`]: generate → score → train → publish, one after the other on the calling
//!   thread, nothing reordered: same seed, same run. Every item must be on-policy (lag 0);
//!   a stale one is dropped and counted like in async mode.
//! * [`Mode::Async`] `{ max_staleness: k, queue_capacity }`: the generator and the rewarder
//!   run on their own threads, connected to the trainer (the calling thread) by two bounded
//!   FIFO queues; the trainer consumes one batch per step in generation order. Batch `i` is
//!   started only once the published version is `>= v0 + i - k` (PRIME-RL's async level), so
//!   the generator runs at most k steps ahead and in normal operation nothing is wasted. As a
//!   safety net the controller never trusts the generator: the rewarder drops items already
//!   past the bound before scoring them, and the trainer drops items whose lag
//!   `trainer version - item.oldest_policy_version()` exceeds k at consumption. Dropped items
//!   are counted (`staleness/dropped`), never used. A batch left empty is skipped and the
//!   next one taken for the same step (at most `max_empty_batches` in a row).
//!
//! A rollout that spans a weight update (it may call [`GenerateContext::newer_weights`]
//! between decode chunks) records per-segment versions in a [`VersionSegments`]; its
//! staleness is that of its oldest segment. The unit of dropping is the [`Versioned`] item:
//! make the item a whole GRPO group (`Vec<Trajectory>` is `Versioned`) to drop groups whole.
//!
//! # Records
//!
//! Each step yields a [`StepRecord`] (walls τ_R, τ_V, τ_T, τ_S, step time, idle time per actor
//! in async mode, staleness values/mean/max/dropped, and the trainer's report);
//! [`StepRecord::metrics`] renders it under the `composer-telemetry` metric keys.
//!
//! # Shutdown
//!
//! A [`CancelToken`] (set by the binary's Ctrl-C handler) or any actor error or panic stops
//! the run: every wait on a queue or on the weight slot is bounded by
//! `ControllerConfig::poll_interval`, so threads notice the stop within one interval after
//! their current actor call returns (long calls may poll `ctx.is_cancelled()`); all threads
//! are joined, then [`Hooks::on_shutdown`] runs (keep the last checkpoint), then
//! [`Controller::run`] returns [`ControllerError::Actor`] naming the actor, the batch or step
//! and the cause, or [`ControllerError::Cancelled`].

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

mod actor;
mod cancel;
mod controller;
mod queue;
pub mod record;
mod version;
mod weights;

pub use actor::{
    ActorKind, GenerateContext, Generator, Rewarder, ScoreContext, TrainContext, Trainer,
};
pub use cancel::CancelToken;
pub use controller::{Controller, ControllerConfig, ControllerError, Hooks, Mode, NoHooks};
pub use record::{ControllerSummary, IdleTimes, RunEnd, StalenessStats, StepRecord, StepWalls};
pub use version::{PolicyVersion, VersionSegment, VersionSegments, Versioned};
pub use weights::{Published, PublishedWeights};
