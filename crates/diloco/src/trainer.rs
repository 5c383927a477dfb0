//! One DiLoCo replica running the normal composer-train trainer (`composer-rl train RECIPE
//! --diloco-replica-id I --diloco-store URL`).
//!
//! The recipe is the ordinary trainer recipe plus a `[diloco]` table ([`DilocoConfig`] fields
//! and `store`), which this module parses and removes before handing the rest to
//! composer-train. Each replica runs composer-train's public step functions
//! (`rollout_batch` → `reward_batch` → advantages → `train_on_batch` → `publish_weights`) on
//! the model's VarMap parameters and calls [`DilocoReplica::after_inner_step`] after every
//! step, so every H / F steps the weights become the round's outer-updated global weights.
//!
//! Data split: replica `i` of `R` rolls out the prompts of sample stream `(step − 1)·R + i + 1`,
//! so the R replicas together see what one process doing R× the steps would see, and no two
//! replicas train on the same draws. The supervised warm-up (fresh runs) runs in every replica
//! before it joins and is not synchronised: it is deterministic per seed, and the first
//! replica's warmed-up weights become the run's initial global weights (the others adopt them).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Var;
use composer_loss::compute_advantages;
use composer_telemetry::{keys, MetricsWriter, StepSnapshot, TrainProgress};
use composer_train::trainer::{
    evaluate, open_session, publish_weights, reward_batch, rollout_batch, save, train_on_batch,
    warmup, Session, TrainOptions,
};
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
}

