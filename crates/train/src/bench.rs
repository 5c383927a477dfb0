//! `composer-rl bench channels`: RLVR alone vs RLVR + hint vs RLVR + hint + replay on the
//! embedded default task, same seeds; samples (completions generated) needed to reach the
//! target greedy accuracy. The arms and the channel weights are options, so the same program
//! sweeps α or β.

use std::path::PathBuf;

use anyhow::Result;
use composer_telemetry::keys;

use crate::recipe::EMBEDDED_DEFAULT_RECIPE;
use crate::trainer::{run_train, TrainOptions};

/// Benchmark knobs.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Seeds (each arm runs every seed).
    pub seeds: Vec<u64>,
    /// Target greedy accuracy.
    pub target: f64,
    /// Step budget per run.
    pub max_steps: usize,
    /// Where runs are written (one sub-directory per arm and seed).
    pub out_dir: PathBuf,
    /// Which arms run: `rlvr`, `hint` (RLVR + hint), `hint+replay` (all three channels).
    pub arms: Vec<String>,
    /// The hint channel's weight α in the arms that have it.
    pub hint_weight: f64,
    /// The replay channel's weight β in the arm that has it.
    pub replay_weight: f64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            seeds: vec![0, 1, 2],
            target: 0.9,
            max_steps: 150,
            out_dir: PathBuf::from("runs/bench-channels"),
            arms: ["rlvr", "hint", "hint+replay"].map(String::from).to_vec(),
            hint_weight: 1.0,
            replay_weight: 0.5,
        }
    }
}

/// One arm's result on one seed.
#[derive(Debug, Clone)]
pub struct BenchRow {
    /// Arm name.
    pub arm: String,
    /// Hint weight α of the arm.
    pub hint_weight: f64,
    /// Replay weight β of the arm.
    pub replay_weight: f64,
    /// Seed.
    pub seed: u64,
    /// Accuracy after warm-up.
    pub warmup_accuracy: Option<f64>,
    /// (step, samples, seconds) at the target, if reached.
    pub reached: Option<(usize, u64, f64)>,
    /// Last accuracy.
    pub final_accuracy: Option<f64>,
}

/// Runs the selected arms on every seed and returns the rows and their markdown table (also
/// printed by the CLI).
pub fn bench_channels(opts: &BenchOptions) -> Result<(Vec<BenchRow>, String)> {
    let (a, b) = (opts.hint_weight, opts.replay_weight);
    let arms = opts
        .arms
        .iter()
        .map(|arm| match arm.as_str() {
            "rlvr" => Ok(("RLVR", 0.0, 0.0)),
            "hint" => Ok(("RLVR + hint", a, 0.0)),
            "hint+replay" => Ok(("RLVR + hint + replay", a, b)),
            other => anyhow::bail!(
                "bench channels: unknown arm {other:?} (known: rlvr, hint, hint+replay)"
            ),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut rows = Vec::new();
    for (name, alpha, beta) in arms {
        for &seed in &opts.seeds {
            let text = arm_recipe(alpha, beta, seed, opts);
            let stem = format!(
                "{}-a{alpha}-b{beta}-seed{seed}",
                name.replace(" + ", "-").to_lowercase()
            );
            let dir = opts.out_dir.join(&stem);
            let recipe_path = opts.out_dir.join(format!("{stem}.toml"));
            std::fs::create_dir_all(&opts.out_dir)?;
            std::fs::write(&recipe_path, text)?;
            let out = run_train(&TrainOptions {
                recipe_path: Some(recipe_path),
                resume: None,
                quiet: true,
                run_dir_override: Some(dir),
                max_steps_override: None,
                // A benchmark re-run replaces its arms' earlier runs.
                overwrite: true,
            })?;
            rows.push(BenchRow {
                arm: name.into(),
                hint_weight: alpha,
                replay_weight: beta,
                seed,
                warmup_accuracy: out.warmup_accuracy,
                reached: out.reached_target,
                final_accuracy: out.final_accuracy,
            });
        }
    }
    Ok((rows.clone(), table(&rows, opts)))
}

fn arm_recipe(alpha: f64, beta: f64, seed: u64, opts: &BenchOptions) -> String {
    recipe_with(
        &[
            ("[loss]", "hint_weight", format!("hint_weight = {alpha:?}")),
            (
                "[loss]",
                "replay_weight",
                format!("replay_weight = {beta:?}"),
            ),
            ("[train]", "seed", format!("seed = {seed}")),
        ]
        .into_iter()
        .chain(until_target(opts.max_steps, opts.target))
        .collect::<Vec<_>>(),
    )
}

/// Overrides shared by the benchmarks: stop at `target` accuracy (or `max_steps`), eval every
/// 5 steps, no intermediate checkpoints.
fn until_target(max_steps: usize, target: f64) -> [(&'static str, &'static str, String); 3] {
    [
        (
            "[train]",
            "steps",
            format!("steps = {max_steps}\nstop_at_accuracy = {target:?}"),
        ),
        ("[train]", "eval_every", "eval_every = 5".to_string()),
        (
            "[train]",
            "checkpoint_every",
            "checkpoint_every = 0".to_string(),
        ),
    ]
}

/// The embedded default recipe with the lines `(section, key)` replaced by the given text.
fn recipe_with(overrides: &[(&str, &str, String)]) -> String {
    let mut out = String::new();
    let mut section = String::new();
    for line in EMBEDDED_DEFAULT_RECIPE.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            section = t.to_string();
        }
        let key = t.split('=').next().unwrap_or("").trim();
        let replaced = overrides
            .iter()
            .find(|(sec, k, _)| *sec == section && *k == key)
            .map(|(_, _, text)| text.clone())
            .unwrap_or_else(|| line.to_string());
        out.push_str(&replaced);
        out.push('\n');
    }
    out
}

