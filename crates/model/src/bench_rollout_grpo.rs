//! `composer-rl bench rollout --workload grpo`: a GRPO-shaped rollout (P prompts × G samples,
//! up to N new tokens, prompts of varied length, completion lengths spread with a long tail)
//! through the rollout engine under three schedules, side by side in one run:
//!
//! * **static batches**: whole requests in fixed batches of `rows` samples, each batch run
//!   to its longest completion before the next starts — a batched sampler with that memory cap
//!   and no continuous batching (what the trainer's sampler did before the engine);
//! * **continuous**: every request given to the engine with `max_running = rows`: a finished
//!   sample's row is refilled at once;
//! * **continuous within the static arm's memory**: the same with `kv_token_budget` = the
//!   static arm's peak KV slots;
//! * **all at once**: every sample in one batch, no limit;
//! * with `cuda_graphs`, **continuous + CUDA graphs**: the continuous arm with its decode steps
//!   at padded, fixed shapes replayed as CUDA graphs.
//!
//! Each arm reports wall time, tokens/s, decode steps, prefill tokens (a prompt is prefilled
//! once for its G samples: the saving against G prefills is printed) and KV memory (paged
//! slots held, the same without prefix sharing, pool slots). Completion lengths come from stop
//! ids: every `mean_completion`-th token id ends a sample, so under a random model's
//! near-uniform logits lengths are roughly geometric around that mean, capped at N (the
//! realised spread is reported). Same seeds in every arm, so the arms sample the same tokens
//! up to rounding (batch composition may change a float's last bits, and a draw on a boundary
//! then picks another token: the count of such samples is reported; each arm's tokens/s
//! counts its own tokens).

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Device;
use serde::Serialize;

use crate::bench_rollout::median;
use crate::{generate_with_stats, EngineConfig, EngineStats, GenerationRequest, SamplingParams};
use crate::{Sample, Transformer};

/// The workload.
#[derive(Debug, Clone, Serialize)]
pub struct GrpoRolloutOptions {
    /// Prompts (requests).
    pub prompts: usize,
    /// Samples per prompt (GRPO's `num_generations`).
    pub group: usize,
    /// Most new tokens per sample.
    pub max_new_tokens: usize,
    /// Shortest and longest prompt (lengths spread evenly between them over the prompts).
    pub prompt_len: (usize, usize),
    /// Every `mean_completion`-th token id is a stop id (expected completion length under
    /// near-uniform logits).
    pub mean_completion: usize,
    /// Rows the static and continuous arms may hold at once (a multiple of `group`).
    pub rows: usize,
    /// Timed runs of each arm (after one warm-up call); medians are reported.
    pub repeats: usize,
    /// Adds the continuous arm again with its decode steps replayed as CUDA graphs
    /// ([`EngineConfig::cuda_graphs`]; on the CPU the fixed-shape steps without capture).
    pub cuda_graphs: bool,
}

impl Default for GrpoRolloutOptions {
    /// The shape: 16 prompts × 8 samples × up to 256 new tokens.
    fn default() -> Self {
        GrpoRolloutOptions {
            prompts: 16,
            group: 8,
            max_new_tokens: 256,
            prompt_len: (64, 256),
            mean_completion: 96,
            rows: 32,
            repeats: 1,
            cuda_graphs: false,
        }
    }
}

/// One schedule's numbers (medians over the timed runs).
#[derive(Debug, Clone, Serialize)]
pub struct GrpoArm {
    /// The schedule.
    pub arm: String,
    /// Wall seconds of the whole rollout.
    pub seconds: f64,
    /// Completion tokens sampled.
    pub tokens: usize,
    /// `tokens / seconds`.
    pub tokens_per_s: f64,
    /// Batched one-token decode forwards.
    pub decode_forwards: usize,
    /// Prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Most KV slots held at once (shared prompt blocks once).
    pub peak_kv_slots: usize,
    /// The same if every sample held its own prompt blocks.
    pub peak_kv_slots_unshared: usize,
    /// Slots the block pool allocated.
    pub kv_pool_slots: usize,
}

