//! Two variants of the training step side by side in one run: median step time (forward +
//! backward of the trainer's step, see `bench::train_step`) and peak heap above the step's
//! start, per batch shape. `--compare`:
//! - `kernels` (default): the custom ops (`composer_model::ops`) against the candle
//!   compositions (`training_kernels`);
//! - `checkpointing`: the kernels with and without per-layer `gradient_checkpointing`;
//! - `padding_free`: rows of lengths T/8..T right-padded to T against the same rows packed
//!   without padding (`forward_hidden_packed`);
//! - `head`: the LM head alone (`head_logprobs_with` on `batch × T` random hidden states:
//!   target log-prob and entropy, forward and backward), its softmax algebra in candle
//!   compositions against the fused row kernels (`ops::head_row_stats`/`head_logits_grad`).
//!
//! Peak heap is counted by this program's global allocator (every byte candle allocates on
//! the CPU), reset before each measured step, so the two variants are measured apart within
//! one process. Timed steps alternate between the variants to share the machine's noise.
//!
//! `--shape NAME` picks the random model (`bench::shape_model_config`; default `h256-l4`,
//! vocab 2048; `qwen-vocab` has Qwen's 151,936-token vocabulary, where the LM head dominates).
//!
//! `cargo run --release -p composer-model --example ops_bench [-- --iters N] [--compare WHAT] [--shape NAME]`

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use composer_model::bench::alloc_counter::{peak_during, CountingAllocator};
use composer_model::bench::{bench_input, next_token_nll, train_step};
use composer_model::{HeadOptions, PackedBatch, Transformer};
use std::time::Instant;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// What one variant runs: the padded step on `[b, t]` ids, the packed step, or the LM head
/// alone on `[N, hidden]` states with `[N, 1]` targets (fused softmax kernels or not).
enum Step {
    Padded(Tensor),
    Packed(PackedBatch),
    Head {
        hidden: candle_core::Var,
        targets: Tensor,
        fused: bool,
    },
}

/// One training step of `step` (see `bench::train_step`; the packed one predicts every
/// packed token but each sequence's last).
fn run_step(model: &Transformer, step: &Step) -> Result<()> {
    match step {
        Step::Padded(input) => train_step(model, input),
        Step::Head {
            hidden,
            targets,
            fused,
        } => {
            let out = composer_model::head_logprobs_with(
                hidden.as_tensor(),
                &model.lm_head,
                targets,
                &HeadOptions::default(),
                *fused,
            )?;
            let loss = (out.at_ids.mean_all()? - out.entropy.mean_all()?)?;
            let _grads = loss.backward()?;
            Ok(())
        }
        Step::Packed(batch) => {
            let hidden = model.forward_hidden_packed(batch)?;
            let (mut rows, mut targets) = (Vec::new(), Vec::new());
            for w in batch.cu_seqlens.windows(2) {
                for i in w[0]..w[1].saturating_sub(1) {
                    rows.push(i as u32);
                    targets.push(batch.ids[i + 1]);
                }
            }
            let n = rows.len();
            let hidden = hidden.index_select(&Tensor::from_vec(rows, n, &Device::Cpu)?, 0)?;
            let targets = Tensor::from_vec(targets, (n, 1), &Device::Cpu)?;
            let _grads = next_token_nll(model, &hidden, &targets)?.backward()?;
            Ok(())
        }
    }
}

