//! The pool's statistics: failure counts by cause, latency summaries, per-server and pool
//! totals, and the per-server recorder behind them.
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::env::{EnvError, FailureKind};

/// Failure counts by cause (see [`FailureKind`]), and the text of the latest failure.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureCounts {
    /// Calls or episodes past their timeout.
    pub timeout: u64,
    /// Connection reset/closed (server restarting).
    pub connection: u64,
    /// Connection refused: nothing listening (server down).
    #[serde(default)]
    pub refused: u64,
    /// Capacity refusals left after retries.
    pub capacity: u64,
    /// Server/env errors.
    pub server: u64,
    /// Rejected or unparseable actions.
    pub invalid_action: u64,
    /// Protocol violations.
    pub protocol: u64,
    /// The latest failure as `server: error text` (what the server said), so the cause
    /// reaches the metrics and the log rather than only a count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

impl FailureCounts {
    /// Adds one failure of `kind`.
    pub fn add(&mut self, kind: FailureKind) {
        match kind {
            FailureKind::Timeout => self.timeout += 1,
            FailureKind::Connection => self.connection += 1,
            FailureKind::Refused => self.refused += 1,
            FailureKind::Capacity => self.capacity += 1,
            FailureKind::Server => self.server += 1,
            FailureKind::InvalidAction => self.invalid_action += 1,
            FailureKind::Protocol => self.protocol += 1,
        }
    }

    /// All failures.
    pub fn total(&self) -> u64 {
        self.timeout
            + self.connection
            + self.refused
            + self.capacity
            + self.server
            + self.invalid_action
            + self.protocol
    }

    pub(super) fn merge(&mut self, o: &FailureCounts) {
        self.timeout += o.timeout;
        self.connection += o.connection;
        self.refused += o.refused;
        self.capacity += o.capacity;
        self.server += o.server;
        self.invalid_action += o.invalid_action;
        self.protocol += o.protocol;
    }
}

/// Summary of latency samples in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub count: usize,
    /// Mean.
    pub mean_s: f64,
    /// Median (nearest rank).
    pub p50_s: f64,
    /// 95th percentile (nearest rank).
    pub p95_s: f64,
    /// Maximum.
    pub max_s: f64,
}

impl LatencySummary {
    /// Summarises samples (seconds); percentiles by nearest rank: the value at
    /// `ceil(p * n) - 1` of the sorted samples.
    pub fn from_samples(samples: &[f64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let rank = |p: f64| sorted[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
        LatencySummary {
            count: n,
            mean_s: sorted.iter().sum::<f64>() / n as f64,
            p50_s: rank(0.5),
            p95_s: rank(0.95),
            max_s: sorted[n - 1],
        }
    }
}

/// Statistics of one server of the pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerStats {
    /// The server's name.
    pub name: String,
    /// Latency of `reset` calls.
    pub reset: LatencySummary,
    /// Latency of `step` calls (the τ_V wall).
    pub step: LatencySummary,
    /// Failures by cause.
    pub failures: FailureCounts,
    /// Episodes finished without an env failure.
    pub episodes_ok: u64,
    /// Episodes that failed (env error or episode timeout).
    pub episodes_failed: u64,
    /// Episodes running now.
    pub in_flight: usize,
    /// Envs made by the factory (OpenEnv: sessions opened); below the episode count when
    /// envs are reused.
    pub envs_created: u64,
    /// Episodes this server may run at once now: the configured `max_concurrent`, lowered
    /// by one per capacity refusal (the server holds fewer sessions than configured).
    #[serde(default)]
    pub max_concurrent: usize,
    /// Given up for good: every connection failed for longer than the down budget.
    #[serde(default)]
    pub gone: bool,
}

/// Statistics of the whole pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolStats {
    /// Per server, in the order they were added.
    pub servers: Vec<ServerStats>,
    /// `reset` latency over all servers.
    pub reset: LatencySummary,
    /// `step` latency over all servers.
    pub step: LatencySummary,
    /// Failures over all servers.
    pub failures: FailureCounts,
    /// Episodes finished without an env failure.
    pub episodes_ok: u64,
    /// Episodes that failed.
    pub episodes_failed: u64,
}

#[derive(Default)]
pub(super) struct Recorder {
    pub(super) reset_s: Vec<f64>,
    pub(super) step_s: Vec<f64>,
    pub(super) failures: FailureCounts,
    pub(super) episodes_ok: u64,
    pub(super) episodes_failed: u64,
    pub(super) consecutive_failed: u32,
    pub(super) cooldown_until: Option<Instant>,
    pub(super) envs_created: u64,
    /// First connection failure with no completed episode since (None: the server answers).
    pub(super) down_since: Option<Instant>,
    /// Latest connection failure.
    pub(super) down_last: Option<Instant>,
    /// When the last failure was logged, and how many were not logged since (one line per
    /// distinct error, else at most one every [`LOG_EVERY`]: a dead server must not flood
    /// the log).
    pub(super) logged_at: Option<Instant>,
    pub(super) suppressed: u64,
    /// When `failures.last_error` was recorded.
    pub(super) error_at: Option<Instant>,
}

/// Least interval between two log lines of the same repeated failure of one server.
pub(super) const LOG_EVERY: Duration = Duration::from_secs(10);

impl Recorder {
    /// Counts a failure, keeps its text, logs it (rate-limited), and tracks how long the
    /// server has refused every connection.
    pub(super) fn failure(&mut self, server: &str, e: &EnvError) {
        let kind = e.kind();
        self.failures.add(kind);
        let text = format!("{server}: {e}");
        let now = Instant::now();
        let new_text = self.failures.last_error.as_deref() != Some(text.as_str());
        if new_text || self.logged_at.is_none_or(|t| now - t >= LOG_EVERY) {
            let again = if self.suppressed > 0 {
                format!(" ({} more failures since the last line)", self.suppressed)
            } else {
                String::new()
            };
            tracing::warn!("env server {server}: {kind:?} failure: {e}{again}");
            self.logged_at = Some(now);
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
        }
        self.failures.last_error = Some(text);
        self.error_at = Some(now);
        if matches!(kind, FailureKind::Refused | FailureKind::Connection) {
            self.down_since.get_or_insert(now);
            self.down_last = Some(now);
        }
    }

    /// An episode completed: the server is up. (A call that succeeds is not enough: a server
    /// that resets but drops every step is as unusable as one that refuses connections.)
    pub(super) fn success(&mut self) {
        self.down_since = None;
        self.down_last = None;
    }

    /// Whether every connection has failed for at least `budget` (observed failures at both
    /// ends of the window, none succeeding in between).
    pub(super) fn gone(&self, budget: Duration) -> bool {
        match (self.down_since, self.down_last) {
            (Some(first), Some(last)) => last - first >= budget,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        // Nearest rank on 1..=20: p50 = 10th value, p95 = 19th value.
        let samples: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        let s = LatencySummary::from_samples(&samples);
        assert_eq!((s.count, s.p50_s, s.p95_s, s.max_s), (20, 10.0, 19.0, 20.0));
        assert_eq!(s.mean_s, 10.5);
        assert_eq!(LatencySummary::from_samples(&[]).count, 0);
    }
}