/// What the workload measured.
#[derive(Debug, Clone, Serialize)]
pub struct GrpoRolloutReport {
    /// The workload.
    pub options: GrpoRolloutOptions,
    /// Parameters of the model.
    pub parameters: usize,
    /// Completion lengths of the first arm: min, mean, p90, max.
    pub completion_len: [f64; 4],
    /// Prompt tokens if each sample prefilled its own prompt.
    pub prefill_tokens_unshared: usize,
    /// The most samples of one run whose tokens differ from the first arm's first run (0 on
    /// the CPU in f32 unless a draw falls on a rounding boundary: outside deterministic mode
    /// the kernels are not batch-invariant).
    pub samples_differing: usize,
    /// The schedules, in order.
    pub arms: Vec<GrpoArm>,
    /// Why the CUDA-graph arm (`cuda_graphs`) is missing, if it failed.
    pub cuda_graphs_error: Option<String>,
}

/// Checks the workload before any model work.
fn check(opts: &GrpoRolloutOptions, model: &Transformer) -> Result<()> {
    let o = opts;
    if o.prompts == 0 || o.group == 0 || o.max_new_tokens == 0 || o.repeats == 0 {
        bail!(
            "bench rollout --workload grpo: --prompts, --group, --new-tokens and --repeats must \
             be >= 1 (got {}, {}, {}, {})",
            o.prompts,
            o.group,
            o.max_new_tokens,
            o.repeats
        );
    }
    if o.rows == 0 || !o.rows.is_multiple_of(o.group) {
        bail!(
            "bench rollout --workload grpo: --max-running {} must be a positive multiple of \
             --group {} (the static arm runs whole requests)",
            o.rows,
            o.group
        );
    }
    let (lo, hi) = o.prompt_len;
    if lo == 0 || hi < lo {
        bail!("bench rollout --workload grpo: prompt lengths {lo}..={hi} are not a range of >= 1");
    }
    let max_pos = model.cfg.max_position_embeddings;
    if hi + o.max_new_tokens > max_pos {
        bail!(
            "bench rollout --workload grpo: the longest prompt ({hi}) + --new-tokens {} is over \
             the model's max_position_embeddings ({max_pos})",
            o.max_new_tokens
        );
    }
    let vocab = model.cfg.vocab_size;
    if o.mean_completion < 2 || o.mean_completion >= vocab {
        bail!(
            "bench rollout --workload grpo: --mean-completion {} must be in 2..{vocab} (the \
             vocabulary size)",
            o.mean_completion
        );
    }
    Ok(())
}

/// The workload's requests: prompt `i` has a length spread evenly over `prompt_len` and ids
/// that avoid the stop ids.
pub fn grpo_requests(opts: &GrpoRolloutOptions, vocab: usize) -> Vec<GenerationRequest> {
    let (lo, hi) = opts.prompt_len;
    let m = opts.mean_completion;
    (0..opts.prompts)
        .map(|i| {
            let len = if opts.prompts == 1 {
                hi
            } else {
                lo + (hi - lo) * i / (opts.prompts - 1)
            };
            let prompt_ids = (0..len)
                .map(|j| {
                    let id = (i * 7919 + j * 104_729 + 13) % vocab;
                    // Not a stop id (ids ≡ 0 mod m stop; their neighbours do not, m >= 2).
                    let id = match id {
                        id if id % m != 0 => id,
                        id if id + 1 < vocab => id + 1,
                        id => id - 1,
                    };
                    id as u32
                })
                .collect();
            GenerationRequest {
                prompt_ids,
                num_samples: opts.group,
                seed: i as u64,
            }
        })
        .collect()
}

