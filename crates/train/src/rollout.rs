//! The step's rollouts: prompts drawn from `(seed, step)`, completions sampled through
//! composer-model's batched KV-cached `generate` ([`crate::sampling::sample`]), DAPO's
//! dynamic sampling, and the greedy held-out eval.

use std::time::Instant;

use anyhow::Result;
use composer_loss::AdvantageEstimator;
use composer_model::{EngineConfig, SamplingParams};
use tokenizers::Tokenizer;

use crate::data::PromptRow;
use crate::model::PolicyModel;
use crate::recipe::Recipe;
use crate::rewards::{reward_batch, Rewards};
use crate::sampling::{self, RolloutBatch};
use crate::seed::mix_seed;
use crate::session::Session;
use crate::tokenizer as chartok;

/// The recipe's `[rollout]` sampling knobs, stopping at every id of `stop_ids`.
pub fn sampling_params(recipe: &Recipe, stop_ids: &[u32]) -> SamplingParams {
    let r = &recipe.rollout;
    SamplingParams {
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k,
        min_p: r.min_p,
        max_new_tokens: r.max_completion_length,
        stop_token_ids: Some(stop_ids.to_vec()),
        deterministic: r.deterministic,
        engine: EngineConfig {
            max_running: r.max_running_sequences,
            kv_token_budget: r.kv_token_budget,
            prefill_chunk: r.prefill_chunk,
            kv_block_size: r.kv_block_size,
            cuda_graphs: r.cuda_graphs,
        },
    }
}

/// Sample the step's prompts and `num_generations` completions for each.
pub fn rollout_batch(s: &Session, step: usize) -> Result<RolloutBatch> {
    rollout_round(s, step, 0)
}

/// Round `round` of `step` (round 0 is the step's batch, later rounds DAPO's extra draws):
/// the `[env]` episodes, or [`sample_rollouts`] with the session's weights and prompts.
fn rollout_round(s: &Session, step: usize, round: usize) -> Result<RolloutBatch> {
    if let Some(env) = &s.env_rollout {
        return env.rollout_round(s, step, round);
    }
    sample_rollouts(
        &s.model,
        s.state.policy_version,
        &s.recipe,
        &s.train_rows,
        &s.tok,
        &s.stop_ids,
        step,
        round,
    )
}

/// The prompts of round `round` of `step` (drawn from `(seed, step, round)`) and their
/// completions sampled by `model`, which holds weights version `policy_version`. Round 0 is
/// the step's batch; later rounds are DAPO's extra draws. Shared by the sync loop and the
/// async generator, which samples with a published snapshot.
#[allow(clippy::too_many_arguments)]
pub fn sample_rollouts(
    model: &PolicyModel,
    policy_version: u64,
    recipe: &Recipe,
    train_rows: &[PromptRow],
    tok: &Tokenizer,
    stop_ids: &[u32],
    step: usize,
    round: usize,
) -> Result<RolloutBatch> {
    let seed = recipe.train.seed;
    let n_prompts = recipe.train.prompts_per_step;
    let base = (round * n_prompts) as u64;
    let prompts: Vec<usize> = (0..n_prompts as u64)
        .map(|i| {
            (mix_seed(seed, step as u64, 1_000_000 + base + i) % train_rows.len() as u64) as usize
        })
        .collect();
    let prompt_ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|&i| chartok::encode(tok, &train_rows[i].prompt))
        .collect::<Result<_>>()?;
    let samples = sampling::sample(
        model,
        &prompt_ids,
        recipe.rollout.num_generations,
        &sampling_params(recipe, stop_ids),
        policy_version,
        |p| mix_seed(seed, step as u64, base + p as u64),
    )?;
    let texts = samples
        .iter()
        .map(|x| chartok::decode(tok, &x.completion_ids))
        .collect();
    // ReMax's baseline (verl `gen_max`): one greedy completion per prompt, same weights.
    let greedy_texts = if recipe.loss.advantage.estimator == AdvantageEstimator::Remax {
        let params = SamplingParams {
            temperature: 0.0,
            ..sampling_params(recipe, stop_ids)
        };
        let greedy = sampling::sample(model, &prompt_ids, 1, &params, policy_version, |_| 0)?;
        Some(
            greedy
                .iter()
                .map(|x| chartok::decode(tok, &x.completion_ids))
                .collect(),
        )
    } else {
        None
    };
    Ok(RolloutBatch {
        prompts,
        samples,
        texts,
        greedy_texts,
    })
}

/// A step's scored batch and how it was assembled.
pub struct ScoredBatch {
    /// The rollouts.
    pub batch: RolloutBatch,
    /// Their rewards.
    pub rewards: Rewards,
    /// Seconds sampling.
    pub rollout_s: f64,
    /// Seconds scoring.
    pub reward_s: f64,
    /// Zero-variance groups dropped by dynamic sampling.
    pub dropped_groups: usize,
    /// Sampling rounds used (1 without dynamic sampling).
    pub rounds: usize,
}

