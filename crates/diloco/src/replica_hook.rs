//! One DiLoCo replica running the normal composer-train trainer (`composer-rl train RECIPE
//! --diloco-replica-id I --diloco-store URL`).
//!
//! The recipe is the ordinary trainer recipe plus a `[diloco]` table ([`DilocoConfig`] fields
//! and `store`), which this module parses and removes before handing the rest to
//! composer-train. Each replica runs composer-train's own step loop
//! ([`composer_train::run_train_with`]: the same NaN/Inf guard, walls, metrics, eval,
//! checkpoints and SIGINT/SIGTERM handling as `composer-rl train`) with a [`StepHook`] that
//! joins the store before the first step, calls [`DilocoReplica::after_inner_step`] after every
//! step (so every H / F steps the weights become the round's outer-updated global weights) and
//! saves the outer state with every checkpoint.
//!
//! Data split: replica `i` of `R` rolls out the prompts of sample stream `(step − 1)·R + i + 1`,
//! so the R replicas together see what one process doing R× the steps would see, and no two
//! replicas train on the same draws. The supervised warm-up (fresh runs) runs in every replica
//! before it joins and is not synchronised: it is deterministic per seed, and the first
//! replica's warmed-up weights become the run's initial global weights (the others adopt them).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Var;
use composer_telemetry::metric_keys::KIND_DILOCO;
use composer_telemetry::{keys, TrainProgress};
use composer_train::recipe::TrainMode;
use composer_train::trainer::{Session, StepExtras, StepHook, TrainOptions};
use composer_train::{run_train_with, Interrupt};
use serde_json::json;

use crate::config::DilocoConfig;
use crate::replica::DilocoReplica;
use crate::store::open_store;

/// How to run one replica.
#[derive(Debug, Clone, Default)]
pub struct ReplicaOptions {
    /// The recipe file (with a `[diloco]` table).
    pub recipe_path: PathBuf,
    /// Replica index, `0..[diloco] num_replicas`; also the data split and the store id.
    pub replica_id: usize,
    /// Store URL; overrides `[diloco] store`.
    pub store_url: Option<String>,
    /// Run directory; default `[output] run_dir` + `/replica-{id}`.
    pub run_dir_override: Option<PathBuf>,
    /// Overrides `[train] steps`.
    pub max_steps_override: Option<usize>,
    /// Continue this replica's run from its last checkpoint and DiLoCo state.
    pub resume: bool,
    /// Log lines instead of a progress bar (the trainer's option).
    pub quiet: bool,
}

/// What a finished replica reports.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaOutcome {
    /// This replica's run directory.
    pub run_dir: PathBuf,
    /// Last completed inner (RL) step.
    pub steps_completed: usize,
    /// Next DiLoCo round (= rounds applied, counting rounds adopted on rejoin).
    pub rounds: u64,
    /// Eval accuracy after the last step.
    pub final_accuracy: Option<f64>,
    /// Bytes this replica uploaded to the store.
    pub bytes_up: u64,
    /// Bytes this replica downloaded from the store.
    pub bytes_down: u64,
    /// Wall-clock seconds.
    pub wall_s: f64,
    /// Stopped by this signal (a checkpoint and the DiLoCo state were written).
    pub interrupted: Option<Interrupt>,
}

/// Splits recipe text into the `[diloco]` section and the rest (for composer-train).
/// `origin` names the file in errors.
pub fn split_recipe(text: &str, origin: &Path) -> Result<(DilocoConfig, String)> {
    let mut table: toml::Table =
        toml::from_str(text).with_context(|| format!("recipe {}", origin.display()))?;
    let section = table
        .remove("diloco")
        .ok_or_else(|| anyhow!("recipe {}: no [diloco] section", origin.display()))?;
    // The full recipe's rule, here too (the replica's trainer never sees `[diloco]`): `[train]
    // steps` a multiple of `inner_steps`, or the replica runs no round.
    if let (Some(d), Some(steps)) = (
        section.as_table(),
        table
            .get("train")
            .and_then(|t| t.get("steps"))
            .and_then(toml::Value::as_integer)
            .and_then(|n| usize::try_from(n).ok()),
    ) {
        composer_train::recipe::validate_diloco_steps(d, steps, origin)?;
    }
    let config: DilocoConfig = section
        .try_into()
        .map_err(|e| anyhow!("recipe {}: [diloco]: {e}", origin.display()))?;
    config
        .validate()
        .with_context(|| format!("recipe {}", origin.display()))?;
    let rest = toml::to_string(&table)
        .with_context(|| format!("recipe {}: re-serialising", origin.display()))?;
    Ok((config, rest))
}

