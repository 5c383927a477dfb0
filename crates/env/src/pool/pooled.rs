//! [`PooledEnv`]: an env from an [`EnvPool`](super::EnvPool) holding a slot of its server,
//! timing and counting every call.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;

use crate::env::{Action, Env, EnvError, ResetOptions, StepResult};

use super::stats::Recorder;
use super::PoolConfig;

/// An env from an [`EnvPool`]: holds a slot of its server until dropped, times and counts
/// every call.
pub struct PooledEnv {
    pub(super) env: Box<dyn Env>,
    pub(super) server_index: usize,
    pub(super) server_name: String,
    pub(super) recorder: Arc<Mutex<Recorder>>,
    pub(super) idle: Arc<Mutex<Vec<Box<dyn Env>>>>,
    pub(super) call_timeout: Duration,
    pub(super) limit: Arc<AtomicUsize>,
    /// The server slot; `None` once given up for good by [`PooledEnv::lower_limit`].
    pub(super) permit: Option<OwnedSemaphorePermit>,
}

impl PooledEnv {
    /// The server this env runs on (name, index in the pool).
    pub fn server(&self) -> (&str, usize) {
        (&self.server_name, self.server_index)
    }

    /// Gives the env back to its server's idle list (not closed) for the next episode, and
    /// frees the slot. Use only after an episode that ended cleanly.
    pub fn recycle(self) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(self.env);
        }
    }

    pub(super) fn record_failure(&self, e: &EnvError) {
        if let Ok(mut r) = self.recorder.lock() {
            r.failure(&self.server_name, e);
        }
    }

    /// Lowers the server's concurrency limit by one (never below 1) by retiring this env's
    /// slot for good; false when the limit is already 1.
    pub(super) fn lower_limit(&mut self) -> bool {
        let lowered = self
            .limit
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| {
                (l > 1).then(|| l - 1)
            });
        match lowered {
            Ok(was) => {
                if let Some(p) = self.permit.take() {
                    p.forget();
                }
                tracing::warn!(
                    "env server {}: refused a session at capacity; lowering its concurrency \
                     from {was} to {} (the server holds fewer sessions than max_concurrent)",
                    self.server_name,
                    was - 1
                );
                true
            }
            Err(_) => false,
        }
    }

    /// Counts a finished episode (and starts the server's cooldown after repeated failures).
    pub(super) fn finish_episode(&self, failed: bool, cfg: &PoolConfig) {
        if let Ok(mut r) = self.recorder.lock() {
            if failed {
                r.episodes_failed += 1;
                r.consecutive_failed += 1;
                if r.consecutive_failed >= cfg.failures_before_cooldown {
                    r.cooldown_until = Some(Instant::now() + cfg.cooldown);
                }
            } else {
                r.episodes_ok += 1;
                r.consecutive_failed = 0;
                r.cooldown_until = None;
                r.success();
            }
        }
    }

    pub(super) fn record(
        &mut self,
        result: &Result<StepResult, EnvError>,
        elapsed: f64,
        is_step: bool,
    ) {
        let retried = self.env.take_retried_failures();
        if let Ok(mut r) = self.recorder.lock() {
            for e in &retried {
                r.failure(&self.server_name, e);
            }
            match result {
                Ok(_) if is_step => r.step_s.push(elapsed),
                Ok(_) => r.reset_s.push(elapsed),
                Err(e) => r.failure(&self.server_name, e),
            }
        }
    }
}

#[async_trait]
impl Env for PooledEnv {
    async fn reset(&mut self, opts: ResetOptions) -> Result<StepResult, EnvError> {
        let timeout = self.call_timeout;
        let start = Instant::now();
        let result = match tokio::time::timeout(timeout, self.env.reset(opts)).await {
            Ok(r) => r,
            Err(_) => Err(EnvError::Timeout {
                seconds: timeout.as_secs_f64(),
                during: "reset".into(),
            }),
        };
        self.record(&result, start.elapsed().as_secs_f64(), false);
        result
    }

    async fn step(&mut self, action: Action) -> Result<StepResult, EnvError> {
        let timeout = self.call_timeout;
        let start = Instant::now();
        let result = match tokio::time::timeout(timeout, self.env.step(action)).await {
            Ok(r) => r,
            Err(_) => Err(EnvError::Timeout {
                seconds: timeout.as_secs_f64(),
                during: "step".into(),
            }),
        };
        self.record(&result, start.elapsed().as_secs_f64(), true);
        result
    }

    async fn state(&mut self) -> Result<Value, EnvError> {
        let timeout = self.call_timeout;
        match tokio::time::timeout(timeout, self.env.state()).await {
            Ok(r) => r,
            Err(_) => Err(EnvError::Timeout {
                seconds: timeout.as_secs_f64(),
                during: "state".into(),
            }),
        }
    }

    async fn end_truncated(&mut self) -> Result<Option<StepResult>, EnvError> {
        // Grading a cut-short episode is a step (a `submit`), timed and recorded as one.
        let timeout = self.call_timeout;
        let start = Instant::now();
        let result = match tokio::time::timeout(timeout, self.env.end_truncated()).await {
            Ok(r) => r,
            Err(_) => Err(EnvError::Timeout {
                seconds: timeout.as_secs_f64(),
                during: "grading at the turn limit".into(),
            }),
        };
        let recorded = match &result {
            Ok(None) => None,
            Ok(Some(r)) => Some(Ok(r.clone())),
            Err(e) => Some(Err(e.clone())),
        };
        if let Some(r) = recorded {
            self.record(&r, start.elapsed().as_secs_f64(), true);
        }
        result
    }

    async fn close(&mut self) -> Result<(), EnvError> {
        let timeout = self.call_timeout;
        match tokio::time::timeout(timeout, self.env.close()).await {
            Ok(r) => r,
            Err(_) => Err(EnvError::Timeout {
                seconds: timeout.as_secs_f64(),
                during: "close".into(),
            }),
        }
    }

    fn action_schema(&self) -> Option<Value> {
        self.env.action_schema()
    }

    fn takes_turn_text(&self) -> bool {
        self.env.takes_turn_text()
    }

    fn observation_schema(&self) -> Value {
        self.env.observation_schema()
    }

    fn state_schema(&self) -> Value {
        self.env.state_schema()
    }

    fn metadata(&self) -> Value {
        self.env.metadata()
    }
}
