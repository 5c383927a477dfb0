//! Rollouts in an environment (`[env]` in the recipe): a built-in env of composer-env or a
//! remote OpenEnv server, through one [`EnvPool`].
//!
//! The policy model plays episodes as a [`TurnPolicy`] ([`ModelTurnPolicy`]): its own tokens
//! go into the episode exactly as sampled, with the sampler's log-probs; env observations are
//! appended as tokens masked out of the loss (composer-env's [`composer_env::run_episode`]
//! builds the sequence by appending, never by re-tokenising a transcript). The model's text is parsed
//! into the env's action schema (from `/schema` for OpenEnv); an unparseable action is a
//! zero-reward step with a reason.
//!
//! [`EnvRollout::rollout_batch`] returns the trainer's own [`crate::sampling::RolloutBatch`]
//! (one sample per episode: prompt = the reset observation's tokens, completion = everything
//! after it), and [`EnvRollout::reward_batch`] the trainer's [`crate::rewards::Rewards`] with
//! the env's rewards, so the rest of the step is unchanged (both in [`crate::env_batch`]).
//! Feedback text and per-token loss masks are kept in [`EnvBatch`].

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use composer_env::{
    builtin_env_factory, CodeEnv, CodeEnvConfig, EnvPool, Episode, OpenEnvClient,
    OpenEnvClientConfig, PoolConfig, PoolStats, TurnEnd, TurnOutput, TurnPolicy,
};
use tokenizers::Tokenizer;

use composer_model::{PrefixStore, SamplingParams};
use composer_telemetry::keys;
use serde_json::json;

use crate::model::PolicyModel;
use crate::recipe::{EnvSection, Recipe};
use crate::sampling::{self, Rollout};
use crate::seed::mix_seed;
use crate::tokenizer as chartok;

/// One turn to sample: the context, the turn's token limit and its sampling seed.
struct TurnRequest {
    context: Vec<u32>,
    max_new_tokens: usize,
    seed: u64,
    reply: tokio::sync::oneshot::Sender<Result<Rollout>>,
}

/// A handle to a generation thread that samples the turns of many concurrent episodes in
/// batched calls of composer-model's KV-cached `generate` (every request waiting when a batch starts goes into it).
/// Generation runs off the async executor, so env calls of other episodes proceed (and are
/// timed) while the model computes. Make one with [`with_turn_sampler`].
#[derive(Clone)]
pub struct TurnSampler {
    tx: std::sync::mpsc::Sender<TurnRequest>,
}

impl TurnSampler {
    async fn sample(&self, context: Vec<u32>, max_new_tokens: usize, seed: u64) -> Result<Rollout> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(TurnRequest {
                context,
                max_new_tokens,
                seed,
                reply,
            })
            .map_err(|_| anyhow::anyhow!("the generation thread has stopped"))?;
        rx.await
            .map_err(|_| anyhow::anyhow!("the generation thread dropped a request"))?
    }
}