/// The model's parameters as (name, Var), sharing storage with the trainer's VarMap.
fn model_vars(s: &Session) -> Result<Vec<(String, Var)>> {
    let data = s
        .model
        .varmap
        .data()
        .lock()
        .map_err(|_| anyhow!("varmap lock poisoned"))?;
    let mut vars: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(vars)
}

/// The outer state's file inside every trainer checkpoint (written atomically with it, so a
/// resumed replica's weights, optimizer and outer state always belong to the same step).
pub const STATE_FILE: &str = "diloco-state.safetensors";

/// The outer state of the run's last complete checkpoint, if it has one.
pub fn state_path(run_dir: &Path) -> Option<PathBuf> {
    let checkpoint = composer_train::checkpoint::find_checkpoint(run_dir).ok()?;
    Some(checkpoint.join(STATE_FILE)).filter(|p| p.is_file())
}

/// The DiLoCo side of a replica, around composer-train's step loop.
struct ReplicaHook {
    /// The full recipe text (with `[diloco]`), written as the run's `recipe.toml`.
    recipe_text: String,
    config: DilocoConfig,
    store_url: String,
    replica_id: usize,
    resume: bool,
    run_dir: PathBuf,
    rt: tokio::runtime::Runtime,
    /// Set by `before_loop`.
    joined: Option<(DilocoReplica, Vec<(String, Var)>)>,
    /// Last round's summary for the progress line: round, quorum, bytes moved so far.
    round_note: String,
}

impl ReplicaHook {
    fn joined(&mut self) -> Result<&mut (DilocoReplica, Vec<(String, Var)>)> {
        self.joined
            .as_mut()
            .ok_or_else(|| anyhow!("diloco replica: the step loop ran before joining the store"))
    }
}

impl StepHook for ReplicaHook {
    fn before_loop(&mut self, s: &mut Session, progress: &TrainProgress) -> Result<()> {
        let recipe_file = self.run_dir.join("recipe.toml");
        std::fs::write(&recipe_file, &self.recipe_text)
            .with_context(|| format!("writing {}", recipe_file.display()))?;
        let vars = model_vars(s)?;
        let state = state_path(&self.run_dir).filter(|_| self.resume);
        // Joining writes the store's newest global weights into `vars`; a resumed replica
        // continues from its checkpoint's own weights instead (load_state decides whether
        // it is so far behind that it must jump to the store's newest round).
        let checkpoint_weights = match &state {
            Some(_) => Some(
                vars.iter()
                    .map(|(_, v)| v.as_tensor().copy())
                    .collect::<candle_core::Result<Vec<_>>>()?,
            ),
            None => None,
        };
        let (store_url, id, config) = (&self.store_url, self.replica_id, self.config.clone());
        let mut diloco = self.rt.block_on(async {
            let (store, prefix) = open_store(store_url).await?;
            DilocoReplica::join(store, prefix, &id.to_string(), config, &vars).await
        })?;
        if let (Some(state), Some(weights)) = (state, checkpoint_weights) {
            for ((_, var), w) in vars.iter().zip(weights) {
                var.set(&w)?;
            }
            self.rt.block_on(diloco.load_state(&state, &vars))?;
        }
        // With `[train] bf16` the forward reads a bf16 copy of the masters just written.
        s.model.refresh_compute()?;
        // The vars now hold the global weights at the start of round `diloco.round()`, so the
        // replica continues at that round's first step: a replica (re)joining a run in
        // progress skips ahead to the run's position, and one resumed from a mid-round
        // checkpoint redoes the round's steps from the global weights (keeping every
        // replica's rounds aligned).
        s.state.step = diloco.round() as usize * self.config.round_period();
        progress.println(format!(
            "diloco replica {}: joined at round {} (step {}), store {}",
            self.replica_id,
            diloco.round(),
            s.state.step,
            self.store_url
        ));
        self.joined = Some((diloco, vars));
        Ok(())
    }

    /// Replica `i` of `R` draws the prompts of sample stream `(step − 1)·R + i + 1`.
    fn sample_stream(&self, step: usize) -> usize {
        (step - 1) * self.config.num_replicas + self.replica_id + 1
    }

