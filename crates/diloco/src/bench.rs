//! DiLoCo communication benchmark (issue 7 §6): bytes moved per trained sample and wall time to
//! reach a matched held-out loss, for H ∈ {1, 10, 50} with and without streaming and with the
//! f32 / bf16 / int8 codecs, through a local folder store. Three replicas run as tasks of one
//! multi-threaded runtime on the toy MLP ([`crate::toy`]), each with its own shard of every
//! step's union batch.
//!
//! "bytes/sample" counts every object byte uploaded and downloaded by all replicas
//! (pseudo-gradients, closed.json, global weights) until replica 0's global weights first
//! reach the target loss (the run's total scaled by the fraction of steps taken), divided by
//! the samples trained by all replicas until then. Wall time is until the target is reached.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;

use crate::toy::{self, Dataset, IN};
use crate::{open_store, Compression, DilocoConfig, DilocoReplica};

/// Benchmark settings.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Held-out MSE that counts as "matched loss".
    pub target: f32,
    /// Inner steps per replica at most.
    pub max_steps: usize,
    /// The student MLP's hidden width ([`toy::HIDDEN`] = 161 parameters; wider students make
    /// the exchanged bytes those of the weights rather than of object headers).
    pub student_hidden: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            target: 0.03,
            max_steps: 3000,
            student_hidden: toy::HIDDEN,
        }
    }
}

const REPLICAS: usize = 3;
const BATCH: usize = 8;
const LR: f64 = 0.05;

struct Setup {
    name: &'static str,
    h: usize,
    fragments: usize,
    delay: usize,
    outer_lr: f64,
    momentum: f64,
    compression: Compression,
}

struct Outcome {
    reached: bool,
    steps: usize,
    rounds: u64,
    bytes: u64,
    wall_s: f64,
    loss: f32,
}

async fn run(setup: &Setup, target: f32, max_steps: usize, hidden: usize) -> Result<Outcome> {
    let dir = std::env::temp_dir().join(format!(
        "composer-diloco-bench-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
    ));
    let url = format!("file://{}", dir.display());
    let data = Arc::new(Dataset::new(11, 4096, 512)?);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for id in 0..REPLICAS {
        let mut c = DilocoConfig::new(setup.h, REPLICAS);
        c.num_fragments = setup.fragments;
        c.fragment_sync_delay = setup.delay;
        c.outer_lr = setup.outer_lr;
        c.outer_momentum = setup.momentum;
        c.nesterov = setup.momentum > 0.0;
        c.compression = setup.compression;
        c.poll_interval_s = 0.0005;
        let url = url.clone();
        let data = data.clone();
        tasks.push(tokio::spawn(async move {
            let params = toy::init_student(11, hidden)?;
            let (store, prefix) = open_store(&url).await?;
            let mut r = DilocoReplica::join(store, prefix, &id.to_string(), c, &params).await?;
            let mut reached_at = None;
            let mut loss = f32::NAN;
            let mut step = 0;
            while step < max_steps {
                let (x, y) = data.batch(step, id, REPLICAS, BATCH)?;
                toy::sgd_step(&params, &x, &y, LR)?;
                step += 1;
                if r.after_inner_step(&params).await?.is_some() && id == 0 {
                    // After a full cycle of fragments the vars equal the global weights (α = 0).
                    if r.round() % setup_fragments(&r) == 0 {
                        loss = toy::eval_loss(&params, &data)?;
                        if loss <= target && reached_at.is_none() {
                            reached_at = Some((step, r.round(), start.elapsed().as_secs_f64()));
                        }
                    }
                }
                // Stop all replicas at the same step: replica 0 decides via max_steps only, so
                // every replica runs the same number of steps (rounds must stay matched).
            }
            anyhow::Ok((reached_at, loss, r.bytes_up_total() + r.bytes_down_total()))
        }));
    }
    let mut bytes = 0;
    let mut first = None;
    let mut loss = f32::NAN;
    for (i, t) in tasks.into_iter().enumerate() {
        let (reached, l, b) = t.await??;
        bytes += b;
        if i == 0 {
            first = reached;
            loss = l;
        }
    }
    let total_wall = start.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    let (steps, rounds, wall_s) = first.unwrap_or((max_steps, 0, total_wall));
    // Bytes until the target: scale the run's total by the fraction of steps taken.
    let bytes_to_target = (bytes as f64 * steps as f64 / max_steps as f64) as u64;
    Ok(Outcome {
        reached: first.is_some(),
        steps,
        rounds,
        bytes: bytes_to_target,
        wall_s,
        loss,
    })
}

