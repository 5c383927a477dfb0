//! `diloco-replica`: one DiLoCo replica training the toy MLP (composer_diloco::toy), for the
//! multi-process tests and manual runs. Prints `JOINED`, `PUBLISHED`, `ROUND {json}` and
//! `FINAL {json}` lines on stdout; warnings go to stderr.
//!
//! ```text
//! diloco-replica --store URL --replica-id 0 --replicas 3 --rounds 20 --inner-steps 5 \
//!   [--min-replicas 1] [--fragments 1] [--delay 0] [--alpha 0] [--compression f32|bf16|int8]
//!   [--outer-lr 0.7] [--outer-momentum 0.9] [--no-nesterov] [--batch 8] [--lr 0.05]
//!   [--quorum-timeout-s 60] [--retry-budget-s 90] [--retries N] [--backoff-s 0.2] [--poll-s 0.02] [--step-sleep-ms 0]
//!   [--seed 1]
//! diloco-replica --single --replicas 3 --rounds 20 --inner-steps 5 ...   # one process, same samples
//! diloco-replica --recipe RECIPE.toml --replica-id 0 [--store URL] [--run-dir D] [--steps N] [--resume]
//!     # the composer-train trainer as one replica (composer_diloco::run_replica)
//! ```

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use composer_diloco::toy::{self, Dataset};
use composer_diloco::{open_store, Compression, DilocoConfig, DilocoReplica, Phase};

struct Args {
    map: HashMap<String, String>,
    flags: Vec<String>,
}