/// Peak heap (bytes) above the live heap at the start of one step.
fn measured_step(model: &Transformer, step: &Step) -> Result<usize> {
    let (ran, peak) = peak_during(|| run_step(model, step));
    ran.map(|()| peak)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The two variants of a comparison on a `[b, t]` batch: names, model settings
/// (`training_kernels`, `gradient_checkpointing`) and steps.
fn variants(
    compare: &str,
    b: usize,
    t: usize,
    vocab: u32,
    hidden_size: usize,
) -> Result<[(&'static str, bool, bool, Step); 2]> {
    let padded = || bench_input(b, t, vocab, &Device::Cpu).map(Step::Padded);
    Ok(match compare {
        "kernels" => [
            ("composed", false, false, padded()?),
            ("kernels", true, false, padded()?),
        ],
        "checkpointing" => [
            ("kernels", true, false, padded()?),
            ("checkpointed", true, true, padded()?),
        ],
        "padding_free" => {
            // Row r keeps its first t/8 + (r·7 mod 8)·t/8 tokens: lengths spread over t/8..t.
            let full: Vec<Vec<u32>> = bench_input(b, t, vocab, &Device::Cpu)?.to_vec2()?;
            let rows: Vec<Vec<u32>> = full
                .iter()
                .enumerate()
                .map(|(r, row)| row[..t / 8 + (r * 7 % 8) * t / 8].to_vec())
                .collect();
            let mut ids = vec![0u32; b * t];
            for (r, row) in rows.iter().enumerate() {
                ids[r * t..r * t + row.len()].copy_from_slice(row);
            }
            let padded = Tensor::from_vec(ids, (b, t), &Device::Cpu)?;
            [
                ("padded", true, false, Step::Padded(padded)),
                (
                    "packed",
                    true,
                    false,
                    Step::Packed(PackedBatch::from_sequences(&rows)),
                ),
            ]
        }
        "head" => {
            let (n, h) = (b * t, hidden_size);
            let targets = bench_input(b, t, vocab, &Device::Cpu)?.reshape((n, 1))?;
            let head = |fused| -> Result<Step> {
                let hidden = Tensor::randn(0f32, 1.0, (n, h), &Device::Cpu)?;
                Ok(Step::Head {
                    hidden: candle_core::Var::from_tensor(&hidden)?,
                    targets: targets.clone(),
                    fused,
                })
            };
            [
                ("composed", true, false, head(false)?),
                ("fused", true, false, head(true)?),
            ]
        }
        other => {
            bail!("--compare: expected kernels, checkpointing, padding_free or head, got {other:?}")
        }
    })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut iters, mut compare, mut shape) = (5, "kernels".to_string(), "h256-l4".to_string());
    let usage = "usage: ops_bench [--iters N] [--compare WHAT] [--shape NAME]";
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or_else(|| anyhow::anyhow!("{usage}"))?;
        match flag.as_str() {
            "--iters" => {
                iters = value
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| {
                        anyhow::anyhow!("--iters: expected a positive integer, got {value:?}")
                    })?
            }
            "--compare" => compare = value.clone(),
            "--shape" => shape = value.clone(),
            _ => bail!("{usage}"),
        }
    }
    let threads = composer_model::configure_cpu_threads();
    let cfg = composer_model::bench::shape_model_config(&shape)?;
    let (mut model, _vars) = Transformer::random_init(&cfg, 0, &Device::Cpu)?;
    println!(
        "ops_bench --compare {compare} --shape {shape}: {:.1}M params (hidden {}, {} layers, {}/{} heads, vocab {}), f32, CPU, {threads} threads, median of {iters}",
        model.num_parameters() as f64 / 1e6,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
    );
    println!(
        "{:>10} {:>12} {:>14} {:>12} {:>16}",
        "batch", "variant", "step ms", "tokens/s", "peak heap MB"
    );
    for (b, t) in [(16, 128), (4, 512), (1, 2048)] {
        if t > cfg.max_position_embeddings && compare != "head" {
            println!(
                "{:>10} skipped: longer than the shape's {} positions",
                format!("{b}x{t}"),
                cfg.max_position_embeddings
            );
            continue;
        }
        let vs = variants(&compare, b, t, cfg.vocab_size as u32, cfg.hidden_size)?;
        let mut peaks = [0usize; 2];
        let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for (i, (_, kernels, ckpt, step)) in vs.iter().enumerate() {
            model.training_kernels = *kernels;
            model.gradient_checkpointing = *ckpt;
            peaks[i] = measured_step(&model, step)?; // also the warm-up
        }
        for _ in 0..iters {
            for (i, (_, kernels, ckpt, step)) in vs.iter().enumerate() {
                model.training_kernels = *kernels;
                model.gradient_checkpointing = *ckpt;
                let start = Instant::now();
                run_step(&model, step)?;
                times[i].push(start.elapsed().as_secs_f64());
            }
        }
        for (i, (name, ..)) in vs.iter().enumerate() {
            let s = median(times[i].clone());
            println!(
                "{:>10} {:>12} {:>14.1} {:>12.0} {:>16.1}",
                format!("{b}x{t}"),
                name,
                s * 1e3,
                (b * t) as f64 / s,
                peaks[i] as f64 / 1e6
            );
        }
    }
    Ok(())
}
