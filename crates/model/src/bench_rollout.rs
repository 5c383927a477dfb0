//! `composer-rl bench rollout`: the rollout engine's decode throughput on an HF checkpoint, for
//! a side-by-side comparison with transformers' `generate` on the same prompt ids (the CLI
//! runs `tools/bench_generate_hf.py`); deterministic mode's throughput on the same workload
//! (what its bitwise sampler-vs-scorer log-probs cost) and that difference on the same
//! checkpoint. On the CPU in f32 by default; with a device, a dtype and a named shape (random
//! weights, the checkpoint's tokenizer) the same measurements on a GPU in bf16, where
//! deterministic mode's bitwise claim has to hold with the GPU's kernels.
//!
//! Every sample runs to `new_tokens` (no stop ids), as `generate(min_new_tokens =
//! max_new_tokens)` does on the Python side, so both decode the same number of tokens.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use serde::Serialize;

use crate::{
    generate_with_stats, score_deterministic, EngineConfig, GenerationRequest, Policy,
    SamplingParams, Tokenizer, Transformer,
};

/// What to run.
#[derive(Debug, Clone)]
pub struct RolloutBenchOptions {
    /// HF checkpoint directory (with `shape`: where the tokenizer comes from).
    pub model_dir: PathBuf,
    /// A named shape ([`crate::bench::shape_model_config`]): random weights instead of the
    /// checkpoint's.
    pub shape: Option<String>,
    /// Where the model runs.
    pub device: Device,
    /// The weights' and activations' dtype.
    pub dtype: DType,
    /// The engine's decode steps replayed as CUDA graphs ([`EngineConfig::cuda_graphs`]).
    pub cuda_graphs: bool,
    /// Samples decoded together (one prompt, `batch` samples).
    pub batch: usize,
    /// New tokens per sample.
    pub new_tokens: usize,
    /// Timed runs after one warm-up run (the median is reported).
    pub repeats: usize,
    /// Prompt text (plain, no chat template).
    pub prompt: String,
}

/// What was measured.
#[derive(Debug, Clone, Serialize)]
pub struct RolloutBenchReport {
    /// The prompt's token ids (the reference decodes the same ids).
    pub prompt_ids: Vec<u32>,
    /// Decoded tokens per second of each timed run.
    pub runs_tokens_per_s: Vec<f64>,
    /// Their median.
    pub tokens_per_s: f64,
    /// CPU threads of candle's pool.
    pub threads: usize,
    /// Where it ran (`cpu`, `cuda:0`).
    pub device: String,
    /// The dtype it ran in.
    pub dtype: String,
    /// The engine ran with its decode steps as CUDA graphs.
    pub cuda_graphs: bool,
    /// Deterministic mode (`deterministic = true`: one token a step, batch-invariant
    /// products on the CPU, every sample alone elsewhere) on the
    /// same workload: tokens per second of each timed run, alternating with the engine's.
    pub deterministic_runs_tokens_per_s: Vec<f64>,
    /// Their median.
    pub deterministic_tokens_per_s: f64,
    /// Tokens compared in deterministic mode.
    pub deterministic_tokens: usize,
    /// Max |sampler − scorer| log-prob over them (0 = bitwise equal).
    pub deterministic_max_abs_diff: f64,
}

/// The median of `xs` (0 when empty).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// The policy to decode with: the checkpoint of `opts.model_dir`, or random weights of
/// `opts.shape` with that checkpoint's tokenizer (its vocabulary widened to the tokenizer's).
fn bench_policy(opts: &RolloutBenchOptions) -> Result<Policy> {
    let Some(shape) = &opts.shape else {
        return Policy::load(&opts.model_dir, &opts.device, opts.dtype);
    };
    let tokenizer = Tokenizer::from_dir(&opts.model_dir)?;
    let cfg = crate::bench::shape_model_config_for(shape, &tokenizer)?;
    let (model, _) = Transformer::random_init_on_device(&cfg, opts.dtype, &opts.device)?;
    Policy::new(model, tokenizer, None)
}