    fn after_step(&mut self, s: &mut Session, step: usize) -> Result<StepExtras> {
        let replicas = self.config.num_replicas;
        let rt = &self.rt;
        let (diloco, vars) = self
            .joined
            .as_mut()
            .ok_or_else(|| anyhow!("diloco replica: the step loop ran before joining the store"))?;
        let mut extras = StepExtras::default();
        extras
            .keys
            .insert(keys::DILOCO_REPLICA.into(), json!(self.replica_id));
        let report = rt.block_on(diloco.after_inner_step(vars))?;
        // An outer step rewrote the masters: the bf16 compute copy (`[train] bf16`) follows.
        s.model.refresh_compute()?;
        if let Some(report) = report {
            let line: serde_json::Map<String, serde_json::Value> = [
                (keys::STEP, json!(step)),
                (keys::KIND, json!(KIND_DILOCO)),
                (keys::DILOCO_ROUND, json!(report.round)),
                (keys::DILOCO_FRAGMENT, json!(report.fragment)),
                (keys::DILOCO_REPLICAS, json!(report.replicas_in_quorum)),
                (
                    keys::DILOCO_BYTES,
                    json!(report.bytes_up + report.bytes_down),
                ),
                (keys::DILOCO_BYTES_UP, json!(report.bytes_up)),
                (keys::DILOCO_BYTES_DOWN, json!(report.bytes_down)),
                (keys::DILOCO_REJECTED, json!(report.rejected_keys)),
                (keys::TIME_OUTER_SYNC, json!(report.outer_sync_s)),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            extras.lines.push(serde_json::Value::Object(line));
            self.round_note = format!(
                "diloco r{} f{} quorum {}/{} {:.1} MB{}",
                report.round,
                report.fragment,
                report.replicas_in_quorum,
                replicas,
                (diloco.bytes_up_total() + diloco.bytes_down_total()) as f64 / 1e6,
                if report.caught_up { " (caught up)" } else { "" }
            );
        }
        Ok(extras)
    }

    fn checkpoint_files(&mut self, _s: &Session) -> Result<Vec<(String, Vec<u8>)>> {
        Ok(vec![(
            STATE_FILE.to_string(),
            self.joined()?.0.state_bytes()?,
        )])
    }

    fn note(&self) -> Option<String> {
        Some(self.round_note.clone())
    }

    fn allows_early_stop(&self) -> bool {
        false
    }
}

/// Runs one replica to the end of `[train] steps` (see the module docs).
pub fn run_replica(opts: &ReplicaOptions) -> Result<ReplicaOutcome> {
    let text = std::fs::read_to_string(&opts.recipe_path)
        .with_context(|| format!("reading recipe {}", opts.recipe_path.display()))?;
    let (config, trainer_text) = split_recipe(&text, &opts.recipe_path)?;
    let store_url = opts
        .store_url
        .clone()
        .or_else(|| config.store.clone())
        .ok_or_else(|| {
            anyhow!(
                "recipe {}: no store: set [diloco] store or pass --diloco-store",
                opts.recipe_path.display()
            )
        })?;
    if opts.replica_id >= config.num_replicas {
        bail!(
            "--diloco-replica-id {} must be < [diloco] num_replicas {}",
            opts.replica_id,
            config.num_replicas
        );
    }
    let recipe = composer_train::recipe::parse_recipe(&trainer_text, &opts.recipe_path)?;
    if recipe.train.mode == TrainMode::Async {
        bail!(
            "recipe {}: a DiLoCo replica runs [train] mode = \"sync\" (its outer step needs \
             the inner steps in order)",
            opts.recipe_path.display()
        );
    }
    let run_dir = match &opts.run_dir_override {
        Some(d) => d.clone(),
        None => recipe
            .output
            .run_dir
            .join(format!("replica-{}", opts.replica_id)),
    };
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("creating run dir {}", run_dir.display()))?;
    // composer-train reads recipes from files; hand it the recipe without [diloco].
    let trainer_recipe = run_dir.join("recipe.trainer.toml");
    std::fs::write(&trainer_recipe, &trainer_text)
        .with_context(|| format!("writing {}", trainer_recipe.display()))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the DiLoCo runtime")?;
    let mut hook = ReplicaHook {
        recipe_text: text,
        config,
        store_url,
        replica_id: opts.replica_id,
        resume: opts.resume,
        run_dir: run_dir.clone(),
        rt,
        joined: None,
        round_note: String::from("diloco: no round yet"),
    };
    let outcome = run_train_with(
        &TrainOptions {
            recipe_path: Some(trainer_recipe),
            resume: opts.resume.then(|| run_dir.clone()),
            quiet: opts.quiet,
            run_dir_override: Some(run_dir.clone()),
            max_steps_override: opts.max_steps_override,
            overwrite: false,
        },
        &mut hook,
    )?;
    let (rounds, bytes_up, bytes_down) = match &hook.joined {
        Some((d, _)) => (d.round(), d.bytes_up_total(), d.bytes_down_total()),
        None => (0, 0, 0),
    };
    Ok(ReplicaOutcome {
        run_dir,
        steps_completed: outcome.steps_completed,
        rounds,
        final_accuracy: outcome.final_accuracy,
        bytes_up,
        bytes_down,
        wall_s: outcome.wall_s,
        interrupted: outcome.interrupted,
    })
}
