//! The optimizer step side by side in one run: `ops::adamw_update` (two in-place passes per
//! parameter) against the same AdamW as a composition of candle tensor ops (the trainer's
//! update before the op: ~15 passes and fresh buffers per parameter), over every parameter of
//! a random model, with random gradients. Median wall time of the whole step and peak heap
//! above its start; the timed steps alternate between the two.
//!
//! `cargo run --release -p composer-model --example adamw_bench [-- --iters N] [--shape NAME]`

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};
use composer_model::bench::alloc_counter::{peak_during, CountingAllocator};
use composer_model::ops::{adamw_update, AdamWStep};
use composer_model::Transformer;
use std::time::Instant;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The baseline: AdamW from tensor ops, returning the new (m, v).
fn composed(
    p: &Var,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    h: &AdamWStep,
) -> Result<(Tensor, Tensor)> {
    let [b1, b2] = h.betas;
    let t = h.step as i32;
    let m = ((m * b1)? + (g * (1.0 - b1))?)?;
    let v = ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
    let theta = (p.as_tensor() * (1.0 - h.lr * h.weight_decay))?;
    let denom = ((&v / (1.0 - b2.powi(t)))?.sqrt()? + h.eps)?;
    let upd = ((&m / (1.0 - b1.powi(t)))? / denom)?;
    p.set(&(theta - (upd * h.lr)?)?)?;
    Ok((m, v))
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut iters, mut shape) = (5usize, "h256-l4".to_string());
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest
            .next()
            .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))?;
        match flag.as_str() {
            "--iters" => {
                iters = value
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| anyhow::anyhow!("--iters: a positive integer"))?
            }
            "--shape" => shape = value.clone(),
            _ => bail!("usage: adamw_bench [--iters N] [--shape NAME]"),
        }
    }
    let threads = composer_model::configure_cpu_threads();
    let cfg = composer_model::bench::shape_model_config(&shape)?;
    let (model, vars) = Transformer::random_init(&cfg, 0, &Device::Cpu)?;
    let vars: Vec<Var> = vars.all_vars();
    let grads: Vec<Tensor> = vars
        .iter()
        .map(|v| v.as_tensor().randn_like(0.0, 1e-2))
        .collect::<candle_core::Result<_>>()?;
    let moments: Vec<Tensor> = vars
        .iter()
        .map(|v| {
            let mut shape = vec![2];
            shape.extend_from_slice(v.dims());
            Tensor::zeros(shape, DType::F32, &Device::Cpu)
        })
        .collect::<candle_core::Result<_>>()?;
    let mut mv: Vec<(Tensor, Tensor)> = vars
        .iter()
        .map(|v| Ok((v.as_tensor().zeros_like()?, v.as_tensor().zeros_like()?)))
        .collect::<Result<_>>()?;
    println!(
        "adamw_bench --shape {shape}: {:.1}M params in {} tensors, f32, CPU, {threads} threads, median of {iters}",
        model.num_parameters() as f64 / 1e6,
        vars.len()
    );
    let (mut fused_s, mut composed_s) = (Vec::new(), Vec::new());
    let (mut fused_heap, mut composed_heap) = (0usize, 0usize);
    for step in 1..=iters as u64 {
        let h = AdamWStep {
            lr: 1e-3,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            step,
        };
        let t0 = Instant::now();
        let (r, peak) = peak_during(|| -> Result<()> {
            for ((v, m), g) in vars.iter().zip(&moments).zip(&grads) {
                adamw_update(v.as_tensor(), m, g, &h)?;
            }
            Ok(())
        });
        r?;
        fused_s.push(t0.elapsed().as_secs_f64());
        fused_heap = fused_heap.max(peak);
        let t0 = Instant::now();
        let (r, peak) = peak_during(|| -> Result<()> {
            for ((v, (m, vv)), g) in vars.iter().zip(mv.iter_mut()).zip(&grads) {
                *(m) = {
                    let (nm, nv) = composed(v, m, vv, g, &h)?;
                    *vv = nv;
                    nm
                };
            }
            Ok(())
        });
        r?;
        composed_s.push(t0.elapsed().as_secs_f64());
        composed_heap = composed_heap.max(peak);
    }
    let (f, c) = (median(fused_s), median(composed_s));
    println!("{:>12} {:>10} {:>16}", "variant", "step ms", "peak heap MB");
    println!(
        "{:>12} {:>10.1} {:>16.1}",
        "ops::adamw",
        f * 1e3,
        fused_heap as f64 / 1e6
    );
    println!(
        "{:>12} {:>10.1} {:>16.1}",
        "composed",
        c * 1e3,
        composed_heap as f64 / 1e6
    );
    println!("ratio ops::adamw / composed: time {:.2}", f / c);
    Ok(())
}