/// Decodes `batch × new_tokens` `repeats` times with the engine and as many in deterministic
/// mode, alternating, then checks deterministic mode's sampler log-probs against its scorer
/// on two samples.
pub fn bench_rollout(opts: &RolloutBenchOptions) -> Result<RolloutBenchReport> {
    if opts.batch == 0 || opts.new_tokens == 0 || opts.repeats == 0 {
        bail!(
            "bench rollout: --batch, --new-tokens and --repeats must be >= 1 (got {}, {}, {})",
            opts.batch,
            opts.new_tokens,
            opts.repeats
        );
    }
    let policy = bench_policy(opts)?;
    let prompt_ids = policy.encode_prompt(&opts.prompt, false)?;
    let max_pos = policy.model.cfg.max_position_embeddings;
    if prompt_ids.is_empty() || prompt_ids.len() + opts.new_tokens > max_pos {
        bail!(
            "bench rollout: {} prompt tokens + --new-tokens {} do not fit the model's \
             max_position_embeddings ({max_pos})",
            prompt_ids.len(),
            opts.new_tokens
        );
    }
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: opts.new_tokens,
        stop_token_ids: Some(Vec::new()),
        engine: EngineConfig {
            cuda_graphs: opts.cuda_graphs,
            ..EngineConfig::default()
        },
        ..SamplingParams::default()
    };
    let request = |seed| GenerationRequest {
        prompt_ids: prompt_ids.clone(),
        num_samples: opts.batch,
        seed,
    };
    let det_params = SamplingParams {
        deterministic: true,
        ..params.clone()
    };
    // Tokens per second of one run of `params` (every sample must reach --new-tokens).
    let timed = |params: &SamplingParams, seed: u64| -> Result<f64> {
        let start = Instant::now();
        // The engine also counts what it generated; deterministic mode has no stats.
        let (out, generated) = if params.deterministic {
            (
                crate::generate(&policy.model, &[request(seed)], params)?,
                None,
            )
        } else {
            let (out, stats) = generate_with_stats(&policy.model, &[request(seed)], params)?;
            (out, Some(stats.generated_tokens))
        };
        let secs = start.elapsed().as_secs_f64();
        let tokens: usize = out.iter().flatten().map(|s| s.completion_ids.len()).sum();
        if tokens != opts.batch * opts.new_tokens || generated.is_some_and(|g| g != tokens) {
            bail!("bench rollout: decoded {tokens} tokens, expected every sample to run to --new-tokens");
        }
        Ok(tokens as f64 / secs)
    };
    // One warm-up each, then the timed runs alternating between the engine and deterministic
    // mode so both see the machine's noise.
    let (mut runs, mut det_runs) = (Vec::new(), Vec::new());
    for run in 0..=opts.repeats {
        let (engine, det) = (timed(&params, run as u64)?, timed(&det_params, run as u64)?);
        if run > 0 {
            runs.push(engine);
            det_runs.push(det);
        }
    }

    // Deterministic mode: the sampler's log-probs against the scorer's on the same ids.
    let det_params = SamplingParams {
        max_new_tokens: opts.new_tokens.min(32),
        ..det_params
    };
    let det_req = GenerationRequest {
        num_samples: 2,
        ..request(7)
    };
    let samples = crate::generate(&policy.model, &[det_req], &det_params)?;
    let mut max_diff = 0f64;
    let mut compared = 0usize;
    for s in samples.iter().flatten() {
        let mut seq = prompt_ids.clone();
        seq.extend_from_slice(&s.completion_ids);
        let scored = score_deterministic(&policy.model, &[seq], 1.0)?;
        let tail = &scored[0][prompt_ids.len() - 1..];
        for (a, b) in s.sampler_logprobs.iter().zip(tail) {
            max_diff = max_diff.max((f64::from(*a) - f64::from(*b)).abs());
            compared += 1;
        }
    }
    Ok(RolloutBenchReport {
        prompt_ids,
        tokens_per_s: median(&runs),
        runs_tokens_per_s: runs,
        threads: candle_core::utils::get_num_threads(),
        device: format!("{:?}", opts.device),
        dtype: opts.dtype.as_str().to_string(),
        cuda_graphs: opts.cuda_graphs,
        deterministic_tokens_per_s: median(&det_runs),
        deterministic_runs_tokens_per_s: det_runs,
        deterministic_tokens: compared,
        deterministic_max_abs_diff: max_diff,
    })
}