/// Rollouts and rewards of a step. With `[loss] dynamic_sampling` (DAPO) the batch is
/// [`fill_groups`]'s, whose extra rounds are `rollout_round`s scored by [`reward_batch`].
pub fn rollout_and_score(s: &Session, step: usize) -> Result<ScoredBatch> {
    let t0 = Instant::now();
    let batch = rollout_batch(s, step)?;
    let mut rollout_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let rewards = reward_batch(s, &batch);
    let mut reward_s = t0.elapsed().as_secs_f64();
    if !s.recipe.loss.advantage.dynamic_sampling {
        return Ok(ScoredBatch {
            batch,
            rewards,
            rollout_s,
            reward_s,
            dropped_groups: 0,
            rounds: 1,
        });
    }
    let filled = fill_groups(&s.recipe, batch, rewards, |round| {
        let t0 = Instant::now();
        let more = rollout_round(s, step, round)?;
        rollout_s += t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let more_rewards = reward_batch(s, &more);
        reward_s += t0.elapsed().as_secs_f64();
        Ok((more, more_rewards))
    })?;
    Ok(ScoredBatch {
        batch: filled.batch,
        rewards: filled.rewards,
        rollout_s,
        reward_s,
        dropped_groups: filled.dropped_groups,
        rounds: filled.rounds,
    })
}

/// What DAPO dynamic sampling made of a step's rounds.
pub struct FilledBatch {
    /// The kept groups (renumbered), or the first round's batch when none was kept.
    pub batch: RolloutBatch,
    /// Their rewards.
    pub rewards: Rewards,
    /// Zero-variance groups dropped.
    pub dropped_groups: usize,
    /// Sampling rounds used.
    pub rounds: usize,
}

/// DAPO dynamic sampling: groups whose rewards all agree are dropped and `more(round)` is
/// asked for another scored round (at most `max_dynamic_sampling_rounds` extra rounds) until
/// `prompts_per_step` groups are kept; if the rounds run out, the step trains on what was
/// kept (or, when nothing was, on the first round's batch, whose advantages are all zero).
/// One implementation for the sync loop and the async generator.
pub fn fill_groups(
    recipe: &Recipe,
    batch: RolloutBatch,
    rewards: Rewards,
    mut more: impl FnMut(usize) -> Result<(RolloutBatch, Rewards)>,
) -> Result<FilledBatch> {
    let g = recipe.rollout.num_generations;
    let want = recipe.train.prompts_per_step;
    let mut kept = RolloutBatch {
        prompts: vec![],
        samples: vec![],
        texts: vec![],
        // The kept samples' baselines are already in their rewards.
        greedy_texts: None,
    };
    let mut kept_rewards = Rewards::default();
    let mut dropped = 0;
    let mut rounds = 0;
    let mut first = None;
    let mut next = Some((batch, rewards));
    while let Some((batch, rewards)) = next.take() {
        rounds += 1;
        let filter = composer_loss::filter_zero_variance_groups(&rewards.total, g)
            .map_err(|e| anyhow::anyhow!("dynamic sampling: {e}"))?;
        for gi in 0..batch.prompts.len() {
            if !filter.kept_groups.contains(&gi) {
                dropped += 1;
                continue;
            }
            if kept.prompts.len() == want {
                continue;
            }
            let group = kept.prompts.len();
            kept.prompts.push(batch.prompts[gi]);
            for i in gi * g..(gi + 1) * g {
                let mut r = batch.samples[i].clone();
                r.group = group;
                kept.samples.push(r);
                kept.texts.push(batch.texts[i].clone());
                kept_rewards.push_from(&rewards, i);
            }
        }
        if first.is_none() {
            first = Some((batch, rewards));
        }
        if kept.prompts.len() < want && rounds <= recipe.loss.max_dynamic_sampling_rounds {
            next = Some(more(rounds)?);
        }
    }
    let (batch, rewards) = if kept.prompts.is_empty() {
        first.expect("at least one round ran")
    } else {
        (kept, kept_rewards)
    };
    Ok(FilledBatch {
        batch,
        rewards,
        dropped_groups: dropped,
        rounds,
    })
}

/// Greedy accuracy on the held-out set.
pub fn evaluate(s: &Session) -> Result<f64> {
    let params = SamplingParams {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        max_new_tokens: s.recipe.rollout.max_completion_length,
        stop_token_ids: Some(s.stop_ids.clone()),
        ..Default::default()
    };
    let max = s.reward.max_reward();
    let mut correct = 0usize;
    for chunk in s.eval_rows.chunks(256) {
        let ids: Vec<Vec<u32>> = chunk
            .iter()
            .map(|r| chartok::encode(&s.tok, &r.prompt))
            .collect::<Result<_>>()?;
        let out = sampling::sample(&s.model, &ids, 1, &params, s.state.policy_version, |_| 0)?;
        for (row, smp) in chunk.iter().zip(&out) {
            let text = chartok::decode(&s.tok, &smp.completion_ids);
            if s.reward.score(&text, &row.answer).0 >= max - 1e-9 {
                correct += 1;
            }
        }
    }
    Ok(correct as f64 / s.eval_rows.len().max(1) as f64)
}
