//! Writes a synthetic 120-step run (every metric key, async staleness, evals every 10 steps)
//! into the directory given as the first argument and renders its report, for eyeballing the
//! HTML (see tools/render_report_check.sh).
//!
//! `cargo run -p composer-telemetry --example synthetic_report -- /tmp/synthetic-run`

use std::path::PathBuf;

use anyhow::{Context, Result};
use composer_telemetry::{write_report, MetricsWriter, RunSummary};
use serde_json::json;

/// Deterministic pseudo-noise in [-1, 1] (no rand dependency needed for a picture).
fn noise(i: u64, salt: u64) -> f64 {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    (x % 20_001) as f64 / 10_000.0 - 1.0
}

fn main() -> Result<()> {
    let dir: PathBuf = std::env::args()
        .nth(1)
        .context("usage: synthetic_report RUN_DIR")?
        .into();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut w = MetricsWriter::create(&dir.join("metrics.jsonl"))?;
    // `trained_tokens` is a running total, as the trainer writes it.
    let mut trained_tokens = 0u64;
    for step in 1..=120u64 {
        let s = step as f64;
        let lengths: Vec<u64> = (0..16)
            .map(|k| (300.0 + 40.0 * s.sqrt() + 250.0 * (noise(step, k) + 1.0).powi(3)) as u64)
            .collect();
        let mean_len = lengths.iter().sum::<u64>() as f64 / lengths.len() as f64;
        let rollout = 4.0 + mean_len / 400.0 + 0.5 * noise(step, 99);
        trained_tokens += (16.0 * (mean_len + 200.0)) as u64;
        w.write(&json!({
            "kind": "train", "step": step, "policy_version": step,
            "reward/mean": 0.15 + 0.6 * (1.0 - (-s / 40.0).exp()) + 0.04 * noise(step, 1),
            "reward/std": 0.25 - 0.001 * s,
            "completions/mean_length": mean_len,
            "completions/clipped_ratio": 0.03,
            "completions/lengths": lengths,
            "loss/rlvr": 0.4 * (-s / 60.0).exp() + 0.02 * noise(step, 2),
            "loss/hint": 0.2 * (-s / 80.0).exp(),
            "loss/replay": 0.1,
            "kl": 0.002 * s.sqrt() + 0.0005 * noise(step, 3),
            "entropy": 1.2 - 0.004 * s + 0.02 * noise(step, 4),
            "clip_ratio/low": 0.01, "clip_ratio/high": 0.02,
            "grad_norm": 0.8, "lr": 1e-6,
            "time/rollout_s": rollout, "time/reward_s": 1.2 + 0.3 * noise(step, 5),
            "time/train_s": 2.5, "time/sync_s": 0.4,
            "time/step_s": rollout + 1.2 + 2.5 + 0.4,
            "tokens_per_s": 16.0 * mean_len / rollout,
            "trained_tokens": trained_tokens,
            "env/latency_s": [0.3 + 0.2 * noise(step, 6), 0.5, 1.9],
            "staleness/values": [0, 1, 1, step % 3],
            "staleness/max": step % 3, "staleness/mean": 0.8, "staleness/dropped": u64::from(step % 17 == 0),
            "idle/generator_s": 0.3, "idle/trainer_s": 1.1, "idle/rewarder_s": 2.0,
        }))?;
        if step % 10 == 0 {
            w.write(&json!({"kind": "eval", "step": step,
                "eval/accuracy": 0.2 + 0.5 * (1.0 - (-s / 50.0).exp())}))?;
        }
    }
    std::fs::write(
        dir.join("recipe.toml"),
        "# synthetic recipe <with> \"markup\" & such\n[model]\npath = \"Qwen/Qwen2.5-0.5B-Instruct\"\n\n[loss]\nrlvr = \"dapo\"\nhint_alpha = 0.5\nreplay_beta = 0.1\n",
    )?;
    let out = write_report(&dir)?;
    let records = composer_telemetry::read_metrics(&dir.join("metrics.jsonl"))?;
    println!("{}", RunSummary::from_metrics(&records));
    println!("wrote {}", out.display());
    Ok(())
}