impl Args {
    fn parse() -> Result<Self> {
        let mut map = HashMap::new();
        let mut flags = Vec::new();
        let mut it = std::env::args().skip(1);
        while let Some(a) = it.next() {
            let key = a
                .strip_prefix("--")
                .ok_or_else(|| anyhow!("unexpected argument {a:?}"))?
                .to_string();
            if key == "single" || key == "no-nesterov" || key == "resume" {
                flags.push(key);
            } else {
                let v = it.next().ok_or_else(|| anyhow!("--{key} needs a value"))?;
                map.insert(key, v);
            }
        }
        Ok(Self { map, flags })
    }
    fn get<T: std::str::FromStr>(&self, key: &str, default: Option<T>) -> Result<T>
    where
        T::Err: std::fmt::Display,
    {
        match self.map.get(key) {
            Some(v) => v.parse().map_err(|e| anyhow!("--{key} {v:?}: {e}")),
            None => default.ok_or_else(|| anyhow!("--{key} is required")),
        }
    }
    fn flag(&self, key: &str) -> bool {
        self.flags.iter().any(|f| f == key)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: logs captured to a file or pipe stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    match run().await {
        // A replica stopped by SIGINT / SIGTERM (checkpoint written) exits 130 / 143.
        Ok(()) => composer_train::signals::pending()
            .map_or(ExitCode::SUCCESS, |sig| ExitCode::from(sig.exit_code())),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<()> {
    let args = Args::parse()?;
    if let Some(recipe) = args.map.get("recipe") {
        // The real trainer (composer-train) as one replica: what `composer-rl train RECIPE
        // --diloco-replica-id I --diloco-store URL` runs.
        let opts = composer_diloco::ReplicaOptions {
            recipe_path: recipe.into(),
            replica_id: args.get("replica-id", None)?,
            store_url: args.map.get("store").cloned(),
            run_dir_override: args.map.get("run-dir").map(Into::into),
            max_steps_override: args.map.get("steps").map(|v| v.parse()).transpose()?,
            resume: args.flag("resume"),
            quiet: true,
        };
        let out = tokio::task::spawn_blocking(move || composer_diloco::run_replica(&opts))
            .await
            .map_err(|e| anyhow!("replica thread: {e}"))??;
        println!(
            "FINAL {}",
            serde_json::json!({
                "steps": out.steps_completed,
                "round": out.rounds,
                "final_accuracy": out.final_accuracy,
                "bytes_up": out.bytes_up,
                "bytes_down": out.bytes_down,
                "run_dir": out.run_dir,
                "interrupted": out.interrupted.map(|s| s.name()),
            })
        );
        return Ok(());
    }
    let replicas: usize = args.get("replicas", Some(1))?;
    let rounds: u64 = args.get("rounds", None)?;
    let inner_steps: usize = args.get("inner-steps", None)?;
    let batch: usize = args.get("batch", Some(8))?;
    let lr: f64 = args.get("lr", Some(0.05))?;
    let seed: u64 = args.get("seed", Some(1))?;
    let step_sleep = Duration::from_millis(args.get("step-sleep-ms", Some(0))?);
    // Shifts which training samples the run reads (same data set, init and schedule): the
    // tests measure the sample-order noise of the final loss with it.
    let data_offset: usize = args.get("data-offset", Some(0))?;
    let data = Dataset::new(seed, 4096, 512)?;
    let params = toy::init_params(seed)?;

    let mut config = DilocoConfig::new(inner_steps, replicas);
    config.min_replicas = args.get("min-replicas", Some(1))?;
    config.num_fragments = args.get("fragments", Some(1))?;
    config.fragment_sync_delay = args.get("delay", Some(0))?;
    config.fragment_update_alpha = args.get("alpha", Some(0.0))?;
    config.outer_lr = args.get("outer-lr", Some(0.7))?;
    config.outer_momentum = args.get("outer-momentum", Some(0.9))?;
    config.nesterov = !args.flag("no-nesterov");
    config.quorum_timeout_s = args.get("quorum-timeout-s", Some(60.0))?;
    config.store_retry_budget_s = args.get("retry-budget-s", Some(90.0))?;
    // Without --retries only the time budget bounds the retries.
    config.store_retries = match args.map.get("retries") {
        Some(_) => Some(args.get("retries", None)?),
        None => None,
    };
    config.store_backoff_s = args.get("backoff-s", Some(0.2))?;
    config.poll_interval_s = args.get("poll-s", Some(0.02))?;
    config.compression = match args
        .get::<String>("compression", Some("f32".into()))?
        .as_str()
    {
        "f32" => Compression::F32,
        "bf16" => Compression::Bf16,
        "int8" => Compression::Int8,
        other => bail!("--compression {other:?}: use f32, bf16 or int8"),
    };
    let period = config.round_period();

    // `--single`: the same DiLoCo run (same outer optimizer, H, rounds) as ONE replica whose
    // every inner step trains on the union of the replicas' minibatches at that step, through
    // an in-process store — the fair single-process reference: same samples, same number of
    // inner steps, same optimizers; only the split of each step's batch across replicas differs.
    let (store_url, replica_id, replica_index, replicas, batch) = if args.flag("single") {
        config.num_replicas = 1;
        config.min_replicas = 1;
        (
            "memory://".to_string(),
            "0".to_string(),
            0,
            1,
            replicas * batch,
        )
    } else {
        let store_url: String = args.get("store", None)?;
        let replica_id: String = args.get("replica-id", None)?;
        let replica_index: usize = replica_id
            .parse()
            .context("--replica-id must be a number for the toy data split")?;
        if replica_index >= replicas {
            bail!("--replica-id {replica_index} must be < --replicas {replicas}");
        }
        (store_url, replica_id, replica_index, replicas, batch)
    };

    let (store, prefix) = open_store(&store_url).await?;
    let mut replica = DilocoReplica::join(store, prefix, &replica_id, config, &params).await?;
    println!("JOINED round={}", replica.round());
    let mut samples = 0usize;
    while replica.round() < rounds {
        // The data step follows the run's round so a rejoining replica reads the run's samples.
        let step = replica.round() as usize * period + replica.local_step() + data_offset;
        let (x, y) = data.batch(step, replica_index, replicas, batch)?;
        toy::sgd_step(&params, &x, &y, lr)?;
        samples += batch;
        if !step_sleep.is_zero() {
            tokio::time::sleep(step_sleep).await;
        }
        let steps_done = replica.local_step() + 1;
        let phase = replica.phase_after(steps_done);
        // Count the step: after_inner_step's bookkeeping, done by hand to print between phases.
        if let Phase::Publish(_) | Phase::PublishAndApply(_) = phase {
            let r = replica.round();
            replica.publish(&params).await?;
            println!("PUBLISHED round={r}");
        }
        match phase {
            Phase::Apply(_) | Phase::PublishAndApply(_) => {
                let report = replica.apply(&params).await?;
                println!("ROUND {}", serde_json::to_string(&report)?);
            }
            _ => replica.count_step(),
        }
    }
    let eval = toy::eval_loss(&params, &data)?;
    println!(
        "FINAL {}",
        serde_json::json!({
            "eval_loss": eval,
            "round": replica.round(),
            "samples": samples,
            "bytes_up": replica.bytes_up_total(),
            "bytes_down": replica.bytes_down_total(),
        })
    );
    Ok(())
}
