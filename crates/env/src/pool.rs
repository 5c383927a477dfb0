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
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            call_timeout: Duration::from_secs(120),
            episode_timeout: Duration::from_secs(600),
            failures_before_cooldown: 3,
            cooldown: Duration::from_secs(10),
            reuse_envs: true,
        }
    }
}

/// Failure counts by cause (see [`FailureKind`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureCounts {
    /// Calls or episodes past their timeout.
    pub timeout: u64,
    /// Connection refused/closed (server down or restarting).
    pub connection: u64,
    /// Capacity refusals left after retries.
    pub capacity: u64,
    /// Server/env errors.
    pub server: u64,
    /// Rejected or unparseable actions.
    pub invalid_action: u64,
    /// Protocol violations.
    pub protocol: u64,
}

impl FailureCounts {
    /// Adds one failure of `kind`.
    pub fn add(&mut self, kind: FailureKind) {
        match kind {
            FailureKind::Timeout => self.timeout += 1,
            FailureKind::Connection => self.connection += 1,
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
            + self.capacity
            + self.server
            + self.invalid_action
            + self.protocol
    }

    fn merge(&mut self, o: &FailureCounts) {
        self.timeout += o.timeout;
        self.connection += o.connection;
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
}

struct Server {
    name: String,
    factory: EnvFactory,
    permits: Arc<Semaphore>,
    max_concurrent: usize,
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
            max_concurrent,
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
        let cooling = |s: &Server| {
            s.recorder
                .lock()
                .ok()
                .and_then(|r| r.cooldown_until)
                .is_some_and(|t| t > now)
        };
        let mut eligible: Vec<usize> = (0..self.servers.len())
            .filter(|&i| !cooling(&self.servers[i]))
            .collect();
        if eligible.is_empty() {
            eligible = (0..self.servers.len()).collect();
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
            _permit: permit,
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
        let mut env = self.acquire().await?;
        let timeout = self.config.episode_timeout;
        let result = tokio::time::timeout(timeout, run_episode(policy, &mut env, reset, cfg)).await;
        let episode = match result {
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
                env.record_failure(err.kind());
                Episode::failed(&err)
            }
        };
        let failed = matches!(episode.end, EpisodeEnd::EnvFailed { .. });
        env.finish_episode(failed, &self.config);
        if self.config.reuse_envs && !failed {
            env.recycle();
        } else {
            let _ = tokio::time::timeout(Duration::from_secs(2), env.close()).await;
        }
        Ok(episode)
    }

    /// Current statistics (latency summaries recomputed from all samples).
    pub fn stats(&self) -> PoolStats {
        let mut all = PoolStats::default();
        let mut reset_all = Vec::new();
        let mut step_all = Vec::new();
        for s in &self.servers {
            let Ok(r) = s.recorder.lock() else { continue };
            reset_all.extend_from_slice(&r.reset_s);
            step_all.extend_from_slice(&r.step_s);
            all.failures.merge(&r.failures);
            all.episodes_ok += r.episodes_ok;
            all.episodes_failed += r.episodes_failed;
            all.servers.push(ServerStats {
                name: s.name.clone(),
                reset: LatencySummary::from_samples(&r.reset_s),
                step: LatencySummary::from_samples(&r.step_s),
                failures: r.failures,
                episodes_ok: r.episodes_ok,
                episodes_failed: r.episodes_failed,
                in_flight: s.max_concurrent - s.permits.available_permits(),
                envs_created: r.envs_created,
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
    _permit: OwnedSemaphorePermit,
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

    fn record_failure(&self, kind: FailureKind) {
        if let Ok(mut r) = self.recorder.lock() {
            r.failures.add(kind);
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
            }
        }
    }

    fn record(&self, result: &Result<StepResult, EnvError>, elapsed: f64, is_step: bool) {
        if let Ok(mut r) = self.recorder.lock() {
            match result {
                Ok(_) if is_step => r.step_s.push(elapsed),
                Ok(_) => r.reset_s.push(elapsed),
                Err(e) => r.failures.add(e.kind()),
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
