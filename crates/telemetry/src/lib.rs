//! composer-telemetry: what the trainer uses to show users what happened and where the time went.
//!
//! - [`metrics`]: the per-step metrics JSONL file ([`MetricsWriter`], [`read_metrics`]) and the
//!   metric key contract ([`keys`]).
//! - [`progress`]: the terminal progress bar ([`TrainProgress`]).
//! - [`summary`]: the walls summary of a run ([`RunSummary`]).
//! - [`report`]: the self-contained HTML run report ([`write_report`]).
//! - [`plan`]: the `composer-rl plan` wall estimator ([`plan_from_shape`], [`plan_from_run`],
//!   [`plan_cli`]); formulas in `crates/telemetry/PLAN.md`.

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

pub mod metrics;
pub mod plan;
pub mod progress;
pub mod report;
pub mod summary;

pub use metrics::{keys, read_metrics, MetricsWriter};
pub use plan::{
    plan_cli, plan_from_run, plan_from_run_with, plan_from_shape, GpuKind, GpuSpec, Layout,
    LayoutEstimate, MemoryCheck, ModelArch, Plan, PlanOptions, Walls, WorkloadShape,
};
pub use progress::{StepSnapshot, TrainProgress};
pub use report::{report_cli, write_report};
pub use summary::{percentile, trained_tokens_total, RunSummary, WallStat};
