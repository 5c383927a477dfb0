//! Rollouts in an environment (`[env]` in the recipe): a built-in env of composer-env or a
//! remote OpenEnv server, through one [`EnvPool`].
//!
//! The policy model plays episodes as a [`TurnPolicy`] ([`ModelTurnPolicy`]): its own tokens
//! go into the episode exactly as sampled, with the sampler's log-probs; env observations are
//! appended as tokens masked out of the loss (composer-env's [`run_episode`] builds the
//! sequence by appending, never by re-tokenising a transcript). The model's text is parsed
//! into the env's action schema (from `/schema` for OpenEnv); an unparseable action is a
//! zero-reward step with a reason.
//!
//! [`EnvRollout::rollout_batch`] returns the trainer's own [`RolloutBatch`] (one sample per
//! episode: prompt = the reset observation's tokens, completion = everything after it), and
//! [`EnvRollout::reward_batch`] the trainer's [`Rewards`] with the env's rewards, so the rest
//! of the step is unchanged. Feedback text and per-token loss masks are kept in [`EnvBatch`].

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use composer_env::{
    builtin_env_factory, CodeEnv, CodeEnvConfig, EnvPool, Episode, EpisodeConfig, EpisodeEnd,
    FailureKind, OpenEnvClient, OpenEnvClientConfig, PoolConfig, PoolStats, ResetOptions, TurnEnd,
    TurnOutput, TurnPolicy,
};
use tokenizers::Tokenizer;

use composer_model::{PrefixStore, SamplingParams};

use crate::model::PolicyModel;
use crate::recipe::{EnvSection, Recipe};
use crate::rewards::Rewards;
use crate::rollout::{sampling_params, RolloutBatch};
use crate::sampling::{self, mix_seed, Rollout};
use crate::session::Session;
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
    /// Completion ids per sample, to pair a [`RolloutBatch`] with its env results.
    completion_ids: Vec<Vec<u32>>,
}

/// The `[env]` rollout engine of a training session: a tokio runtime, the env pool, and the
/// env results of the last few batches (for [`EnvRollout::reward_batch`]).
pub struct EnvRollout {
    section: EnvSection,
    pool: EnvPool,
    recent: Mutex<VecDeque<EnvBatch>>,
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

/// Pause before a step whose every episode failed is played again.
const STEP_REPLAY_PAUSE: Duration = Duration::from_millis(500);

/// Most replays of such a step (a bound besides the pool's down budget); the step then
/// errors.
const MAX_STEP_REPLAYS: usize = 1000;

/// An episode the trainer can learn from: no env failure, at least one model turn.
fn episode_usable(ep: &Episode) -> bool {
    !matches!(ep.end, EpisodeEnd::EnvFailed { .. }) && !ep.turns.is_empty() && ep.prompt_len > 0
}

/// How many recent batches are kept for pairing with their rewards (asynchronous actors may
/// roll out ahead of scoring).
const RECENT_BATCHES: usize = 4;

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

