//! Training step of the custom ops (`composer_model::ops`) against the candle compositions,
//! side by side in one run: median step time (forward + backward of the trainer's step, see
//! `bench::train_step`) and peak heap above the step's start, per batch shape.
//!
//! Peak heap is counted by this program's global allocator (every byte candle allocates on
//! the CPU), reset before each measured step, so the two variants are measured apart within
//! one process. Timed steps alternate between the variants to share the machine's noise.
//!
//! `cargo run --release -p composer-model --example ops_bench [-- --iters N]`

use anyhow::{bail, Result};
use candle_core::Device;
use composer_model::bench::{bench_input, train_step};
use composer_model::{ModelConfig, Transformer};
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

/// Peak heap (bytes) above the live heap at the start of one step.
fn measured_step(model: &Transformer, input: &candle_core::Tensor) -> Result<usize> {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    train_step(model, input)?;
    Ok(PEAK.load(Ordering::Relaxed) - base)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let iters = match args.as_slice() {
        [] => 5,
        [flag, n] if flag == "--iters" => n
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| anyhow::anyhow!("--iters: expected a positive integer, got {n:?}"))?,
        _ => bail!("usage: ops_bench [--iters N]"),
    };
    let threads = composer_model::configure_cpu_threads();
    let mut cfg = ModelConfig::tiny_qwen2(2048);
    cfg.hidden_size = 256;
    cfg.intermediate_size = 768;
    cfg.num_hidden_layers = 4;
    cfg.num_attention_heads = 8;
    cfg.num_key_value_heads = 2;
    cfg.head_dim = 32;
    cfg.max_position_embeddings = 2048;
    let (mut model, _vars) = Transformer::random_init(&cfg, 0, &Device::Cpu)?;
    println!(
        "ops_bench: {:.1}M params (hidden 256, 4 layers, 8/2 heads x 32, vocab 2048), f32, CPU, {threads} threads, median of {iters}",
        model.num_parameters() as f64 / 1e6
    );
    println!(
        "{:>10} {:>12} {:>14} {:>12} {:>16}",
        "batch", "variant", "step ms", "tokens/s", "peak heap MB"
    );
    for (b, t) in [(16, 128), (4, 512), (1, 2048)] {
        let input = bench_input(b, t, cfg.vocab_size as u32, &Device::Cpu)?;
        let variants = [("composed", false), ("kernels", true)];
        let mut peaks = [0usize; 2];
        let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for (i, &(_, on)) in variants.iter().enumerate() {
            model.training_kernels = on;
            peaks[i] = measured_step(&model, &input)?; // also the warm-up
        }
        for _ in 0..iters {
            for (i, &(_, on)) in variants.iter().enumerate() {
                model.training_kernels = on;
                let start = Instant::now();
                train_step(&model, &input)?;
                times[i].push(start.elapsed().as_secs_f64());
            }
        }
        for (i, &(name, _)) in variants.iter().enumerate() {
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