/// Runs the three schedules `repeats` times each (alternated) after a warm-up.
pub fn bench_grpo_rollout(
    model: &Transformer,
    opts: &GrpoRolloutOptions,
) -> Result<GrpoRolloutReport> {
    check(opts, model)?;
    let vocab = model.cfg.vocab_size;
    let requests = grpo_requests(opts, vocab);
    let stop_ids: Vec<u32> = (0..vocab)
        .step_by(opts.mean_completion)
        .map(|i| i as u32)
        .collect();
    let params = |engine| SamplingParams {
        temperature: 1.0,
        max_new_tokens: opts.max_new_tokens,
        stop_token_ids: Some(stop_ids.clone()),
        engine,
        ..Default::default()
    };
    let device = model.device().clone();
    let sync = || -> Result<()> { Ok(device.synchronize()?) };
    // Warm-up: allocations, the thread pool, the device's kernels.
    generate_with_stats(model, &requests[..1], &params(EngineConfig::default()))?;
    sync()?;

    let rows = opts.rows;
    let continuous = EngineConfig {
        max_running: rows,
        ..Default::default()
    };
    type Run = (Vec<Vec<Sample>>, EngineStats, f64);
    let run_static = || -> Result<Run> {
        let t0 = Instant::now();
        let mut out = Vec::new();
        let mut total = EngineStats::default();
        for chunk in requests.chunks(rows / opts.group) {
            let (o, s) = generate_with_stats(model, chunk, &params(EngineConfig::default()))?;
            out.extend(o);
            merge_stats(&mut total, s);
        }
        sync()?;
        Ok((out, total, t0.elapsed().as_secs_f64()))
    };
    let run_engine = |engine: EngineConfig| -> Result<Run> {
        let t0 = Instant::now();
        let (o, s) = generate_with_stats(model, &requests, &params(engine))?;
        sync()?;
        Ok((o, s, t0.elapsed().as_secs_f64()))
    };
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); 4 + usize::from(opts.cuda_graphs)];
    let mut static_peak = 0;
    let mut graphs_error = None;
    for _ in 0..opts.repeats {
        let static_run = run_static()?;
        static_peak = static_run.1.peak_kv_slots();
        runs[0].push(static_run);
        runs[1].push(run_engine(continuous)?);
        runs[2].push(run_engine(EngineConfig {
            kv_token_budget: static_peak,
            ..continuous
        })?);
        runs[3].push(run_engine(EngineConfig::default())?);
        if opts.cuda_graphs && graphs_error.is_none() {
            // A failing graph arm (a capture the device refuses) drops that arm only.
            match run_engine(EngineConfig {
                cuda_graphs: true,
                ..continuous
            }) {
                Ok(run) => runs[4].push(run),
                Err(e) => graphs_error = Some(format!("{e:#}")),
            }
        }
    }
    if graphs_error.is_some() {
        runs.truncate(4);
    }
    let mut names = vec![
        format!("static batches of {rows}"),
        format!("continuous, max_running {rows}"),
        format!("  + kv_token_budget {static_peak}"),
        format!("all {} at once", opts.prompts * opts.group),
    ];
    if runs.len() > 4 {
        names.push(format!("continuous {rows} + CUDA graphs"));
    }

    let tokens_of = |out: &[Vec<Sample>]| -> Vec<Vec<u32>> {
        out.iter()
            .flatten()
            .map(|s| s.completion_ids.clone())
            .collect()
    };
    let first = tokens_of(&runs[0][0].0);
    let samples_differing = runs
        .iter()
        .flatten()
        .map(|r| {
            let t = tokens_of(&r.0);
            t.iter().zip(&first).filter(|(a, b)| a != b).count()
        })
        .max()
        .unwrap_or(0);
    let mut lens: Vec<f64> = first.iter().map(|t| t.len() as f64).collect();
    lens.sort_by(f64::total_cmp);
    let completion_len = [
        lens.first().copied().unwrap_or(0.0),
        lens.iter().sum::<f64>() / lens.len().max(1) as f64,
        lens[(lens.len() * 9 / 10).min(lens.len() - 1)],
        lens.last().copied().unwrap_or(0.0),
    ];
    let arms = names
        .into_iter()
        .zip(&runs)
        .map(|(arm, rs)| {
            let seconds = median(&rs.iter().map(|r| r.2).collect::<Vec<_>>());
            let (_, stats, _) = &rs[0];
            let tokens = stats.generated_tokens;
            GrpoArm {
                arm,
                seconds,
                tokens,
                tokens_per_s: tokens as f64 / seconds.max(1e-12),
                decode_forwards: stats.decode_forwards,
                prefill_tokens: stats.prefill_tokens,
                peak_kv_slots: stats.peak_kv_slots(),
                peak_kv_slots_unshared: stats.peak_kv_block_refs() * stats.kv_block_size,
                kv_pool_slots: stats.kv_pool_blocks * stats.kv_block_size,
            }
        })
        .collect();
    Ok(GrpoRolloutReport {
        options: opts.clone(),
        parameters: model.num_parameters(),
        completion_len,
        prefill_tokens_unshared: requests
            .iter()
            .map(|r| r.prompt_ids.len() * r.num_samples)
            .sum(),
        samples_differing,
        arms,
        cuda_graphs_error: graphs_error,
    })
}

