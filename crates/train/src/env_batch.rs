//! A training step's episodes in `[env]`: [`EnvRollout::rollout_batch`] plays them and turns
//! them into the trainer's [`RolloutBatch`] (replacing failed episodes), and
//! [`EnvRollout::reward_batch`] / [`EnvRollout::hint_group`] pair a batch with its env results.
//! The session-facing half of [`crate::env_rollout`], which knows nothing of the session.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use composer_env::{Episode, EpisodeConfig, EpisodeEnd, FailureKind, ResetOptions, TurnEnd};

use crate::env_rollout::{
    block_on, with_turn_sampler, EnvBatch, EnvRollout, ModelTurnPolicy, RECENT_BATCHES,
};
use crate::rewards::Rewards;
use crate::rollout::sampling_params;
use crate::sampling::{Rollout, RolloutBatch};
use crate::seed::mix_seed;
use crate::session::Session;

/// Pause before a step whose every episode failed is played again.
const STEP_REPLAY_PAUSE: Duration = Duration::from_millis(500);

/// Most replays of such a step (a bound besides the pool's down budget); the step then
/// errors.
const MAX_STEP_REPLAYS: usize = 1000;

/// An episode the trainer can learn from: no env failure, at least one model turn.
fn episode_usable(ep: &Episode) -> bool {
    !matches!(ep.end, EpisodeEnd::EnvFailed { .. }) && !ep.turns.is_empty() && ep.prompt_len > 0
}

impl EnvRollout {
    /// Plays the step's episodes: `prompts_per_step` groups of `num_generations` episodes,
    /// each group from one reset seed, at most `[env] max_concurrent` at a time. A failed
    /// episode is retried `[env] episode_retries` times, then replaced by a copy of a
    /// successful peer of its group (or, when the whole group failed, the group becomes
    /// copies of one sample: zero advantage). When no episode reached its server the step is
    /// played again until one does or every server is given up (`[env] server_down_budget_s`);
    /// errors when every episode failed.
    pub fn rollout_batch(&self, s: &Session, step: usize) -> Result<RolloutBatch> {
        self.rollout_round(s, step, 0)
    }

    /// [`EnvRollout::rollout_batch`] for round `round` of `step`: round 0 is the step's batch,
    /// later rounds are DAPO dynamic sampling's extra draws (prompt draws, reset seeds and
    /// episode seeds offset by the round, as `sample_rollouts` offsets its prompt draws).
    pub fn rollout_round(&self, s: &Session, step: usize, round: usize) -> Result<RolloutBatch> {
        let seed = s.recipe.train.seed;
        let n_prompts = s.recipe.train.prompts_per_step;
        let g = s.recipe.rollout.num_generations;
        let base = (round * n_prompts) as u64;
        let prompts: Vec<usize> = (0..n_prompts)
            .map(|i| {
                (mix_seed(seed, step as u64, 1_000_000 + base + i as u64)
                    % s.train_rows.len() as u64) as usize
            })
            .collect();
        // Non-negative and below 2^31: any OpenEnv env's `seed` field accepts it.
        let reset_seeds: Vec<u64> = (0..n_prompts)
            .map(|i| mix_seed(seed, step as u64, 3_000_000 + base + i as u64) % (1 << 31))
            .collect();
        let episode_base = base * g as u64;
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
                                mix_seed(seed, step as u64, episode_base + i as u64),
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
        // Dynamic sampling trains on groups of up to 1 + `max_dynamic_sampling_rounds`
        // rounds: their env results must all still be here for the hint channel.
        let keep = RECENT_BATCHES.max(s.recipe.loss.max_dynamic_sampling_rounds + 1);
        if let Ok(mut recent) = self.recent.lock() {
            recent.push_back(env);
            while recent.len() > keep {
                recent.pop_front();
            }
        }
        Ok(RolloutBatch {
            prompts,
            samples,
            texts,
            greedy_texts: None,
        })
    }

    /// The hint channel's view of group `group` of `batch` (built by
    /// [`EnvRollout::rollout_batch`]): each sample's prompt as the student saw it (the
    /// templated reset observation), its text, reward, pass flag and the env's feedback
    /// (e.g. the failing test). None when the group's episodes are not in a recent env
    /// batch. `train_on_batch` can use this in place of the `[data]` prompt row of the group.
    pub fn hint_group(
        &self,
        batch: &RolloutBatch,
        rewards: &Rewards,
        group: usize,
        group_size: usize,
    ) -> Option<Vec<composer_loss::hint::RolloutForHint>> {
        let recent = self.recent.lock().ok()?;
        let range = group * group_size..((group + 1) * group_size).min(batch.samples.len());
        // The group's episodes, found by their completions in one recent env batch: a batch
        // assembled by dynamic sampling keeps groups of several rounds' env batches.
        let whole = recent.iter().rev().find(|e| Self::matches(e, batch));
        let (env, at) = match whole {
            Some(e) => (e, range.start),
            None => recent.iter().rev().find_map(|e| {
                Self::find_group(e, &batch.samples[range.clone()]).map(|at| (e, at))
            })?,
        };
        Some(
            range
                .enumerate()
                .map(|(j, i)| composer_loss::hint::RolloutForHint {
                    prompt_text: self
                        .section
                        .prompt_template
                        .replace("{observation}", &env.prompt_texts[at + j]),
                    completion_text: batch.texts[i].clone(),
                    reward: rewards.total.get(i).copied().unwrap_or(0.0),
                    passed: rewards.passed.get(i).copied().unwrap_or(false),
                    feedback: env.feedback[at + j].clone(),
                })
                .collect(),
        )
    }

    /// Where `group` (consecutive samples) starts in `env`, matched by completions; only at
    /// group boundaries of `env` (multiples of the group's size).
    fn find_group(env: &EnvBatch, group: &[Rollout]) -> Option<usize> {
        let n = group.len();
        if n == 0 || env.completion_ids.len() < n {
            return None;
        }
        (0..=env.completion_ids.len() - n).step_by(n).find(|&at| {
            env.completion_ids[at..at + n]
                .iter()
                .zip(group)
                .all(|(c, smp)| *c == smp.completion_ids)
        })
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
            // ReMax is refused with `[env]` (no greedy baseline episodes).
            remax_baseline: vec![],
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