/// Runs `body` with a [`TurnSampler`] over `model` (sampling with `params`, whose
/// `max_new_tokens` is the per-turn limit and `stop_token_ids` the model's EOS ids; tokens
/// are stamped with `policy_version`), on a scoped generation thread that ends when every
/// sampler clone is dropped. A turn's KV is kept (at most `prefix_tokens` tokens of them, the
/// oldest dropped first) so the episode's next turn prefills only the tokens after it (the
/// observation), not its whole context again. Returns `body`'s result and what was fed.
pub fn with_turn_sampler<R>(
    model: &PolicyModel,
    params: SamplingParams,
    policy_version: u64,
    prefix_tokens: usize,
    body: impl FnOnce(TurnSampler) -> R,
) -> Result<(R, TurnStats)> {
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel::<TurnRequest>();
        let generator = scope.spawn(move || {
            let mut store = PrefixStore::new(prefix_tokens);
            let mut stats = TurnStats::default();
            while let Ok(first) = rx.recv() {
                let mut pending = vec![first];
                pending.extend(rx.try_iter());
                // One batch per distinct token limit (they differ only near the token budget).
                pending.sort_by_key(|r| r.max_new_tokens);
                while !pending.is_empty() {
                    let limit = pending[0].max_new_tokens;
                    let cut = pending
                        .iter()
                        .position(|r| r.max_new_tokens != limit)
                        .unwrap_or(pending.len());
                    let batch: Vec<TurnRequest> = pending.drain(..cut).collect();
                    let contexts: Vec<Vec<u32>> = batch.iter().map(|r| r.context.clone()).collect();
                    stats.context_tokens += contexts.iter().map(Vec::len).sum::<usize>();
                    let seeds: Vec<u64> = batch.iter().map(|r| r.seed).collect();
                    let p = SamplingParams {
                        max_new_tokens: limit.min(params.max_new_tokens),
                        ..params.clone()
                    };
                    let sampled = sampling::sample_with_store(
                        model,
                        &contexts,
                        1,
                        &p,
                        policy_version,
                        |i| seeds[i],
                        Some(&mut store),
                    );
                    match sampled {
                        Ok((samples, prefilled)) => {
                            stats.prefill_tokens += prefilled;
                            for (r, smp) in batch.into_iter().zip(samples) {
                                let _ = r.reply.send(Ok(smp));
                            }
                        }
                        Err(e) => {
                            let msg = format!("{e:#}");
                            for r in batch {
                                let _ = r.reply.send(Err(anyhow::anyhow!("generation: {msg}")));
                            }
                        }
                    }
                }
            }
            stats
        });
        let out = body(TurnSampler { tx });
        let stats = generator
            .join()
            .map_err(|_| anyhow::anyhow!("the generation thread panicked"))?;
        Ok((out, stats))
    })
}

/// What a turn sampler fed the model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TurnStats {
    /// Context tokens of every sampled turn.
    pub context_tokens: usize,
    /// Context tokens actually prefilled (the rest continued from the previous turn's KV).
    pub prefill_tokens: usize,
}

/// The policy model as a [`TurnPolicy`]: each turn is sampled by a [`TurnSampler`] (batched
/// with the turns of concurrent episodes) from a ChaCha8 stream seeded by `(seed, turn)`.
pub struct ModelTurnPolicy<'a> {
    /// Samples the turns.
    pub sampler: TurnSampler,
    /// The policy's tokenizer.
    pub tok: &'a Tokenizer,
    /// Seed of this episode's sampling.
    pub seed: u64,
    /// Wraps the reset observation (`{observation}` is replaced).
    pub prompt_template: &'a str,
    /// Wraps later observations.
    pub observation_template: &'a str,
    /// Turns generated so far.
    pub turns: usize,
    /// Seconds spent waiting for generation (the episode's wall minus this is env time).
    pub generate_s: f64,
}

impl<'a> ModelTurnPolicy<'a> {
    /// A policy for one episode; templates contain `{observation}`.
    pub fn new(
        sampler: TurnSampler,
        tok: &'a Tokenizer,
        seed: u64,
        prompt_template: &'a str,
        observation_template: &'a str,
    ) -> Self {
        ModelTurnPolicy {
            sampler,
            tok,
            seed,
            prompt_template,
            observation_template,
            turns: 0,
            generate_s: 0.0,
        }
    }
}

