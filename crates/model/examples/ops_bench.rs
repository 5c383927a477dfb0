//! Two variants of the training step side by side in one run: median step time (forward +
//! backward of the trainer's step, see `bench::train_step`) and peak heap above the step's
//! start, per batch shape. `--compare`:
//! - `kernels` (default): the custom ops (`composer_model::ops`) against the candle
//!   compositions (`training_kernels`);
//! - `checkpointing`: the kernels with and without per-layer `gradient_checkpointing`;
//! - `padding_free`: rows of lengths T/8..T right-padded to T against the same rows packed
//!   without padding (`forward_hidden_packed`).
//!
//! Peak heap is counted by this program's global allocator (every byte candle allocates on
//! the CPU), reset before each measured step, so the two variants are measured apart within
//! one process. Timed steps alternate between the variants to share the machine's noise.
//!
//! `cargo run --release -p composer-model --example ops_bench [-- --iters N] [--compare WHAT]`

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use composer_model::bench::{bench_input, train_step};
use composer_model::{HeadOptions, PackedBatch, Transformer};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// The system allocator, counting live bytes and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are updated.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// What one variant runs: the padded step on `[b, t]` ids, or the packed step.
enum Step {
    Padded(Tensor),
    Packed(PackedBatch),
}

/// One training step of `step` (see `bench::train_step`; the packed one predicts every
/// packed token but each sequence's last).
fn run_step(model: &Transformer, step: &Step) -> Result<()> {
    match step {
        Step::Padded(input) => train_step(model, input),
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
            let loss = model
                .head_logprobs(&hidden, &targets, &HeadOptions::default())?
                .at_ids
                .to_dtype(DType::F32)?
                .mean_all()?
                .neg()?;
            let _grads = loss.backward()?;
            Ok(())
        }
    }
}

/// Peak heap (bytes) above the live heap at the start of one step.
fn measured_step(model: &Transformer, step: &Step) -> Result<usize> {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    run_step(model, step)?;
    Ok(PEAK.load(Ordering::Relaxed) - base)
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
        other => bail!("--compare: expected kernels, checkpointing or padding_free, got {other:?}"),
    })
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut iters, mut compare) = (5, "kernels".to_string());
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest
            .next()
            .ok_or_else(|| anyhow::anyhow!("usage: ops_bench [--iters N] [--compare WHAT]"))?;
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
            _ => bail!("usage: ops_bench [--iters N] [--compare WHAT]"),
        }
    }
    let threads = composer_model::configure_cpu_threads();
    let cfg = composer_model::bench::shape_model_config("h256-l4")?;
    let (mut model, _vars) = Transformer::random_init(&cfg, 0, &Device::Cpu)?;
    println!(
        "ops_bench --compare {compare}: {:.1}M params (hidden 256, 4 layers, 8/2 heads x 32, vocab 2048), f32, CPU, {threads} threads, median of {iters}",
        model.num_parameters() as f64 / 1e6
    );
    println!(
        "{:>10} {:>12} {:>14} {:>12} {:>16}",
        "batch", "variant", "step ms", "tokens/s", "peak heap MB"
    );
    for (b, t) in [(16, 128), (4, 512), (1, 2048)] {
        let vs = variants(&compare, b, t, cfg.vocab_size as u32)?;
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
