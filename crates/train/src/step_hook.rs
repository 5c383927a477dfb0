//! [`StepHook`]: what a layout wrapped around the step loop (a DiLoCo replica, the async
//! layout's snapshot writer) does at the loop's edges.

use anyhow::Result;
use composer_telemetry::TrainProgress;

use crate::session::Session;

/// What a layout wrapped around the step loop does at its edges: DiLoCo's replica joins its
/// store before the first step, runs the outer step after every inner step and saves its outer
/// state with every checkpoint. Every method has a do-nothing default ([`NoHook`]).
pub trait StepHook {
    /// After set-up, warm-up and the reference policy, before the first step; may move
    /// `s.state.step` (a replica joining a run in progress).
    fn before_loop(&mut self, _s: &mut Session, _progress: &TrainProgress) -> Result<()> {
        Ok(())
    }
    /// The prompt-draw stream of RL step `step` (default: `step`).
    fn sample_stream(&self, step: usize) -> usize {
        step
    }
    /// After the step's update and publish (skipped steps included), before its metrics.
    fn after_step(&mut self, _s: &mut Session, _step: usize) -> Result<StepExtras> {
        Ok(StepExtras::default())
    }
    /// Files to keep inside every checkpoint of the loop (written with it, atomically).
    fn checkpoint_files(&mut self, _s: &Session) -> Result<Vec<(String, Vec<u8>)>> {
        Ok(vec![])
    }
    /// A note for the progress line.
    fn note(&self) -> Option<String> {
        None
    }
    /// Whether `[train] stop_at_accuracy` may end the run early (not for a DiLoCo replica,
    /// whose peers would wait for it at the next round).
    fn allows_early_stop(&self) -> bool {
        true
    }
}

/// What [`StepHook::after_step`] adds to the step's metrics.
#[derive(Debug, Default)]
pub struct StepExtras {
    /// Keys added to the step's `train` line.
    pub keys: serde_json::Map<String, serde_json::Value>,
    /// Whole lines written after it.
    pub lines: Vec<serde_json::Value>,
}

/// The plain trainer: no hook.
pub struct NoHook;

impl StepHook for NoHook {}
