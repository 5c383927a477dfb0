//! Rewards and advantages of a step's rollouts, and the audit record of each step's samples
//! (`RUN_DIR/samples/step_NNNNNN.jsonl`).

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use composer_loss::{compute_advantages, compute_remax_advantages, AdvantageEstimator};
use serde_json::json;

use crate::data::PromptRow;
use crate::sampling::RolloutBatch;
use crate::session::Session;
use crate::verifiers::RewardFn;

/// One step's rewards.
#[derive(Debug, Clone, Default)]
pub struct Rewards {
    /// Total reward per sample.
    pub total: Vec<f64>,
    /// Per verifier, per sample (`[sample][verifier]`).
    pub per_func: Vec<Vec<f64>>,
    /// Whether each sample reached the maximal reward.
    pub passed: Vec<bool>,
    /// Seconds spent scoring each sample.
    pub latency_s: Vec<f64>,
    /// With `[loss] estimator = "remax"`: per sample, per verifier, the score of its prompt's
    /// greedy completion (the ReMax baseline; unweighted, as `per_func`). Empty otherwise.
    pub remax_baseline: Vec<Vec<f64>>,
}

impl Rewards {
    /// Per-verifier rewards already multiplied by their weights (the advantage code then sums
    /// them with unit weights unless `[loss] reward_weights` says otherwise).
    pub fn per_func_weighted(&self, f: &RewardFn) -> Vec<Vec<f64>> {
        weighted(&self.per_func, f)
    }

    /// Appends sample `i` of `other`.
    pub fn push_from(&mut self, other: &Rewards, i: usize) {
        self.total.push(other.total[i]);
        self.per_func.push(other.per_func[i].clone());
        self.passed.push(other.passed[i]);
        self.latency_s.push(other.latency_s[i]);
        if let Some(b) = other.remax_baseline.get(i) {
            self.remax_baseline.push(b.clone());
        }
    }

    /// Per sample, its ReMax baseline's total reward (the verifiers' weighted sum, as
    /// `total`); empty without ReMax.
    pub fn remax_baseline_totals(&self, f: &RewardFn) -> Vec<f64> {
        weighted(&self.remax_baseline, f)
            .iter()
            .map(|r| r.iter().sum())
            .collect()
    }
}

/// Per-verifier scores multiplied by the verifiers' weights.
fn weighted(per_func: &[Vec<f64>], f: &RewardFn) -> Vec<Vec<f64>> {
    per_func
        .iter()
        .map(|r| r.iter().zip(&f.parts).map(|(x, (_, w))| x * w).collect())
        .collect()
}

/// Score every completion with the verifiers (or take the env's rewards).
pub fn reward_batch(s: &Session, batch: &RolloutBatch) -> Rewards {
    if let Some(env) = &s.env_rollout {
        return env.reward_batch(s, batch);
    }
    score_rollouts(
        &s.reward,
        &s.train_rows,
        s.recipe.rollout.num_generations,
        s.recipe.train.reward_latency_s,
        batch,
    )
}

/// Scores `batch` against its prompts' answers (and, for ReMax, each prompt's greedy
/// completion: the baseline of its samples); `added_latency_s` is slept per sample (the
/// async benchmark's slow environment). Shared by the sync loop and the async rewarder.
pub fn score_rollouts(
    reward: &RewardFn,
    train_rows: &[PromptRow],
    num_generations: usize,
    added_latency_s: f64,
    batch: &RolloutBatch,
) -> Rewards {
    let max = reward.max_reward();
    let mut out = Rewards::default();
    for (i, text) in batch.texts.iter().enumerate() {
        let t0 = Instant::now();
        if added_latency_s > 0.0 {
            std::thread::sleep(std::time::Duration::from_secs_f64(added_latency_s));
        }
        let answer = &train_rows[batch.prompts[i / num_generations]].answer;
        let (total, comps) = reward.score(text, answer);
        out.latency_s.push(t0.elapsed().as_secs_f64());
        out.passed.push(total >= max - 1e-9);
        out.total.push(total);
        out.per_func.push(comps);
    }
    if let Some(greedy) = &batch.greedy_texts {
        for (g, text) in greedy.iter().enumerate() {
            let (_, comps) = reward.score(text, &train_rows[batch.prompts[g]].answer);
            out.remax_baseline
                .extend(std::iter::repeat_n(comps, num_generations));
        }
    }
    out
}

/// Advantages of the step's samples from their (weighted) rewards.
pub fn step_advantages(s: &Session, batch: &RolloutBatch, rewards: &Rewards) -> Result<Vec<f64>> {
    let lengths: Vec<usize> = batch
        .samples
        .iter()
        .map(|x| x.completion_ids.len())
        .collect();
    let cfg = &s.recipe.loss.advantage;
    let per_func = rewards.per_func_weighted(&s.reward);
    if cfg.estimator == AdvantageEstimator::Remax {
        return compute_remax_advantages(
            cfg,
            &per_func,
            &weighted(&rewards.remax_baseline, &s.reward),
        )
        .context("computing ReMax advantages (the greedy baselines' rewards)");
    }
    compute_advantages(cfg, &per_func, &lengths, s.recipe.rollout.num_generations)
        .context("computing advantages")
}

/// Writes `RUN_DIR/samples/step_NNNNNN.jsonl`: per sample its prompt ids, completion ids,
/// sampler log-probs, loss mask (multi-turn), reward, advantage, ReMax baseline reward (with
/// `remax`; `baseline_totals` per sample, else empty) and the policy version that sampled it.
pub fn record_samples(
    run_dir: &Path,
    step: usize,
    batch: &RolloutBatch,
    rewards: &Rewards,
    advantages: &[f64],
    baseline_totals: &[f64],
) -> Result<()> {
    let dir = run_dir.join("samples");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("step_{step:06}.jsonl"));
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?,
    );
    for (i, smp) in batch.samples.iter().enumerate() {
        let line = json!({
            "group": smp.group,
            "prompt_ids": smp.prompt_ids,
            "completion_ids": smp.completion_ids,
            "sampler_logprobs": smp.sampler_logprobs,
            "loss_mask": smp.loss_mask,
            "truncated": smp.truncated,
            "reward": rewards.total.get(i),
            "passed": rewards.passed.get(i),
            "advantage": advantages.get(i),
            "remax_baseline": baseline_totals.get(i),
            "policy_version": smp.policy_version,
        });
        writeln!(out, "{line}").with_context(|| format!("writing {}", path.display()))?;
    }
    out.flush()
        .with_context(|| format!("writing {}", path.display()))
}