#[async_trait]
impl TurnPolicy for ModelTurnPolicy<'_> {
    async fn generate_turn(
        &mut self,
        context_ids: &[u32],
        max_new_tokens: usize,
    ) -> anyhow::Result<TurnOutput> {
        if context_ids.is_empty() {
            bail!("the env's first observation tokenized to nothing: no context to sample from");
        }
        let t0 = Instant::now();
        let seed = mix_seed(self.seed, self.turns as u64, 0);
        let sample = self
            .sampler
            .sample(context_ids.to_vec(), max_new_tokens, seed)
            .await?;
        self.turns += 1;
        self.generate_s += t0.elapsed().as_secs_f64();
        Ok(TurnOutput {
            finish_reason: if sample.truncated {
                TurnEnd::Length
            } else {
                TurnEnd::Stop
            },
            token_ids: sample.completion_ids,
            sampler_logprobs: sample.sampler_logprobs,
            policy_version: sample.policy_version,
        })
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        chartok::encode(self.tok, text).unwrap_or_else(|e| {
            tracing::warn!("tokenizing an env observation failed: {e}");
            Vec::new()
        })
    }

    fn decode(&self, ids: &[u32]) -> String {
        chartok::decode(self.tok, ids)
    }

    fn encode_observation(&self, text: &str, turn: usize) -> Vec<u32> {
        self.encode(&wrap_observation(
            self.prompt_template,
            self.observation_template,
            text,
            turn,
        ))
    }
}

/// An env observation as the policy sees it: the reset observation (`turn` 0) in
/// `[env] prompt_template`, later ones in `[env] observation_template`.
pub fn wrap_observation(
    prompt_template: &str,
    observation_template: &str,
    text: &str,
    turn: usize,
) -> String {
    let template = if turn == 0 {
        prompt_template
    } else {
        observation_template
    };
    template.replace("{observation}", text)
}

/// The server URL(s) of an OpenEnv `[env]` section: `url`, else the variable `url_env` names.
pub fn server_url(section: &EnvSection) -> Result<String> {
    match (&section.url, &section.url_env) {
        (Some(u), _) => Ok(u.clone()),
        (None, Some(var)) => std::env::var(var)
            .with_context(|| format!("key `[env] url_env`: environment variable {var} is not set")),
        (None, None) => bail!("key `[env] url`: kind = {:?} needs `url`", section.kind),
    }
}

/// The client settings of an OpenEnv `[env]` section (its timeouts).
pub fn client_config(section: &EnvSection) -> OpenEnvClientConfig {
    OpenEnvClientConfig {
        connect_timeout: Duration::from_secs_f64(section.connect_timeout_s),
        call_timeout: Duration::from_secs_f64(section.call_timeout_s),
        http_timeout: Duration::from_secs_f64(section.connect_timeout_s),
        ..Default::default()
    }
}

/// What the env said about one step's samples (same order as the batch's samples).
#[derive(Debug, Clone)]
pub struct EnvBatch {
    /// The RL step.
    pub step: usize,
    /// Reward per sample (`[env] reward`: the final step's, or the sum).
    pub rewards: Vec<f64>,
    /// Feedback text of each sample's last step (e.g. a failing test), for the hint channel.
    pub feedback: Vec<Option<String>>,
    /// Each sample's reset observation (its prompt) as text.
    pub prompt_texts: Vec<String>,
    /// Per completion token: 1 = model token, 0 = env observation token.
    pub completion_loss_masks: Vec<Vec<u8>>,
    /// Samples whose episode failed after the retries and were replaced by a peer's copy.
    pub replaced: Vec<bool>,
    /// Seconds of env time (episode wall minus generation) per sample: the τ_V wall.
    pub env_s: Vec<f64>,
    /// The episodes as played (failed ones included, before replacement).
    pub episodes: Vec<Episode>,
    /// Completion ids per sample, to pair a [`crate::sampling::RolloutBatch`] with its env results.
    pub(crate) completion_ids: Vec<Vec<u32>>,
}