/// Splits recipe text into the `[diloco]` section and the rest (for composer-train).
/// `origin` names the file in errors.
pub fn split_recipe(text: &str, origin: &Path) -> Result<(DilocoConfig, String)> {
    let mut table: toml::Table =
        toml::from_str(text).with_context(|| format!("recipe {}", origin.display()))?;
    let section = table
        .remove("diloco")
        .ok_or_else(|| anyhow!("recipe {}: no [diloco] section", origin.display()))?;
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

/// `RUN_DIR/diloco-state.safetensors`: the outer state saved with every trainer checkpoint.
pub fn state_path(run_dir: &Path) -> PathBuf {
    run_dir.join("diloco-state.safetensors")
}

/// Runs one replica to the end of `[train] steps` (see the module docs).
pub fn run_replica(opts: &ReplicaOptions) -> Result<ReplicaOutcome> {
    let started = Instant::now();
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
    let replicas = config.num_replicas;
    let run_dir = match &opts.run_dir_override {
        Some(d) => d.clone(),
        None => {
            let recipe = composer_train::recipe::parse_recipe(&trainer_text, &opts.recipe_path)?;
            recipe
                .output
                .run_dir
                .join(format!("replica-{}", opts.replica_id))
        }
    };
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("creating run dir {}", run_dir.display()))?;
    // composer-train reads recipes from files; hand it the recipe without [diloco].
    let trainer_recipe = run_dir.join("recipe.trainer.toml");
    std::fs::write(&trainer_recipe, &trainer_text)
        .with_context(|| format!("writing {}", trainer_recipe.display()))?;
    let mut s = open_session(&TrainOptions {
        recipe_path: Some(trainer_recipe),
        resume: opts.resume.then(|| run_dir.clone()),
        quiet: opts.quiet,
        run_dir_override: Some(run_dir.clone()),
        max_steps_override: opts.max_steps_override,
    })?;
    std::fs::write(run_dir.join("recipe.toml"), &text)
        .with_context(|| format!("writing {}", run_dir.join("recipe.toml").display()))?;
    let metrics_path = run_dir.join("metrics.jsonl");
    let mut metrics = if opts.resume {
        MetricsWriter::open_resume(&metrics_path, s.state.step as u64)?
    } else {
        MetricsWriter::create(&metrics_path)?
    };

    if s.state.step == 0 && !opts.resume {
        if let Some(w) = s.recipe.warmup.clone() {
            let loss = warmup(&mut s, &w)?;
            let acc = evaluate(&s)?;
            s.state.warmup_accuracy = Some(acc);
            metrics.write(&json!({(keys::STEP): 0, (keys::KIND): keys::KIND_EVAL, (keys::EVAL_ACCURACY): acc, (keys::POLICY_VERSION): 0, (keys::WARMUP_LOSS): loss}))?;
        }
    }

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the DiLoCo runtime")?;
    let vars = model_vars(&s)?;
    let period = config.round_period();
    let mut diloco = rt.block_on(async {
        let (store, prefix) = open_store(&store_url).await?;
        DilocoReplica::join(store, prefix, &opts.replica_id.to_string(), config, &vars).await
    })?;
    if opts.resume && state_path(&run_dir).exists() {
        rt.block_on(diloco.load_state(&state_path(&run_dir), &vars))?;
    }
    // The vars now hold the global weights at the start of round `diloco.round()`, so the
    // replica continues at that round's first step: a replica (re)joining a run in progress
    // skips ahead to the run's position, and one resumed from a mid-round checkpoint redoes
    // the round's steps from the global weights (keeping every replica's rounds aligned).
    s.state.step = diloco.round() as usize * period;
    let total_steps = s.recipe.train.steps;
    let mut progress = TrainProgress::new(total_steps as u64, opts.quiet);
    progress.resume_from(s.state.step as u64);
    progress.println(format!(
        "diloco replica {}: joined at round {} (step {}), store {store_url}",
        opts.replica_id,
        diloco.round(),
        s.state.step
    ));
    // Last round's summary for the progress line: round, quorum, bytes moved so far.
    let mut round_note = String::from("diloco: no round yet");
    let mut final_accuracy = None;
    while s.state.step < total_steps {
        let step = s.state.step + 1;
        let t_step = Instant::now();
        let batch = rollout_batch(&s, (step - 1) * replicas + opts.replica_id + 1)?;
        let rewards = reward_batch(&s, &batch);
        let lengths: Vec<usize> = batch
            .samples
            .iter()
            .map(|x| x.completion_ids.len())
            .collect();
        // Per-verifier rewards times their weights (what run_train passes to the advantages).
        let weighted: Vec<Vec<f64>> = rewards
            .per_func
            .iter()
            .map(|r| {
                r.iter()
                    .zip(&s.reward.parts)
                    .map(|(x, (_, w))| x * w)
                    .collect()
            })
            .collect();
        let g = s.recipe.rollout.num_generations;
        let advantages = compute_advantages(&s.recipe.loss.advantage, &weighted, &lengths, g)
            .context("computing advantages")?;
        let stats = train_on_batch(&mut s, step, &batch, &rewards, &advantages, false)?;
        publish_weights(&mut s, &stats);
        s.state.step = step;
        s.state.samples_generated += batch.samples.len() as u64;
        let n = rewards.total.len().max(1) as f64;
        metrics.write(&json!({
            (keys::STEP): step,
            (keys::KIND): keys::KIND_TRAIN,
            (keys::POLICY_VERSION): s.state.policy_version,
            (keys::REWARD_MEAN): rewards.total.iter().sum::<f64>() / n,
            (keys::LOSS_RLVR): stats.loss_rlvr,
            (keys::GRAD_NORM): stats.grad_norm,
            (keys::LR): stats.lr,
            (keys::SAMPLES): s.state.samples_generated,
            (keys::TIME_STEP): t_step.elapsed().as_secs_f64(),
            (keys::DILOCO_REPLICA): opts.replica_id,
        }))?;

        if let Some(report) = rt.block_on(diloco.after_inner_step(&vars))? {
            metrics.write(&json!({
                (keys::STEP): step,
                (keys::KIND): keys::KIND_DILOCO,
                (keys::DILOCO_ROUND): report.round,
                (keys::DILOCO_FRAGMENT): report.fragment,
                (keys::DILOCO_REPLICAS): report.replicas_in_quorum,
                (keys::DILOCO_BYTES): report.bytes_up + report.bytes_down,
                (keys::DILOCO_BYTES_UP): report.bytes_up,
                (keys::DILOCO_BYTES_DOWN): report.bytes_down,
                (keys::DILOCO_REJECTED): report.rejected_keys,
                (keys::TIME_OUTER_SYNC): report.outer_sync_s,
            }))?;
            round_note = format!(
                "diloco r{} f{} quorum {}/{} {:.1} MB{}",
                report.round,
                report.fragment,
                report.replicas_in_quorum,
                replicas,
                (diloco.bytes_up_total() + diloco.bytes_down_total()) as f64 / 1e6,
                if report.caught_up { " (caught up)" } else { "" }
            );
        }

        let every = s.recipe.train.eval_every;
        let mut eval_acc = None;
        if (every > 0 && step % every == 0) || step == total_steps {
            let acc = evaluate(&s)?;
            final_accuracy = Some(acc);
            eval_acc = Some(acc);
            metrics.write(&json!({(keys::STEP): step, (keys::KIND): keys::KIND_EVAL, (keys::POLICY_VERSION): s.state.policy_version, (keys::EVAL_ACCURACY): acc, (keys::SAMPLES): s.state.samples_generated}))?;
        }
        progress.update(&StepSnapshot {
            step: step as u64,
            reward_mean: rewards.total.iter().sum::<f64>() / n,
            eval_accuracy: eval_acc,
            tokens_per_s: 0.0,
            extra: Some(round_note.clone()),
        });
        let ck = s.recipe.train.checkpoint_every;
        if (ck > 0 && step % ck == 0) || step == total_steps {
            save(&s)?;
            diloco.save_state(&state_path(&run_dir))?;
        }
    }
    progress.finish(format!(
        "diloco replica {}: {} steps, {} rounds, final accuracy {:?}, {:.1} MB moved",
        opts.replica_id,
        s.state.step,
        diloco.round(),
        final_accuracy,
        (diloco.bytes_up_total() + diloco.bytes_down_total()) as f64 / 1e6
    ));
    Ok(ReplicaOutcome {
        run_dir,
        steps_completed: s.state.step,
        rounds: diloco.round(),
        final_accuracy,
        bytes_up: diloco.bytes_up_total(),
        bytes_down: diloco.bytes_down_total(),
        wall_s: started.elapsed().as_secs_f64(),
    })
}