/// `composer-rl bench async` knobs.
#[derive(Debug, Clone)]
pub struct AsyncBenchOptions {
    /// Seed of every run.
    pub seed: u64,
    /// Seconds added to every sample's verification: the deliberately slow environment.
    pub reward_latency_s: f64,
    /// Staleness bounds of the async arms.
    pub max_staleness: Vec<u64>,
    /// Target greedy accuracy.
    pub target: f64,
    /// Step budget per run.
    pub max_steps: usize,
    /// Where runs are written.
    pub out_dir: PathBuf,
}

/// Sync vs async (each staleness bound) on the embedded default with a slow verifier: wall
/// time and samples to the target accuracy. Returns the markdown table.
pub fn bench_async(opts: &AsyncBenchOptions) -> Result<String> {
    let mut arms: Vec<(String, String)> = vec![("sync".into(), "mode = \"sync\"".into())];
    for k in &opts.max_staleness {
        arms.push((
            format!("async, max_staleness {k}"),
            format!("mode = \"async\"\nmax_staleness = {k}"),
        ));
    }
    let mut s = format!(
        "added verifier latency {:.1} ms per sample, seed {}\n\n| layout | steps to {:.0}% | samples | seconds to {:.0}% | mean step s | mean staleness | dropped | final acc |\n|---|---|---|---|---|---|---|---|\n",
        opts.reward_latency_s * 1e3,
        opts.seed,
        opts.target * 100.0,
        opts.target * 100.0
    );
    std::fs::create_dir_all(&opts.out_dir)?;
    for (i, (name, mode_lines)) in arms.iter().enumerate() {
        let text = recipe_with(
            &[(
                "[train]",
                "seed",
                format!(
                    "seed = {}\n{mode_lines}\nreward_latency_s = {:?}",
                    opts.seed, opts.reward_latency_s
                ),
            )]
            .into_iter()
            .chain(until_target(opts.max_steps, opts.target))
            .collect::<Vec<_>>(),
        );
        let recipe_path = opts.out_dir.join(format!("arm{i}.toml"));
        std::fs::write(&recipe_path, text)?;
        let run_dir = opts.out_dir.join(format!("arm{i}"));
        let out = run_train(&TrainOptions {
            recipe_path: Some(recipe_path),
            resume: None,
            quiet: true,
            run_dir_override: Some(run_dir.clone()),
            max_steps_override: None,
            overwrite: true,
        })?;
        let lines = composer_telemetry::read_metrics(&run_dir.join("metrics.jsonl"))?;
        let train: Vec<_> = lines
            .iter()
            .filter(|l| l.get(keys::KIND).and_then(|k| k.as_str()) == Some(keys::KIND_TRAIN))
            .collect();
        let mean_of = |key: &str| {
            let v: Vec<f64> = train
                .iter()
                .filter_map(|l| l.get(key).and_then(|x| x.as_f64()))
                .collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        };
        let dropped: f64 = train
            .iter()
            .filter_map(|l| l.get(keys::STALENESS_DROPPED).and_then(|x| x.as_f64()))
            .sum();
        let (steps, samples, secs) = match out.reached_target {
            Some((a, b, c)) => (a.to_string(), b.to_string(), format!("{c:.1}")),
            None => (
                format!("> {}", opts.max_steps),
                "-".into(),
                "not reached".into(),
            ),
        };
        s.push_str(&format!(
            "| {name} | {steps} | {samples} | {secs} | {:.2} | {:.2} | {dropped:.0} | {} |\n",
            mean_of(keys::TIME_STEP),
            mean_of(keys::STALENESS_MEAN),
            out.final_accuracy
                .map(|a| format!("{:.1}%", a * 100.0))
                .unwrap_or_else(|| "-".into())
        ));
    }
    Ok(s)
}

fn table(rows: &[BenchRow], opts: &BenchOptions) -> String {
    let mut s = format!(
        "| arm | α | β | seed | warm-up acc | steps to {:.0}% | samples to {:.0}% | seconds | final acc |\n|---|---|---|---|---|---|---|---|---|\n",
        opts.target * 100.0,
        opts.target * 100.0
    );
    let pct = |x: Option<f64>| {
        x.map(|a| format!("{:.1}%", a * 100.0))
            .unwrap_or_else(|| "-".into())
    };
    for r in rows {
        let (st, sm, sec) = match r.reached {
            Some((a, b, c)) => (a.to_string(), b.to_string(), format!("{c:.0}")),
            None => (
                format!("> {}", opts.max_steps),
                "not reached".into(),
                "-".into(),
            ),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {st} | {sm} | {sec} | {} |\n",
            r.arm,
            r.hint_weight,
            r.replay_weight,
            r.seed,
            pct(r.warmup_accuracy),
            pct(r.final_accuracy)
        ));
    }
    s
}