    fn runtime(&self) -> Result<&tokio::runtime::Runtime> {
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

    /// Plays the step's episodes: `prompts_per_step` groups of `num_generations` episodes,
    /// each group from one reset seed, at most `[env] max_concurrent` at a time. A failed
    /// episode is retried `[env] episode_retries` times, then replaced by a copy of a
    /// successful peer of its group (or, when the whole group failed, the group becomes
    /// copies of one sample: zero advantage). When no episode reached its server the step is
    /// played again until one does or every server is given up (`[env] server_down_budget_s`);
    /// errors when every episode failed.
    pub fn rollout_batch(&self, s: &Session, step: usize) -> Result<RolloutBatch> {
        let seed = s.recipe.train.seed;
        let n_prompts = s.recipe.train.prompts_per_step;
        let g = s.recipe.rollout.num_generations;
        let prompts: Vec<usize> = (0..n_prompts)
            .map(|i| {
                (mix_seed(seed, step as u64, 1_000_000 + i as u64) % s.train_rows.len() as u64)
                    as usize
            })
            .collect();
        // Non-negative and below 2^31: any OpenEnv env's `seed` field accepts it.
        let reset_seeds: Vec<u64> = (0..n_prompts)
            .map(|i| mix_seed(seed, step as u64, 3_000_000 + i as u64) % (1 << 31))
            .collect();
        let params = sampling_params(&s.recipe, &s.stop_ids);
        let cfg = EpisodeConfig {
            max_turns: self.section.max_turns,
            max_total_tokens: self.section.max_total_tokens,
        };
        let sec = &self.section;
        let runtime = self.runtime()?;
        // Room for every concurrent episode's previous turn.
        let prefix_tokens = sec.max_concurrent * sec.max_total_tokens;
        // A round whose every episode failed to reach its server (the server restarting, say)
        // is played again, until a server answers or the pool gives every server up after
        // `[env] server_down_budget_s` (then `run_episode` errors and so does the step).
        let mut replays = 0usize;
        let played = loop {
            let (played, _) = with_turn_sampler(
                &s.model,
                params.clone(),
                s.state.policy_version,
                prefix_tokens,
                |sampler| {
                    block_on(runtime, async {
                        let episodes = (0..n_prompts * g).map(|i| {
                            let reset = ResetOptions::seeded(reset_seeds[i / g]);
                            let mut policy = ModelTurnPolicy::new(
                                sampler.clone(),
                                &s.tok,
                                mix_seed(seed, step as u64, i as u64),
                                &sec.prompt_template,
                                &sec.observation_template,
                            );
                            async move {
                                let t0 = Instant::now();
                                let mut attempt = 0;
                                loop {
                                    let ep = self
                                        .pool
                                        .run_episode(&mut policy, reset.clone(), &cfg)
                                        .await?;
                                    let failed = matches!(ep.end, EpisodeEnd::EnvFailed { .. });
                                    if failed && attempt < sec.episode_retries {
                                        attempt += 1;
                                        continue;
                                    }
                                    let env_s =
                                        (t0.elapsed().as_secs_f64() - policy.generate_s).max(0.0);
                                    return Ok::<_, anyhow::Error>((ep, env_s));
                                }
                            }
                        });
                        let played = futures::future::join_all(episodes).await;
                        // Every policy (and its sampler clone) is dropped here; the generation
                        // thread ends once `sampler` goes too.
                        drop(sampler);
                        played
                    })
                },
            )?;
            let played: Vec<(Episode, f64)> = played.into_iter().collect::<Result<_>>()?;
            let server_down = played.iter().all(|(ep, _)| {
                matches!(
                    ep.end,
                    EpisodeEnd::EnvFailed {
                        kind: FailureKind::Refused | FailureKind::Connection,
                        ..
                    }
                )
            });
            if !server_down || replays >= MAX_STEP_REPLAYS {
                break played;
            }
            replays += 1;
            tracing::warn!(
                "[env] step {step}: every episode failed (env failures so far: {:?}); playing \
             the step again ({replays}) until a server answers or `[env] \
             server_down_budget_s` = {} s runs out",
                self.pool.stats().failures,
                sec.server_down_budget_s
            );
            std::thread::sleep(STEP_REPLAY_PAUSE);
        };
        self.assemble(s, step, prompts, played)
    }

    /// Turns played episodes into the trainer's batch (replacing failed ones) and records
    /// their env results.
    fn assemble(
        &self,
        s: &Session,
        step: usize,
        prompts: Vec<usize>,
        played: Vec<(Episode, f64)>,
    ) -> Result<RolloutBatch> {
        let g = s.recipe.rollout.num_generations;
        let usable = episode_usable;
        let Some(any_ok) = played.iter().position(|(ep, _)| usable(ep)) else {
            let why = played
                .iter()
                .find_map(|(ep, _)| match &ep.end {
                    EpisodeEnd::EnvFailed { message, .. } => Some(message.clone()),
                    _ => None,
                })
                .unwrap_or_else(|| "no episode produced a model turn".into());
            bail!(
                "[env] step {step}: every episode failed (first error: {why}); env failures so far: {:?}",
                self.pool.stats().failures
            );
        };
        let n = played.len();
        let mut samples = Vec::with_capacity(n);
        let mut texts = Vec::with_capacity(n);
        let mut env = EnvBatch {
            step,
            rewards: Vec::with_capacity(n),
            feedback: Vec::with_capacity(n),
            prompt_texts: Vec::with_capacity(n),
            completion_loss_masks: Vec::with_capacity(n),
            replaced: Vec::with_capacity(n),
            env_s: Vec::with_capacity(n),
            episodes: Vec::with_capacity(n),
            completion_ids: Vec::with_capacity(n),
        };
        for i in 0..n {
            let group = i / g;
            let source = if usable(&played[i].0) {
                i
            } else {
                // A successful peer of the group; else one sample for the whole group.
                let peers = group * g..(group + 1) * g;
                match peers.clone().find(|&j| usable(&played[j].0)) {
                    Some(j) => j,
                    None => any_ok,
                }
            };
            let (ep, env_s) = &played[source];
            let p = ep.prompt_len;
            let last = ep.turns.last();
            samples.push(Rollout {
                group,
                prompt_ids: ep.token_ids[..p].to_vec(),
                completion_ids: ep.token_ids[p..].to_vec(),
                sampler_logprobs: ep.sampler_logprobs[p..].to_vec(),
                truncated: last.is_some_and(|t| t.finish_reason == TurnEnd::Length),
                policy_version: s.state.policy_version,
                loss_mask: Some(ep.loss_mask[p..].to_vec()),
            });
            texts.push(
                ep.turns
                    .iter()
                    .map(|t| t.action_text.as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
            );
            env.rewards.push(match self.section.reward.as_str() {
                "sum" => ep.total_reward,
                _ => ep.final_reward,
            });
            env.feedback.push(last.and_then(|t| t.feedback.clone()));
            env.prompt_texts.push(ep.initial_observation.clone());
            env.completion_loss_masks.push(ep.loss_mask[p..].to_vec());
            env.replaced.push(source != i);
            env.env_s.push(*env_s);
            env.completion_ids.push(ep.token_ids[p..].to_vec());
        }
        env.episodes = played.into_iter().map(|(ep, _)| ep).collect();
        if let Ok(mut recent) = self.recent.lock() {
            recent.push_back(env);
            while recent.len() > RECENT_BATCHES {
                recent.pop_front();
            }
        }
        Ok(RolloutBatch {
            prompts,
            samples,
            texts,
        })
    }

    /// The hint channel's view of group `group` of `batch` (built by
    /// [`EnvRollout::rollout_batch`]): each sample's prompt as the student saw it (the
    /// templated reset observation), its text, reward, pass flag and the env's feedback
    /// (e.g. the failing test). None when `batch` is not one of the recent env batches.
    /// `train_on_batch` can use this in place of the `[data]` prompt row of the group.
    pub fn hint_group(
        &self,
        batch: &RolloutBatch,
        rewards: &Rewards,
        group: usize,
        group_size: usize,
    ) -> Option<Vec<composer_loss::hint::RolloutForHint>> {
        let recent = self.recent.lock().ok()?;
        let env = recent.iter().rev().find(|e| Self::matches(e, batch))?;
        let range = group * group_size..((group + 1) * group_size).min(batch.samples.len());
        Some(
            range
                .map(|i| composer_loss::hint::RolloutForHint {
                    prompt_text: self
                        .section
                        .prompt_template
                        .replace("{observation}", &env.prompt_texts[i]),
                    completion_text: batch.texts[i].clone(),
                    reward: rewards.total.get(i).copied().unwrap_or(0.0),
                    passed: rewards.passed.get(i).copied().unwrap_or(false),
                    feedback: env.feedback[i].clone(),
                })
                .collect(),
        )
    }

    /// Whether `env` holds the results of `batch` (same completions, in order).
    fn matches(env: &EnvBatch, batch: &RolloutBatch) -> bool {
        env.completion_ids.len() == batch.samples.len()
            && env
                .completion_ids
                .iter()
                .zip(&batch.samples)
                .all(|(c, smp)| *c == smp.completion_ids)
    }

    /// The env's rewards for `batch` (one of the last few from [`EnvRollout::rollout_batch`]),
    /// as the trainer's [`Rewards`]: the env reward is the single reward component (put in
    /// the first verifier's slot, the others 0), passed = reward ≥ `[env] pass_reward`.
    pub fn reward_batch(&self, s: &Session, batch: &RolloutBatch) -> Rewards {
        let n_parts = s.reward.parts.len().max(1);
        let pass = self.section.pass_reward;
        let found = self.recent.lock().ok().and_then(|recent| {
            recent
                .iter()
                .rev()
                .find(|e| Self::matches(e, batch))
                .map(|e| (e.rewards.clone(), e.env_s.clone()))
        });
        let (rewards, env_s) = found.unwrap_or_else(|| {
            tracing::error!(
                "[env]: no env results for this batch (rolled out more than {RECENT_BATCHES} batches ago?); rewards set to 0"
            );
            (vec![0.0; batch.samples.len()], vec![0.0; batch.samples.len()])
        });
        let mut out = Rewards {
            total: Vec::with_capacity(rewards.len()),
            per_func: Vec::with_capacity(rewards.len()),
            passed: Vec::with_capacity(rewards.len()),
            latency_s: env_s,
        };
        for r in rewards {
            let mut parts = vec![0.0; n_parts];
            parts[0] = r;
            out.total.push(r);
            out.per_func.push(parts);
            out.passed.push(r >= pass - 1e-9);
        }
        out
    }
}

/// Runs `fut` to completion on `runtime`. From inside another tokio runtime (where a nested
/// `block_on` would panic, e.g. a caller driving the trainer from async code) it runs on a
/// scoped helper thread instead.
fn block_on<F>(runtime: &tokio::runtime::Runtime, fut: F) -> F::Output
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
