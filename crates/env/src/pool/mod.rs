//! [`EnvPool`]: concurrent episodes over several servers/factories, bounded per server, with
//! per-call latency samples (p50/p95: the τ_V wall) and failure counts by cause.
//!
//! `stats` holds the counters and latency summaries, `pooled` the env handed out
//! ([`PooledEnv`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::env::{Env, EnvError, EnvFactory, FailureKind, ResetOptions};
use crate::episode::{run_episode_until, Episode, EpisodeConfig, EpisodeEnd, TurnPolicy};

mod pooled;
mod stats;
pub use pooled::PooledEnv;
use stats::Recorder;
pub use stats::{FailureCounts, LatencySummary, PoolStats, ServerStats};

/// Configuration of an [`EnvPool`].
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Limit of one env call (reset/step/state/close) at the pool level; built-in envs have no
    /// timeout of their own, remote ones also apply their client's.
    pub call_timeout: Duration,
    /// Limit of one whole episode in [`EnvPool::run_episode`]; past it the episode fails
    /// with a timeout (a hung server). Its time budget ends `2 × call_timeout` earlier (when
    /// that leaves any): no model turn starts past the budget and the episode is graded,
    /// ending [`EpisodeEnd::TimeBudget`], with room left for the last turn's step and the
    /// grading. The agent's time (slow commands, code that hangs the grader) is so charged
    /// to the agent instead of failing the episode, which a policy could use to have a losing
    /// attempt retried or replaced by a peer's copy.
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
        // Room after the budget for the last turn's step and the grading, each one call.
        let budget = timeout.checked_sub(self.config.call_timeout.saturating_mul(2));
        let deadline = budget
            .filter(|b| !b.is_zero())
            .and_then(|b| Instant::now().checked_add(b));
        let result = tokio::time::timeout(
            timeout,
            run_episode_until(policy, env, reset, cfg, deadline),
        )
        .await;
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
