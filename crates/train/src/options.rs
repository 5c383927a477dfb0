//! How `composer-rl train` was invoked ([`TrainOptions`]) and what a finished run reports
//! ([`RunOutcome`]).

use std::path::PathBuf;

use crate::signals::Interrupt;

/// How `composer-rl train` was invoked.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Recipe file; `None` = the embedded default.
    pub recipe_path: Option<PathBuf>,
    /// Continue the run in this directory from its last checkpoint.
    pub resume: Option<PathBuf>,
    /// Log lines instead of a progress bar.
    pub quiet: bool,
    /// Overrides `[output] run_dir`.
    pub run_dir_override: Option<PathBuf>,
    /// Overrides `[train] steps`.
    pub max_steps_override: Option<usize>,
    /// A fresh run may replace the run already in the run directory (`--overwrite`).
    pub overwrite: bool,
}

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutcome {
    /// The run directory.
    pub run_dir: PathBuf,
    /// Last completed RL step.
    pub steps_completed: usize,
    /// Greedy accuracy after the warm-up (before RL), if measured.
    pub warmup_accuracy: Option<f64>,
    /// Last eval accuracy.
    pub final_accuracy: Option<f64>,
    /// First eval (step, completions generated, seconds since start) at or above
    /// `[train] stop_at_accuracy` (or 0.9 when that is 0).
    pub reached_target: Option<(usize, u64, f64)>,
    /// Completions generated in RL.
    pub samples_generated: u64,
    /// Steps skipped for non-finite loss or gradients.
    pub skipped_steps: usize,
    /// Wall-clock seconds of this invocation.
    pub wall_s: f64,
    /// Stopped by this signal (a checkpoint was written, unless it came during the warm-up).
    pub interrupted: Option<Interrupt>,
}
