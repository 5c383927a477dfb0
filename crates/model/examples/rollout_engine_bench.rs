//! Static batches vs the continuous-batching rollout engine, side by side, on a random
//! Qwen2 with skewed completion lengths (numbers are printed, never asserted).
//!
//! Both arms hold at most `rows` sequences at once. The static arm runs the samples in
//! fixed batches of `rows` (whole requests), each to its longest completion before the next
//! starts — what a caller with that memory cap had to do before. The continuous arm gives all
//! requests to the engine with `max_running = rows`: a finished sample's row is refilled at
//! once; a third arm adds `kv_token_budget` = the static arm's peak KV slots (same memory).
//! A last arm runs every sample in one batch with no limit. Same seeds, so all arms sample
//! the same tokens (checked). KV memory is reported as the paged cache's peak slots held
//! (blocks × block size, a prompt's blocks shared by its samples counted once), the same
//! without sharing (every sample's table counted in full), and the pool's allocated slots.
//!
//! `cargo run --release -p composer-model --example rollout_engine_bench -- [rows] [prompts]
//! [group] [max_new] [hidden] [layers] [prompt_len]` (defaults 16 8 8 192 128 4 0; prompt
//! length 0 = prompts of 32 to 64 tokens).

use anyhow::{ensure, Result};
use candle_core::Device;
use composer_model::{
    generate_with_stats, EngineConfig, EngineStats, GenerationRequest, ModelConfig, Sample,
    SamplingParams, Transformer,
};
use std::time::Instant;

fn arg(i: usize, default: usize) -> Result<usize> {
    match std::env::args().nth(i) {
        Some(s) => Ok(s.parse()?),
        None => Ok(default),
    }
}