/// The `[env]` rollout engine of a training session: a tokio runtime, the env pool, and the
/// env results of the last few batches (for [`EnvRollout::reward_batch`]).
pub struct EnvRollout {
    pub(crate) section: EnvSection,
    pub(crate) pool: EnvPool,
    pub(crate) recent: Mutex<VecDeque<EnvBatch>>,
    /// Always Some until dropped (then shut down in the background: dropping a runtime
    /// normally blocks, which panics inside async code).
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for EnvRollout {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// How many recent batches are kept for pairing with their rewards (asynchronous actors may
/// roll out ahead of scoring).
pub(crate) const RECENT_BATCHES: usize = 4;

/// The small runtime the env pool's episodes run on (two workers: episodes mostly wait on
/// servers and subprocesses, not on the CPU).
fn env_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("composer-env")
        .build()
        .context("starting the tokio runtime of `[env]`")
}

impl EnvRollout {
    /// The engine of `recipe`'s `[env]` section, or None when the recipe has none;
    /// `chat_template` is the checkpoint's (tool episodes render with it).
    pub fn from_recipe(
        recipe: &Recipe,
        chat_template: Option<&composer_model::ChatTemplate>,
    ) -> Result<Option<EnvRollout>> {
        recipe
            .env
            .as_ref()
            .map(|section| EnvRollout::new(section, chat_template))
            .transpose()
    }

    /// Builds the pool: a built-in env factory, or a connection to an OpenEnv server (waits
    /// for its `/health` with retries and reads its `/schema`); for `openenv_tools`, tool
    /// sessions rendered with `chat_template` (or `[env] chat_template`).
    pub fn new(
        section: &EnvSection,
        chat_template: Option<&composer_model::ChatTemplate>,
    ) -> Result<EnvRollout> {
        let runtime = env_runtime()?;
        let servers = match section.kind.as_str() {
            "builtin" => {
                let name = section.name.clone().unwrap_or_default();
                let factory = if name == "code" {
                    CodeEnv::factory(CodeEnvConfig {
                        max_attempts: section.max_turns as u32,
                        ..Default::default()
                    })
                } else {
                    builtin_env_factory(&name)
                }
                .with_context(|| format!("key `[env] name`: built-in env `{name}`"))?;
                vec![(format!("builtin:{name}"), factory)]
            }
            "openenv" | "openenv_tools" => {
                // Tool episodes: the chat format is checked before any server is contacted.
                let tool_chat = (section.kind == "openenv_tools")
                    .then(|| crate::tool_env::tool_chat_for(section, chat_template))
                    .transpose()?;
                let url = server_url(section)?;
                let config = client_config(section);
                // Several servers, comma-separated: one pool, `max_concurrent` on each.
                let mut servers = Vec::new();
                for one in url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
                    let client = block_on(&runtime, OpenEnvClient::connect(one, config.clone()))
                        .with_context(|| format!("key `[env] url`: OpenEnv server {one}"))?;
                    // A server without /metadata (or without the key) is not checked.
                    if let Ok(metadata) = block_on(&runtime, client.metadata()) {
                        check_call_timeout(section, one, &metadata)?;
                    }
                    servers.push((one.to_string(), client));
                }
                if servers.is_empty() {
                    bail!("key `[env] url`: no server URL in {url:?}");
                }
                match tool_chat {
                    Some(chat) => crate::tool_env::tool_server_factories(servers, chat),
                    None => servers
                        .into_iter()
                        .map(|(name, client)| (name, client.factory()))
                        .collect(),
                }
            }
            other => bail!(
                "key `[env] kind`: unknown value {other:?} (known: builtin, openenv, openenv_tools)"
            ),
        };
        Ok(Self::assemble_engine(section, runtime, servers))
    }

    /// An engine over any env factory (a custom [`composer_env::Env`]), with `section`'s
    /// limits (its `kind`, `name` and `url` are not used).
    pub fn with_factory(
        section: &EnvSection,
        name: &str,
        factory: composer_env::EnvFactory,
    ) -> Result<EnvRollout> {
        let runtime = env_runtime()?;
        Ok(Self::assemble_engine(
            section,
            runtime,
            vec![(name.to_string(), factory)],
        ))
    }

    fn assemble_engine(
        section: &EnvSection,
        runtime: tokio::runtime::Runtime,
        servers: Vec<(String, composer_env::EnvFactory)>,
    ) -> EnvRollout {
        let mut pool = EnvPool::new(PoolConfig {
            call_timeout: Duration::from_secs_f64(section.call_timeout_s),
            episode_timeout: Duration::from_secs_f64(section.episode_timeout_s),
            server_down_budget: Duration::from_secs_f64(section.server_down_budget_s),
            ..Default::default()
        });
        for (name, factory) in servers {
            pool.add_server(name, factory, section.max_concurrent);
        }
        EnvRollout {
            section: section.clone(),
            pool,
            recent: Mutex::new(VecDeque::new()),
            runtime: Some(runtime),
        }
    }