/// Adds a later sequential engine run (the static arm's next batch) to `total`: counts add,
/// memory peaks are the larger (the batches never overlap).
fn merge_stats(total: &mut EngineStats, s: EngineStats) {
    total.prefill_tokens += s.prefill_tokens;
    total.prefill_forwards += s.prefill_forwards;
    total.decode_forwards += s.decode_forwards;
    total.generated_tokens += s.generated_tokens;
    total.kv_block_size = s.kv_block_size;
    total.kv_pool_blocks = total.kv_pool_blocks.max(s.kv_pool_blocks);
    total.kv_block_copies += s.kv_block_copies;
    total.steps.extend(s.steps);
}

impl GrpoRolloutReport {
    /// The side-by-side table.
    pub fn table(&self, device: &Device, dtype: &str) -> String {
        let o = &self.options;
        let [min, mean, p90, max] = self.completion_len;
        let mut s = format!(
            "GRPO-shaped rollout: {:.1}M params, {} prompts ({}..={} tokens) x {} samples, up to \
             {} new tokens, {dtype} on {device:?}; completion lengths min {min:.0} mean {mean:.1} \
             p90 {p90:.0} max {max:.0}; samples differing from the first arm's: {}\n",
            self.parameters as f64 / 1e6,
            o.prompts,
            o.prompt_len.0,
            o.prompt_len.1,
            o.group,
            o.max_new_tokens,
            self.samples_differing,
        );
        s.push_str(
            "| arm | seconds | tokens/s | vs static | decode steps | prefill tokens | peak KV held | \
             held unshared | pool slots |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let base = self.arms.first().map_or(f64::NAN, |a| a.tokens_per_s);
        for a in &self.arms {
            s.push_str(&format!(
                "| {} | {:.2} | {:.0} | {:.2}x | {} | {} | {} | {} | {} |\n",
                a.arm,
                a.seconds,
                a.tokens_per_s,
                a.tokens_per_s / base,
                a.decode_forwards,
                a.prefill_tokens,
                a.peak_kv_slots,
                a.peak_kv_slots_unshared,
                a.kv_pool_slots
            ));
        }
        let shared = self.arms.first().map_or(0, |a| a.prefill_tokens);
        s.push_str(&format!(
            "prefix sharing: {shared} prompt tokens prefilled instead of {} ({:.1}x fewer)",
            self.prefill_tokens_unshared,
            self.prefill_tokens_unshared as f64 / shared.max(1) as f64
        ));
        if let Some(e) = &self.cuda_graphs_error {
            s.push_str(&format!("\nthe CUDA-graph arm failed: {e}"));
        }
        s
    }
}