fn setup_fragments(r: &DilocoReplica) -> u64 {
    r.config().num_fragments as u64
}

/// Runs every configuration and returns the markdown table (with a one-line header).
pub fn run_benchmark(opts: &BenchOptions) -> Result<String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(REPLICAS)
        .enable_all()
        .build()?;
    rt.block_on(run_all(opts))
}

impl Setup {
    /// DiLoCo with the outer optimizer of torchft's example (lr 0.7, Nesterov momentum 0.9),
    /// one fragment, f32 deltas.
    fn diloco(name: &'static str, h: usize) -> Setup {
        Setup {
            name,
            h,
            fragments: 1,
            delay: 0,
            outer_lr: 0.7,
            momentum: 0.9,
            compression: Compression::F32,
        }
    }

    /// Syncing every step: H = 1 with outer lr 1 and no momentum is plain data parallelism.
    fn every_step(name: &'static str) -> Setup {
        Setup {
            outer_lr: 1.0,
            momentum: 0.0,
            ..Setup::diloco(name, 1)
        }
    }

    /// Streaming: `fragments` fragments synced with a delay of `delay` inner steps.
    fn streaming(self, fragments: usize, delay: usize) -> Setup {
        Setup {
            fragments,
            delay,
            ..self
        }
    }

    fn compressed(self, compression: Compression) -> Setup {
        Setup {
            compression,
            ..self
        }
    }
}

async fn run_all(opts: &BenchOptions) -> Result<String> {
    use std::fmt::Write;
    let (target, max_steps, hidden) = (opts.target, opts.max_steps, opts.student_hidden);
    let setups = [
        Setup::every_step("sync every step (H=1, outer lr 1, μ 0 ≡ data parallel)"),
        Setup::diloco("DiLoCo H=1", 1),
        Setup::diloco("DiLoCo H=10", 10),
        Setup::diloco("DiLoCo H=50", 50),
        Setup::diloco("DiLoCo H=50, bf16 deltas", 50).compressed(Compression::Bf16),
        Setup::diloco("DiLoCo H=50, int8 deltas", 50).compressed(Compression::Int8),
        Setup::diloco("streaming H=10, F=2, τ=1", 10).streaming(2, 1),
        Setup::diloco("streaming H=50, F=2, τ=5", 50).streaming(2, 5),
        Setup::diloco("streaming H=50, F=2, τ=5, bf16", 50)
            .streaming(2, 5)
            .compressed(Compression::Bf16),
    ];
    let mut out = String::new();
    let params = IN * hidden + 2 * hidden + 1;
    writeln!(out, "3 replicas × batch {BATCH}, inner SGD lr {LR}, toy MLP 8 → {hidden} → 1 ({params} params), local folder store; target held-out MSE ≤ {target}, at most {max_steps} inner steps\n")?;
    writeln!(out, "| config | reached | inner steps | rounds | samples | bytes moved | bytes/sample | wall s | final MSE |")?;
    writeln!(out, "|---|---|---|---|---|---|---|---|---|")?;
    for s in &setups {
        let o = run(s, target, max_steps, hidden).await?;
        let samples = o.steps * REPLICAS * BATCH;
        writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {:.1} | {:.2} | {:.4} |",
            s.name,
            if o.reached { "yes" } else { "no" },
            o.steps,
            o.rounds,
            samples,
            o.bytes,
            o.bytes as f64 / samples as f64,
            o.wall_s,
            o.loss
        )?;
    }
    Ok(out)
}