    pub(crate) fn runtime(&self) -> Result<&tokio::runtime::Runtime> {
        self.runtime
            .as_ref()
            .context("the `[env]` runtime was shut down")
    }

    /// Latency percentiles (reset/step) and failure counts by cause, so far.
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// The env results of the most recent batch.
    pub fn last_batch(&self) -> Option<EnvBatch> {
        self.recent.lock().ok().and_then(|r| r.back().cloned())
    }

    /// Whether every server of the pool has been given up (down past its budget).
    pub fn all_servers_gone(&self) -> bool {
        let servers = self.stats().servers;
        !servers.is_empty() && servers.iter().all(|s| s.gone)
    }

    /// The env keys of a step's metrics line: τ_V of environment rollouts (cumulative call
    /// latency percentiles, episodes ok/failed, failures by cause) and the tool-call counts of
    /// the last batch's episodes.
    pub fn step_metrics(&self) -> serde_json::Map<String, serde_json::Value> {
        let stats = self.stats();
        let mut m = serde_json::Map::new();
        m.insert(keys::ENV_STEP_P50.into(), json!(stats.step.p50_s));
        m.insert(keys::ENV_STEP_P95.into(), json!(stats.step.p95_s));
        m.insert(keys::ENV_RESET_P50.into(), json!(stats.reset.p50_s));
        m.insert(keys::ENV_RESET_P95.into(), json!(stats.reset.p95_s));
        m.insert(keys::ENV_EPISODES_OK.into(), json!(stats.episodes_ok));
        m.insert(
            keys::ENV_EPISODES_FAILED.into(),
            json!(stats.episodes_failed),
        );
        m.insert(keys::ENV_FAILURES.into(), json!(stats.failures));
        if let Some(b) = self.last_batch() {
            m.extend(crate::tool_env::step_metrics(&b.episodes));
        }
        m
    }
}

/// Runs `fut` to completion on `runtime`. From inside another tokio runtime (where a nested
/// `block_on` would panic, e.g. a caller driving the trainer from async code) it runs on a
/// scoped helper thread instead.
pub(crate) fn block_on<F>(runtime: &tokio::runtime::Runtime, fut: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    if tokio::runtime::Handle::try_current().is_err() {
        return runtime.block_on(fut);
    }
    std::thread::scope(|scope| {
        scope
            .spawn(|| runtime.block_on(fut))
            .join()
            .unwrap_or_else(|payload| std::panic::resume_unwind(payload))
    })
}

/// `[env] call_timeout_s` against the longest step the env at `server` says it may take
/// (`step_time_limit_s` in its metadata: a command, then the grading). A shorter timeout cuts
/// slow steps, and an episode whose step was cut cannot be graded in time: it fails instead,
/// and a failed episode is retried or replaced by a peer's copy — a way for a policy to escape
/// the zero reward of a losing attempt by making it slow.
fn check_call_timeout(
    section: &EnvSection,
    server: &str,
    metadata: &serde_json::Value,
) -> Result<()> {
    let Some(limit) = metadata
        .get(composer_env::STEP_TIME_LIMIT_KEY)
        .and_then(serde_json::Value::as_f64)
    else {
        return Ok(());
    };
    if limit.is_finite() && limit > section.call_timeout_s {
        bail!(
            "key `[env] call_timeout_s` = {}: shorter than the longest step the env at {server} \
             may take ({limit} s, its /metadata `{}`: a command, then the grading); a step cut \
             at the call timeout fails its episode instead of grading it, so set it to at least \
             {limit}",
            section.call_timeout_s,
            composer_env::STEP_TIME_LIMIT_KEY
        );
    }
    Ok(())
}
