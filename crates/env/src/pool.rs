//! [`EnvPool`]: concurrent episodes over several servers/factories, bounded per server, with
//! per-call latency samples (p50/p95: the τ_V wall) and failure counts by cause.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::env::{Action, Env, EnvError, EnvFactory, FailureKind, ResetOptions, StepResult};
use crate::episode::{run_episode, Episode, EpisodeConfig, EpisodeEnd, TurnPolicy};

/// Configuration of an [`EnvPool`].
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Limit of one env call (reset/step/state/close) at the pool level; built-in envs have no
    /// timeout of their own, remote ones also apply their client's.
    pub call_timeout: Duration,
    /// Limit of one whole episode in [`EnvPool::run_episode`].
    pub episode_timeout: Duration,
    /// After this many consecutive failed episodes a server is skipped for `cooldown`
    /// (unless every server is cooling down), so a dead server does not eat episodes.
    pub failures_before_cooldown: u32,
    /// How long a failing server is skipped.
    pub cooldown: Duration,
    /// Keep the env of a successful episode for the next one (OpenEnv: the same WebSocket
    /// session, reset again) instead of closing it: saves a connection per episode. Idle
    /// sessions keep their server slot (at most `max_concurrent` per server).
    pub reuse_envs: bool,
    /// How long a server may fail every connection (refused, reset, closed) without one
    /// success before the pool gives it up for good; when every server is given up,
    /// [`EnvPool::acquire`] fails with an error naming the servers and their last errors,
    /// instead of retrying for minutes.
    pub server_down_budget: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            call_timeout: Duration::from_secs(120),
            episode_timeout: Duration::from_secs(600),
            failures_before_cooldown: 3,
            cooldown: Duration::from_secs(10),
            reuse_envs: true,
            server_down_budget: Duration::from_secs(60),
        }
    }
}

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

    fn merge(&mut self, o: &FailureCounts) {
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
struct Recorder {
    reset_s: Vec<f64>,
    step_s: Vec<f64>,
    failures: FailureCounts,
    episodes_ok: u64,
    episodes_failed: u64,
    consecutive_failed: u32,
    cooldown_until: Option<Instant>,
    envs_created: u64,
    /// First connection failure with no completed episode since (None: the server answers).
    down_since: Option<Instant>,
    /// Latest connection failure.
    down_last: Option<Instant>,
    /// When the last failure was logged, and how many were not logged since (one line per
    /// distinct error, else at most one every [`LOG_EVERY`]: a dead server must not flood
    /// the log).
    logged_at: Option<Instant>,
    suppressed: u64,
    /// When `failures.last_error` was recorded.
    error_at: Option<Instant>,
}

/// Least interval between two log lines of the same repeated failure of one server.
const LOG_EVERY: Duration = Duration::from_secs(10);

impl Recorder {
    /// Counts a failure, keeps its text, logs it (rate-limited), and tracks how long the
    /// server has refused every connection.
    fn failure(&mut self, server: &str, e: &EnvError) {
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
    fn success(&mut self) {
        self.down_since = None;
        self.down_last = None;
    }

    /// Whether every connection has failed for at least `budget` (observed failures at both
    /// ends of the window, none succeeding in between).
    fn gone(&self, budget: Duration) -> bool {
        match (self.down_since, self.down_last) {
            (Some(first), Some(last)) => last - first >= budget,
            _ => false,
        }
    }
}

struct Server {
    name: String,
    factory: EnvFactory,
    permits: Arc<Semaphore>,
    /// The current concurrency limit (lowered on capacity refusals, never below 1).
    limit: Arc<AtomicUsize>,
    recorder: Arc<Mutex<Recorder>>,
    /// Envs of finished episodes, ready for reuse.
    idle: Arc<Mutex<Vec<Box<dyn Env>>>>,
}

/// Runs episodes concurrently over one or more env factories (built-in envs or OpenEnv
/// servers alike), at most `max_concurrent` at a time per server.
pub struct EnvPool {
    config: PoolConfig,
    servers: Vec<Server>,
    next: AtomicUsize,
}

impl EnvPool {
    /// An empty pool; add servers with [`EnvPool::add_server`].
    pub fn new(config: PoolConfig) -> Self {
        EnvPool {
            config,
            servers: Vec::new(),
            next: AtomicUsize::new(0),
        }
    }

    /// Adds a server (or built-in env factory) running at most `max_concurrent` episodes.
    pub fn add_server(
        &mut self,
        name: impl Into<String>,
        factory: EnvFactory,
        max_concurrent: usize,
    ) {
        let max_concurrent = max_concurrent.max(1);
        self.servers.push(Server {
            name: name.into(),
            factory,
            permits: Arc::new(Semaphore::new(max_concurrent)),
            limit: Arc::new(AtomicUsize::new(max_concurrent)),
            recorder: Arc::new(Mutex::new(Recorder::default())),
            idle: Arc::new(Mutex::new(Vec::new())),
        });
    }

    /// Number of servers.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    /// Whether the pool has no server.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// Waits for a free slot on a server not cooling down (round-robin among those with a
    /// free slot; any server's slot when all are busy) and makes an env there.
    pub async fn acquire(&self) -> anyhow::Result<PooledEnv> {
        anyhow::ensure!(!self.servers.is_empty(), "EnvPool has no server");
        let now = Instant::now();
        let budget = self.config.server_down_budget;
        let gone = |s: &Server| s.recorder.lock().ok().is_some_and(|r| r.gone(budget));
        let alive: Vec<usize> = (0..self.servers.len())
            .filter(|&i| !gone(&self.servers[i]))
            .collect();
        if alive.is_empty() {
            let why: Vec<String> = self
                .servers
                .iter()
                .map(|s| {
                    let last = s
                        .recorder
                        .lock()
                        .ok()
                        .and_then(|r| r.failures.last_error.clone())
                        .unwrap_or_default();
                    format!("`{}` (last error: {last})", s.name)
                })
                .collect();
            anyhow::bail!(
                "every env server is down: each failed every connection for more than {:.0} s \
                 (the pool's server_down_budget); giving up: {}",
                budget.as_secs_f64(),
                why.join("; ")
            );
        }
        let cooling = |s: &Server| {
            s.recorder
                .lock()
                .ok()
                .and_then(|r| r.cooldown_until)
                .is_some_and(|t| t > now)
        };
        let mut eligible: Vec<usize> = alive
            .iter()
            .copied()
            .filter(|&i| !cooling(&self.servers[i]))
            .collect();
        if eligible.is_empty() {
            eligible = alive;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let n = eligible.len();
        let mut chosen = None;
        for k in 0..n {
            let i = eligible[(start + k) % n];
            if let Ok(permit) = self.servers[i].permits.clone().try_acquire_owned() {
                chosen = Some((i, permit));
                break;
            }
        }
        let (index, permit) = match chosen {
            Some(c) => c,
            None => {
                let waits = eligible.iter().map(|&i| {
                    let sem = self.servers[i].permits.clone();
                    Box::pin(async move { (i, sem.acquire_owned().await) })
                });
                let ((i, permit), _, _) = futures::future::select_all(waits).await;
                (i, permit?)
            }
        };
        let server = &self.servers[index];
        let reused = server.idle.lock().ok().and_then(|mut idle| idle.pop());
        let env = match reused {
            Some(env) => env,
            None => {
                let env = (server.factory)().map_err(|e| {
                    e.context(format!("creating an env on server `{}`", server.name))
                })?;
                if let Ok(mut r) = server.recorder.lock() {
                    r.envs_created += 1;
                }
                env
            }
        };
        Ok(PooledEnv {
            env,
            server_index: index,
            server_name: server.name.clone(),
            recorder: server.recorder.clone(),
            idle: server.idle.clone(),
            call_timeout: self.config.call_timeout,
            limit: server.limit.clone(),
            permit: Some(permit),
        })
    }

    /// Runs one episode on a pooled env under the episode timeout, and counts it. After a
    /// clean episode the env is kept for the next one (`reuse_envs`), else closed.
    /// Env failures come back inside the [`Episode`] (`end = EnvFailed`); only policy errors
    /// and pool misconfiguration are `Err`.
    pub async fn run_episode<P: TurnPolicy + ?Sized>(
        &self,
        policy: &mut P,
        reset: ResetOptions,
        cfg: &EpisodeConfig,
    ) -> anyhow::Result<Episode> {
        loop {
            let mut env = self.acquire().await?;
            let episode = self.play(&mut env, policy, reset.clone(), cfg).await?;
            // A capacity refusal at reset means the server holds fewer sessions than our
            // limit: lower the limit for that server and play the episode again once a slot
            // is really free, rather than fail it (a failed episode is replaced by a copy of
            // a peer) or keep knocking at a full server.
            let refused_at_capacity = matches!(
                &episode.end,
                EpisodeEnd::EnvFailed {
                    kind: FailureKind::Capacity,
                    ..
                }
            ) && episode.turns.is_empty();
            if refused_at_capacity && env.lower_limit() {
                let _ = tokio::time::timeout(Duration::from_secs(2), env.close()).await;
                self.trim_idle(env.server_index).await;
                continue;
            }
            let failed = matches!(episode.end, EpisodeEnd::EnvFailed { .. });
            env.finish_episode(failed, &self.config);
            if self.config.reuse_envs && !failed {
                env.recycle();
            } else {
                let _ = tokio::time::timeout(Duration::from_secs(2), env.close()).await;
            }
            return Ok(episode);
        }
    }

    /// Closes idle envs of server `index` beyond its (lowered) limit: each holds a session
    /// on the server.
    async fn trim_idle(&self, index: usize) {
        let server = &self.servers[index];
        let limit = server.limit.load(Ordering::SeqCst);
        let extra: Vec<Box<dyn Env>> = match server.idle.lock() {
            Ok(mut idle) if idle.len() > limit => idle.split_off(limit),
            _ => Vec::new(),
        };
        for mut env in extra {
            let _ = tokio::time::timeout(Duration::from_secs(2), env.close()).await;
        }
    }

    /// Plays one episode on `env` under the episode timeout; env failures come back inside
    /// the episode.
    async fn play<P: TurnPolicy + ?Sized>(
        &self,
        env: &mut PooledEnv,
        policy: &mut P,
        reset: ResetOptions,
        cfg: &EpisodeConfig,
    ) -> anyhow::Result<Episode> {
        let timeout = self.config.episode_timeout;
        let result = tokio::time::timeout(timeout, run_episode(policy, env, reset, cfg)).await;
        Ok(match result {
            Ok(Ok(ep)) => ep,
            Ok(Err(e)) => {
                let _ = tokio::time::timeout(Duration::from_secs(2), env.close()).await;
                return Err(e);
            }
            Err(_) => {
                let err = EnvError::Timeout {
                    seconds: timeout.as_secs_f64(),
                    during: "episode".into(),
                };
                env.record_failure(&err);
                Episode::failed(&err)
            }
        })
    }

    /// Current statistics (latency summaries recomputed from all samples).
    pub fn stats(&self) -> PoolStats {
        let mut all = PoolStats::default();
        let mut reset_all = Vec::new();
        let mut step_all = Vec::new();
        // The pool's `last_error` is the most recent of the servers' (by when it was seen).
        let mut latest: Option<Instant> = None;
        for s in &self.servers {
            let Ok(r) = s.recorder.lock() else { continue };
            reset_all.extend_from_slice(&r.reset_s);
            step_all.extend_from_slice(&r.step_s);
            all.failures.merge(&r.failures);
            if let Some(at) = r.error_at {
                if latest.is_none_or(|t| at >= t) {
                    latest = Some(at);
                    all.failures.last_error = r.failures.last_error.clone();
                }
            }
            all.episodes_ok += r.episodes_ok;
            all.episodes_failed += r.episodes_failed;
            all.servers.push(ServerStats {
                name: s.name.clone(),
                reset: LatencySummary::from_samples(&r.reset_s),
                step: LatencySummary::from_samples(&r.step_s),
                failures: r.failures.clone(),
                episodes_ok: r.episodes_ok,
                episodes_failed: r.episodes_failed,
                in_flight: s
                    .limit
                    .load(Ordering::SeqCst)
                    .saturating_sub(s.permits.available_permits()),
                envs_created: r.envs_created,
                max_concurrent: s.limit.load(Ordering::SeqCst),
                gone: r.gone(self.config.server_down_budget),
            });
        }
        all.reset = LatencySummary::from_samples(&reset_all);
        all.step = LatencySummary::from_samples(&step_all);
        all
    }
}

/// An env from an [`EnvPool`]: holds a slot of its server until dropped, times and counts
/// every call.
pub struct PooledEnv {
    env: Box<dyn Env>,
    server_index: usize,
    server_name: String,
    recorder: Arc<Mutex<Recorder>>,
    idle: Arc<Mutex<Vec<Box<dyn Env>>>>,
    call_timeout: Duration,
    limit: Arc<AtomicUsize>,
    /// The server slot; `None` once given up for good by [`PooledEnv::lower_limit`].
    permit: Option<OwnedSemaphorePermit>,
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

    fn record_failure(&self, e: &EnvError) {
        if let Ok(mut r) = self.recorder.lock() {
            r.failure(&self.server_name, e);
        }
    }

    /// Lowers the server's concurrency limit by one (never below 1) by retiring this env's
    /// slot for good; false when the limit is already 1.
    fn lower_limit(&mut self) -> bool {
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
    fn finish_episode(&self, failed: bool, cfg: &PoolConfig) {
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

    fn record(&mut self, result: &Result<StepResult, EnvError>, elapsed: f64, is_step: bool) {
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
