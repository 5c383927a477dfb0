//! `cargo run --release -p composer-train --example channel_bench -- [SEEDS] [MAX_STEPS]`:
//! RLVR alone vs + hint vs + hint + replay on the embedded default task, same seeds; prints the
//! markdown table of samples needed to reach 90% greedy accuracy.

use composer_train::{bench_channels, BenchOptions};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut opts = BenchOptions::default();
    if let Some(n) = args.first().and_then(|s| s.parse::<u64>().ok()) {
        opts.seeds = (0..n).collect();
    }
    if let Some(m) = args.get(1).and_then(|s| s.parse().ok()) {
        opts.max_steps = m;
    }
    let t0 = std::time::Instant::now();
    let (_, table) = bench_channels(&opts)?;
    println!("{table}");
    println!("total wall time {:.0}s", t0.elapsed().as_secs_f64());
    Ok(())
}