fn main() -> Result<()> {
    composer_model::configure_cpu_threads();
    let (rows, prompts, group, max_new) = (arg(1, 16)?, arg(2, 8)?, arg(3, 8)?, arg(4, 192)?);
    let (hidden, layers, prompt_len) = (arg(5, 128)?, arg(6, 4)?, arg(7, 0)?);
    ensure!(
        hidden % 64 == 0,
        "hidden ({hidden}) must be a multiple of 64"
    );
    ensure!(
        rows % group == 0,
        "rows ({rows}) must be a multiple of group ({group})"
    );
    let mut cfg = ModelConfig::tiny_qwen2(512);
    // 32-wide heads, 2 KV heads (GQA), a SwiGLU MLP 3x wide.
    cfg.hidden_size = hidden;
    cfg.intermediate_size = 3 * hidden;
    cfg.num_hidden_layers = layers;
    cfg.num_attention_heads = hidden / 32;
    cfg.num_key_value_heads = 2;
    cfg.head_dim = 32;
    cfg.max_position_embeddings = 512;
    let (model, _) = Transformer::random_init(&cfg, 0, &Device::Cpu)?;
    // Near-uniform random logits: 16 stop ids of 512 end a sample with p ~ 1/32 per token, so
    // completion lengths are geometric (mean ~32, capped at max_new): a few long ones.
    let params = |engine| SamplingParams {
        max_new_tokens: max_new,
        stop_token_ids: Some((0..16).collect()),
        engine,
        ..Default::default()
    };
    let requests: Vec<GenerationRequest> = (0..prompts)
        .map(|i| GenerationRequest {
            prompt_ids: (0..if prompt_len > 0 {
                prompt_len
            } else {
                32 + (i * 7) % 33
            })
                .map(|j| 16 + ((i * 31 + j * 17) % 496) as u32)
                .collect(),
            num_samples: group,
            seed: i as u64,
        })
        .collect();
    // Warm-up (allocations, thread pool).
    generate_with_stats(&model, &requests[..1], &params(EngineConfig::default()))?;

    let t0 = Instant::now();
    let mut static_out: Vec<Vec<Sample>> = Vec::new();
    let (mut static_forwards, mut static_peak, mut static_unshared, mut static_pool) = (0, 0, 0, 0);
    for chunk in requests.chunks(rows / group) {
        let (out, stats) = generate_with_stats(&model, chunk, &params(EngineConfig::default()))?;
        static_forwards += stats.decode_forwards;
        static_peak = static_peak.max(stats.peak_kv_slots());
        static_unshared = static_unshared.max(stats.peak_kv_block_refs() * stats.kv_block_size);
        static_pool = static_pool.max(stats.kv_pool_blocks * stats.kv_block_size);
        static_out.extend(out);
    }
    let static_s = t0.elapsed().as_secs_f64();

    let engine = EngineConfig {
        max_running: rows,
        ..Default::default()
    };
    let t0 = Instant::now();
    let (cont_out, cont) = generate_with_stats(&model, &requests, &params(engine))?;
    let cont_s = t0.elapsed().as_secs_f64();
    // The same, within the static arm's peak KV memory.
    let budgeted = EngineConfig {
        kv_token_budget: static_peak,
        ..engine
    };
    let t0 = Instant::now();
    let (budget_out, budget) = generate_with_stats(&model, &requests, &params(budgeted))?;
    let budget_s = t0.elapsed().as_secs_f64();

    let lens: Vec<usize> = static_out
        .iter()
        .flatten()
        .map(|s| s.completion_ids.len())
        .collect();
    let tokens: usize = lens.iter().sum();
    let same_tokens = static_out
        .iter()
        .flatten()
        .zip(cont_out.iter().flatten())
        .zip(budget_out.iter().flatten())
        .all(|((a, b), c)| {
            a.completion_ids == b.completion_ids && a.completion_ids == c.completion_ids
        });
    println!(
        "random Qwen2 {:.1}M params, {prompts} prompts x {group} samples, max_new {max_new}, at most {rows} rows; completion lengths min {} mean {:.1} max {}; same tokens: {same_tokens}",
        model.num_parameters() as f64 / 1e6,
        lens.iter().min().unwrap_or(&0),
        tokens as f64 / lens.len().max(1) as f64,
        lens.iter().max().unwrap_or(&0),
    );
    println!(
        "{:<28} {:>9} {:>9} {:>8} {:>12} {:>14} {:>10}",
        "arm", "seconds", "tokens/s", "decodes", "peak KV held", "peak unshared", "pool slots"
    );
    let row =
        |arm: String, secs: f64, forwards: usize, held: usize, unshared: usize, pool: usize| {
            println!(
                "{arm:<28} {secs:>9.2} {:>9.0} {forwards:>8} {held:>12} {unshared:>14} {pool:>10}",
                tokens as f64 / secs
            )
        };
    let slots = |s: &EngineStats| {
        (
            s.peak_kv_slots(),
            s.peak_kv_block_refs() * s.kv_block_size,
            s.kv_pool_blocks * s.kv_block_size,
        )
    };
    row(
        format!("static batches of {rows}"),
        static_s,
        static_forwards,
        static_peak,
        static_unshared,
        static_pool,
    );
    let (h, u, p) = slots(&cont);
    row(
        format!("continuous, max_running {rows}"),
        cont_s,
        cont.decode_forwards,
        h,
        u,
        p,
    );
    let (h, u, p) = slots(&budget);
    row(
        format!("  + kv_token_budget {static_peak}"),
        budget_s,
        budget.decode_forwards,
        h,
        u,
        p,
    );
    // No limit: every sample in one batch from the start (the memory is the price).
    let t0 = Instant::now();
    let (one_out, one) = generate_with_stats(&model, &requests, &params(EngineConfig::default()))?;
    let one_s = t0.elapsed().as_secs_f64();
    ensure!(
        one_out
            .iter()
            .flatten()
            .zip(static_out.iter().flatten())
            .all(|(a, b)| a.completion_ids == b.completion_ids),
        "the unlimited batch sampled different tokens"
    );
    let (h, u, p) = slots(&one);
    row(
        format!("one batch of {}, no limit", prompts * group),
        one_s,
        one.decode_forwards,
        h,
        u,
        p,
    );
    Ok(())
}
