//! composer-telemetry: what the trainer uses to show users what happened and where the time went.
//!
//! - [`metrics`]: the per-step metrics JSONL file ([`MetricsWriter`], [`read_metrics`]) and the
//!   metric key contract ([`keys`], generated from the typed schema in [`metric_keys`]).
//! - [`progress`]: the terminal progress bar ([`TrainProgress`]).
//! - [`summary`]: the walls summary of a run ([`RunSummary`]).
//! - [`report`]: the self-contained HTML run report ([`write_report`]).
//!
//! The `composer-rl plan` estimator lives in its own crate, `composer-plan`, which reads runs
//! through this crate's public API (telemetry does not depend on it).

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]
#![deny(missing_docs)]

pub mod metric_keys;
pub mod metrics;
pub mod progress;
pub mod report;
pub mod summary;

pub use metrics::{keys, read_metrics, read_metrics_checked, MetricsWriter};
pub use progress::{StepSnapshot, TrainProgress};
pub use report::{report_cli, write_report};
pub use summary::{percentile, trained_tokens_total, RunSummary, WallStat};
