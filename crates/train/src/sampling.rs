//! Rollouts through composer-model's batched, KV-cached [`composer_model::generate`], for
//! every policy (built-in or HF, single-turn or env turns), and what the trainer keeps of
//! each sampled completion ([`Rollout`]) and step ([`RolloutBatch`]).

use anyhow::Result;
use composer_model::{FinishReason, GenerationRequest, PrefixStore, SamplingParams};

use crate::model::PolicyModel;

/// One sampled completion, with what the loss and the audit need.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    /// Index of its prompt in the step's prompt list (its group).
    pub group: usize,
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Completion token ids (ending with a stop id unless truncated).
    pub completion_ids: Vec<u32>,
    /// Sampler log-prob of each completion token (after temperature, before top-k/top-p).
    pub sampler_logprobs: Vec<f32>,
    /// Hit `max_new_tokens` (or the position limit) without a stop id.
    pub truncated: bool,
    /// Weights version that produced it.
    pub policy_version: u64,
    /// Per completion token, 1 = trained on, 0 = not (environment observation tokens between
    /// model turns of a multi-turn episode). `None`: every completion token is trained on.
    pub loss_mask: Option<Vec<u8>>,
}

/// One step's rollouts.
pub struct RolloutBatch {
    /// The step's prompts (indices into `train_rows`), one group each.
    pub prompts: Vec<usize>,
    /// `prompts.len() × num_generations` rollouts, grouped.
    pub samples: Vec<Rollout>,
    /// Decoded completion texts.
    pub texts: Vec<String>,
    /// With `[loss] estimator = "remax"`: per prompt, the text of its greedy (temperature 0)
    /// completion, sampled by the same weights; its reward is the prompt's baseline.
    pub greedy_texts: Option<Vec<String>>,
}

/// Samples `n` completions of every prompt in one batched, KV-cached `generate` call.
/// Prompt `p`'s samples draw from ChaCha8(`seed_of(p)`) streams 0..n (composer-model's
/// per-request seeding), so a prompt's completions do not depend on the rest of the batch.
/// `params.stop_token_ids` should hold every EOS id of the model. Rollouts come back grouped:
/// prompt 0's `n`, then prompt 1's...
pub fn sample(
    model: &PolicyModel,
    prompts: &[Vec<u32>],
    n: usize,
    params: &SamplingParams,
    policy_version: u64,
    seed_of: impl Fn(usize) -> u64,
) -> Result<Vec<Rollout>> {
    Ok(sample_with_store(model, prompts, n, params, policy_version, seed_of, None)?.0)
}

/// As [`sample`], continuing prompts that start with a row of `store` (composer-model's
/// [`PrefixStore`]: the previous turns of multi-turn episodes) from its KV, and storing every
/// finished sample's row there (deterministic mode does not use the store). Also returns the
/// number of prompt tokens prefilled.
pub fn sample_with_store(
    model: &PolicyModel,
    prompts: &[Vec<u32>],
    n: usize,
    params: &SamplingParams,
    policy_version: u64,
    seed_of: impl Fn(usize) -> u64,
    store: Option<&mut PrefixStore>,
) -> Result<(Vec<Rollout>, usize)> {
    let requests: Vec<GenerationRequest> = prompts
        .iter()
        .enumerate()
        .map(|(p, ids)| GenerationRequest {
            prompt_ids: ids.clone(),
            num_samples: n,
            seed: seed_of(p),
        })
        .collect();
    let (out, prefilled) = match store {
        Some(store) if !params.deterministic => {
            let (out, stats) = composer_model::generate_with_store(
                &model.transformer,
                &requests,
                params,
                Some(store),
            )?;
            (out, stats.prefill_tokens)
        }
        _ => {
            let out = composer_model::generate(&model.transformer, &requests, params)?;
            (out, prompts.iter().map(|p| p.len()).sum())
        }
    };
    let mut rollouts = Vec::with_capacity(prompts.len() * n);
    for (group, samples) in out.into_iter().enumerate() {
        for smp in samples {
            rollouts.push(Rollout {
                group,
                prompt_ids: prompts[group].clone(),
                completion_ids: smp.completion_ids,
                sampler_logprobs: smp.sampler_logprobs,
                truncated: smp.finish_reason == FinishReason::Length,
                policy_version,
                loss_mask: None,
            });
        }
    }
    Ok((rollouts, prefilled))
}
