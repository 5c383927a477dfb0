//! The training loop. [`run_train`] reads top to bottom: set up (recipe, data, tokenizer,
//! model, traces, optimizer, resume), supervised warm-up, then per step
//! [`rollout_batch`] → [`reward_batch`] → advantages → [`train_on_batch`] (μ passes of
//! mini-batch updates) → [`publish_weights`] → eval → metrics → checkpoint.
//!
//! Every random draw is ChaCha8 seeded by `mix_seed(seed, step, index)`, so a run is a pure
//! function of (recipe, seed) and a resumed run continues bit-identically.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, D};
use composer_loss::hint::{build_hint_prompts, RolloutForHint};
use composer_loss::{compute_advantages, hint_loss, rlvr_loss, HintInputs, LossInputs, LossScale};
use composer_telemetry::{MetricsWriter, StepSnapshot, TrainProgress};
use serde_json::json;
use tokenizers::Tokenizer;

use crate::checkpoint::{self, CheckpointData, TrainerState};
use crate::data::{self, PromptRow, SftRow};
use crate::optim::{self, AdamW, AdamWParams};
use crate::policy::{self, mix_seed, scalar, Sample, SamplingParams};
use crate::recipe::{self, Recipe, TrainMode};
use crate::replay::{self, TeacherTrace};
use crate::task;
use crate::tiny::TinyModel;
use crate::tokenizer as chartok;
use crate::verifiers::RewardFn;
use composer_actors::record::StepWalls;

/// Test hook: comma-separated RL steps whose loss is replaced by NaN.
pub const NAN_HOOK_ENV: &str = "COMPOSER_TRAIN_INJECT_NAN_STEPS";

/// Test hook: comma-separated RL steps at whose end the process raises a real SIGINT
/// (exercises the Ctrl-C path: checkpoint, clean shutdown of every actor).
pub const SIGINT_HOOK_ENV: &str = "COMPOSER_TRAIN_SIGINT_AT_STEPS";

/// Test hook (async mode): the rewarder fails on this scored batch (1-based), to exercise
/// shutdown on an actor's error.
pub const REWARD_ERROR_HOOK_ENV: &str = "COMPOSER_TRAIN_INJECT_REWARD_ERROR_AT_BATCH";

fn hook_steps(var: &str) -> Vec<usize> {
    std::env::var(var)
        .unwrap_or_default()
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .collect()
}

/// How `composer-rl train` was invoked.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Recipe file; `None` = the embedded default.
    pub recipe_path: Option<PathBuf>,
    /// Continue the run in this directory from its last checkpoint.
    pub resume: Option<PathBuf>,
    /// Log lines instead of a progress bar.
    pub quiet: bool,
    /// Overrides `[output] run_dir`.
    pub run_dir_override: Option<PathBuf>,
    /// Overrides `[train] steps`.
    pub max_steps_override: Option<usize>,
}

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutcome {
    /// The run directory.
    pub run_dir: PathBuf,
    /// Last completed RL step.
    pub steps_completed: usize,
    /// Greedy accuracy after the warm-up (before RL), if measured.
    pub warmup_accuracy: Option<f64>,
    /// Last eval accuracy.
    pub final_accuracy: Option<f64>,
    /// First eval (step, completions generated, seconds since start) at or above
    /// `[train] stop_at_accuracy` (or 0.9 when that is 0).
    pub reached_target: Option<(usize, u64, f64)>,
    /// Completions generated in RL.
    pub samples_generated: u64,
    /// Steps skipped for non-finite loss or gradients.
    pub skipped_steps: usize,
    /// Wall-clock seconds of this invocation.
    pub wall_s: f64,
    /// Stopped by Ctrl-C (a checkpoint was written).
    pub interrupted: bool,
}

pub(crate) static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn install_sigint_handler() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_sigint),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    let _ = unsafe { sigaction(Signal::SIGINT, &action) };
}

/// Everything the loop works on.
pub struct Session {
    /// The recipe.
    pub recipe: Recipe,
    /// Its text (written to RUN_DIR/recipe.toml and into checkpoints).
    pub recipe_text: String,
    /// Run directory.
    pub run_dir: PathBuf,
    /// Tokenizer.
    pub tok: Tokenizer,
    /// EOS id (also the padding id).
    pub eos: u32,
    /// The policy.
    pub model: TinyModel,
    /// RL optimizer.
    pub opt: AdamW,
    /// Training prompts.
    pub train_rows: Vec<PromptRow>,
    /// Held-out prompts.
    pub eval_rows: Vec<PromptRow>,
    /// Reward.
    pub reward: RewardFn,
    /// Teacher traces and each one's teacher weight.
    pub traces: Vec<(TeacherTrace, f64)>,
    /// Indices of passing traces, by prompt token ids.
    pub traces_by_prompt: HashMap<Vec<u32>, Vec<usize>>,
    /// Resumable counters.
    pub state: TrainerState,
    /// `[env]` rollouts (an env pool), when the recipe has an `[env]` section.
    pub env_rollout: Option<crate::env_rollout::EnvRollout>,
}

/// One step's rollouts.
pub struct RolloutBatch {
    /// The step's prompts (indices into `train_rows`), one group each.
    pub prompts: Vec<usize>,
    /// `prompts.len() × num_generations` samples, grouped.
    pub samples: Vec<Sample>,
    /// Decoded completion texts.
    pub texts: Vec<String>,
}

/// One step's rewards.
pub struct Rewards {
    /// Total reward per sample.
    pub total: Vec<f64>,
    /// Per verifier, per sample (`[sample][verifier]`).
    pub per_func: Vec<Vec<f64>>,
    /// Whether each sample reached the maximal reward.
    pub passed: Vec<bool>,
    /// Seconds spent scoring each sample.
    pub latency_s: Vec<f64>,
}

/// What one `train_on_batch` did.
#[derive(Debug, Default, Clone)]
pub struct TrainStats {
    /// Mean RLVR loss over micro-batches.
    pub loss_rlvr: f64,
    /// Mean hint loss.
    pub loss_hint: f64,
    /// Mean replay loss (DPO + token KL, weighted).
    pub loss_replay: f64,
    /// Mean DPO part.
    pub loss_dpo: f64,
    /// Mean token-KL part.
    pub loss_teacher_kl: f64,
    /// Mismatch KL (k3, trainer vs sampler) / RLVR's KL.
    pub kl: f64,
    /// Mean token entropy.
    pub entropy: f64,
    /// Clip fractions.
    pub clip_low: f64,
    /// Clip fractions.
    pub clip_high: f64,
    /// Last pre-clip gradient norm.
    pub grad_norm: f64,
    /// Last learning rate.
    pub lr: f64,
    /// Optimizer steps taken.
    pub updates: usize,
    /// A non-finite loss or gradient made this step skip its updates.
    pub non_finite: bool,
    /// Samples that received a hint.
    pub hinted: usize,
    /// DPO pairs.
    pub dpo_pairs: usize,
}

/// Load or build everything; on `resume`, restore weights, optimizer and counters.
pub fn open_session(opts: &TrainOptions) -> Result<Session> {
    // A resumed run's recipe is the one in its checkpoint; its optimizer state is read on
    // the CPU and moved to the recipe's device below.
    let mut resume_ckpt = match &opts.resume {
        Some(dir) => Some(checkpoint::load_checkpoint(
            &checkpoint::find_checkpoint(dir)?,
            &candle_core::Device::Cpu,
        )?),
        None => None,
    };
    let (recipe_text, origin) = match (&resume_ckpt, &opts.recipe_path) {
        (Some(c), _) => (c.recipe_text.clone(), c.dir.join("recipe.toml")),
        (None, Some(p)) => (
            std::fs::read_to_string(p)
                .with_context(|| format!("reading recipe {}", p.display()))?,
            p.clone(),
        ),
        (None, None) => (
            recipe::EMBEDDED_DEFAULT_RECIPE.to_string(),
            PathBuf::from("<embedded default recipe>"),
        ),
    };
    let mut recipe = recipe::parse_recipe(&recipe_text, &origin)?;
    if let Some(s) = opts.max_steps_override {
        recipe.train.steps = s;
    }
    let device = composer_model::device_from_str(&recipe.model.device)
        .with_context(|| format!("key `[model] device` = {:?}", recipe.model.device))?;
    if let Some(c) = resume_ckpt.as_mut() {
        if !device.is_cpu() {
            for t in c.optimizer.values_mut() {
                *t = t.to_device(&device)?;
            }
        }
    }
    let run_dir = match (&opts.resume, &opts.run_dir_override) {
        (Some(d), _) => d.clone(),
        (None, Some(d)) => d.clone(),
        (None, None) => recipe.output.run_dir.clone(),
    };
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("creating run dir {}", run_dir.display()))?;
    let seed = recipe.train.seed;

    // Data.
    let (train_rows, eval_rows) = match (&recipe.data.task, &recipe.data.dataset) {
        (Some(_), _) => {
            task::arithmetic_split(&recipe.data.arithmetic, recipe.data.eval_size, seed)
        }
        (None, Some(path)) => {
            let rows = data::load_prompts(path, &data::render_chatml)?;
            match &recipe.data.eval_dataset {
                Some(e) => (rows, data::load_prompts(e, &data::render_chatml)?),
                None => {
                    let n_eval = recipe.data.eval_size.min(rows.len() / 2);
                    let mut rows = rows;
                    let train = rows.split_off(n_eval);
                    (train, rows)
                }
            }
        }
        (None, None) => bail!("key `[data]`: no task and no dataset"),
    };
    if train_rows.is_empty() {
        bail!("[data]: no training prompts");
    }

    // Tokenizer and model: an HF checkpoint (via composer-model), or the built-in tiny model
    // with a char-level tokenizer built for the data.
    let (tok, model) = match (&recipe.model.path, recipe.model.builtin_tiny.clone()) {
        (Some(path), _) => {
            let dir = resume_ckpt
                .as_ref()
                .map(|c| c.dir.clone())
                .unwrap_or_else(|| path.clone());
            let tp = dir.join("tokenizer.json");
            let tok =
                Tokenizer::from_file(&tp).map_err(|e| anyhow::anyhow!("{}: {e}", tp.display()))?;
            (tok, TinyModel::load_hf(&dir, &device)?)
        }
        (None, Some(tiny)) => {
            let tok = match &resume_ckpt {
                Some(c) => Tokenizer::from_file(c.dir.join("tokenizer.json")).map_err(|e| {
                    anyhow::anyhow!("{}: {e}", c.dir.join("tokenizer.json").display())
                })?,
                None => {
                    let t = &recipe.loss.hint.template;
                    let mut texts: Vec<&str> = vec![&t.reprompt, &t.solution, &t.feedback];
                    for r in train_rows.iter().chain(&eval_rows) {
                        texts.push(&r.prompt);
                        texts.push(&r.answer);
                    }
                    let sft_rows;
                    if let Some(w) = &recipe.warmup {
                        if let Some(p) = &w.dataset {
                            sft_rows = data::load_sft(p, &data::render_chatml)?;
                            for r in &sft_rows {
                                texts.push(&r.prompt);
                                texts.push(&r.completion);
                            }
                        }
                    }
                    chartok::build_char_tokenizer(texts)?
                }
            };
            let vocab = tok.get_vocab_size(true);
            let model = TinyModel::random_init(&tiny, vocab, mix_seed(seed, u64::MAX, 0), &device)?;
            if let Some(c) = &resume_ckpt {
                model.load_weights(&c.dir.join("model.safetensors"))?;
            }
            (tok, model)
        }
        (None, None) => bail!("key `[model]`: set `path` or `builtin_tiny`"),
    };
    let eos = match model.hf() {
        Some(h) => match h.config.eos_token_ids.first() {
            Some(&e) => e,
            None => chartok::token_id(&tok, chartok::EOS_TOKEN)?,
        },
        None => chartok::token_id(&tok, chartok::EOS_TOKEN)?,
    };
    let vocab = model.vocab_size;

    // Optimizer over the model's variables.
    let vars: Vec<(String, candle_core::Var)> = {
        let data = model
            .varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))?;
        data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    };
    let o = &recipe.optimizer;
    let mut opt = AdamW::new(
        vars,
        AdamWParams {
            betas: o.betas,
            eps: o.eps,
            weight_decay: o.weight_decay,
        },
    )?;

    let state = match &resume_ckpt {
        Some(c) => {
            opt.load_state(&c.optimizer, c.state.optimizer_step)?;
            c.state.clone()
        }
        None => TrainerState {
            step: 0,
            policy_version: 0,
            optimizer_step: 0,
            skipped_steps: 0,
            consecutive_skipped: 0,
            samples_generated: 0,
            trained_tokens: 0,
            seed,
            warmup_accuracy: None,
        },
    };

    // Teacher traces.
    let mut traces = Vec::new();
    if let Some(rp) = &recipe.replay {
        for (i, src) in rp.traces.iter().enumerate() {
            let w = rp.teacher_weights.get(i).copied().unwrap_or(1.0);
            let path = if src == "builtin:scripted" {
                let p = run_dir.join("traces").join("scripted.jsonl");
                if !p.exists() {
                    write_scripted_traces(&p, &train_rows, &tok, eos)?;
                }
                p
            } else {
                PathBuf::from(src)
            };
            for t in replay::read_traces(&path, vocab)
                .with_context(|| format!("key `[replay] traces` #{i}"))?
            {
                traces.push((t, w));
            }
        }
    }
    let mut traces_by_prompt: HashMap<Vec<u32>, Vec<usize>> = HashMap::new();
    for (i, (t, _)) in traces.iter().enumerate() {
        if t.passed {
            traces_by_prompt
                .entry(t.prompt_ids.clone())
                .or_default()
                .push(i);
        }
    }
    let reward = RewardFn::from_specs(&recipe.data.verifiers)?;
    let env_rollout = crate::env_rollout::EnvRollout::from_recipe(&recipe)?;
    Ok(Session {
        env_rollout,
        recipe,
        recipe_text,
        run_dir,
        tok,
        eos,
        model,
        opt,
        train_rows,
        eval_rows,
        reward,
        traces,
        traces_by_prompt,
        state,
    })
}

/// The scripted arithmetic teacher's traces for every training prompt.
fn write_scripted_traces(path: &Path, rows: &[PromptRow], tok: &Tokenizer, eos: u32) -> Result<()> {
    let digit_ids: Vec<u32> = "0123456789-"
        .chars()
        .filter_map(|c| tok.token_to_id(&c.to_string()))
        .chain([eos])
        .collect();
    let mut traces = Vec::with_capacity(rows.len());
    for r in rows {
        let p = chartok::encode(tok, &r.prompt)?;
        let mut c = chartok::encode(tok, &r.answer)?;
        c.push(eos);
        traces.push(task::scripted_trace(r, p, c, &digit_ids, 4));
    }
    task::write_traces(path, &traces)
}

/// Train the policy as the recipe says. See the module docs for the order of things.
pub fn run_train(opts: &TrainOptions) -> Result<RunOutcome> {
    let started = Instant::now();
    let mut s = open_session(opts)?;
    install_sigint_handler();
    // A Ctrl-C of an earlier run in this process (library use, tests) must not stop this one.
    INTERRUPTED.store(false, Ordering::SeqCst);
    std::fs::write(s.run_dir.join("recipe.toml"), &s.recipe_text)
        .with_context(|| format!("writing {}", s.run_dir.join("recipe.toml").display()))?;
    let metrics_path = s.run_dir.join("metrics.jsonl");
    let mut metrics = if opts.resume.is_some() {
        MetricsWriter::open_resume(&metrics_path, s.state.step as u64)?
    } else {
        MetricsWriter::create(&metrics_path)?
    };
    let total_steps = s.recipe.train.steps;
    let mut progress = TrainProgress::new(total_steps as u64, opts.quiet);
    progress.resume_from(s.state.step as u64);
    let target = if s.recipe.train.stop_at_accuracy > 0.0 {
        s.recipe.train.stop_at_accuracy
    } else {
        0.9
    };
    let nan_steps = hook_steps(NAN_HOOK_ENV);
    let sigint_steps = hook_steps(SIGINT_HOOK_ENV);

    // Supervised warm-up (fresh runs only).
    if s.state.step == 0 && opts.resume.is_none() {
        if let Some(w) = s.recipe.warmup.clone() {
            let loss = warmup(&mut s, &w)?;
            let acc = evaluate(&s)?;
            s.state.warmup_accuracy = Some(acc);
            progress.println(format!(
                "warm-up: {} steps, final loss {loss:.4}, greedy accuracy {:.1}%",
                w.steps,
                acc * 100.0
            ));
            metrics.write(&json!({"step": 0, "kind": "eval", "eval/accuracy": acc, "policy_version": 0, "warmup/loss": loss}))?;
        }
    }

    let mut run = RunLog {
        metrics,
        progress,
        started,
        target,
        total_steps,
        nan_steps,
        sigint_steps,
        final_accuracy: None,
        reached_target: None,
        interrupted: false,
    };
    match s.recipe.train.mode {
        TrainMode::Sync => run_sync(&mut s, &mut run)?,
        TrainMode::Async => crate::async_mode::run_async(&mut s, &mut run)?,
    }
    let RunLog {
        progress,
        final_accuracy,
        reached_target,
        interrupted,
        ..
    } = run;
    let summary = format!(
        "{} steps, warm-up accuracy {}, final accuracy {}, {} samples, {} skipped, {:.1}s",
        s.state.step,
        fmt_pct(s.state.warmup_accuracy),
        fmt_pct(final_accuracy),
        s.state.samples_generated,
        s.state.skipped_steps,
        started.elapsed().as_secs_f64()
    );
    progress.finish(&summary);
    if let Err(e) = composer_telemetry::write_report(&s.run_dir) {
        progress.println(format!("report not written: {e:#}"));
    }
    Ok(RunOutcome {
        run_dir: s.run_dir.clone(),
        steps_completed: s.state.step,
        warmup_accuracy: s.state.warmup_accuracy,
        final_accuracy,
        reached_target,
        samples_generated: s.state.samples_generated,
        skipped_steps: s.state.skipped_steps,
        wall_s: started.elapsed().as_secs_f64(),
        interrupted,
    })
}

/// What the step loop carries between steps, whichever layout runs it.
pub(crate) struct RunLog {
    pub(crate) metrics: MetricsWriter,
    pub(crate) progress: TrainProgress,
    pub(crate) started: Instant,
    /// Eval accuracy that counts as reaching the target.
    pub(crate) target: f64,
    pub(crate) total_steps: usize,
    /// Steps whose loss the NaN test hook replaces.
    pub(crate) nan_steps: Vec<usize>,
    /// Steps at whose end the SIGINT test hook raises SIGINT.
    pub(crate) sigint_steps: Vec<usize>,
    pub(crate) final_accuracy: Option<f64>,
    /// (step, samples, seconds) when eval first reached `target`.
    pub(crate) reached_target: Option<(usize, u64, f64)>,
    /// Stopped by Ctrl-C (a checkpoint was written).
    pub(crate) interrupted: bool,
}

/// The sync layout: generate, score, train, publish — one after the other, on this thread.
fn run_sync(s: &mut Session, run: &mut RunLog) -> Result<()> {
    while s.state.step < run.total_steps {
        let step = s.state.step + 1;
        let t_step = Instant::now();

        let t0 = Instant::now();
        let batch = rollout_batch(s, step)?;
        let rollout_s = t0.elapsed().as_secs_f64();

        let t0 = Instant::now();
        let rewards = reward_batch(s, &batch);
        let reward_s = t0.elapsed().as_secs_f64();

        let advantages = step_advantages(s, &batch, &rewards)?;

        let t0 = Instant::now();
        let inject_nan = run.nan_steps.contains(&step);
        let stats = train_on_batch(s, step, &batch, &rewards, &advantages, inject_nan)?;
        let train_s = t0.elapsed().as_secs_f64();

        let t0 = Instant::now();
        publish_weights(s, &stats);
        let sync_s = t0.elapsed().as_secs_f64();

        let walls = StepWalls {
            rollout_s,
            reward_s,
            train_s,
            sync_s,
            step_s: t_step.elapsed().as_secs_f64(),
        };
        // Sync rollouts are always on-policy: staleness 0, logged for the same checks.
        let mut extra = serde_json::Map::new();
        extra.insert("staleness/mean".into(), json!(0.0));
        extra.insert("staleness/max".into(), json!(0));
        extra.insert("staleness/dropped".into(), json!(0));
        if let Some(env) = &s.env_rollout {
            // τ_V of environment rollouts: cumulative call latency and failures by cause.
            let stats = env.stats();
            extra.insert("env/step_p50_s".into(), json!(stats.step.p50_s));
            extra.insert("env/step_p95_s".into(), json!(stats.step.p95_s));
            extra.insert("env/reset_p50_s".into(), json!(stats.reset.p50_s));
            extra.insert("env/reset_p95_s".into(), json!(stats.reset.p95_s));
            extra.insert("env/episodes_ok".into(), json!(stats.episodes_ok));
            extra.insert("env/episodes_failed".into(), json!(stats.episodes_failed));
            extra.insert("env/failures".into(), json!(stats.failures));
        }
        if end_step(s, run, step, &batch, &rewards, &stats, &walls, extra)? {
            break;
        }
    }
    Ok(())
}

/// Advantages of the step's samples from their (weighted) rewards.
pub(crate) fn step_advantages(
    s: &Session,
    batch: &RolloutBatch,
    rewards: &Rewards,
) -> Result<Vec<f64>> {
    let lengths: Vec<usize> = batch
        .samples
        .iter()
        .map(|x| x.completion_ids.len())
        .collect();
    compute_advantages(
        &s.recipe.loss.advantage,
        &rewards.per_func_weighted(&s.reward),
        &lengths,
        s.recipe.rollout.num_generations,
    )
    .context("computing advantages")
}

/// After a step was trained and published: counters, the metrics line (`extra` adds the
/// layout's own keys, e.g. staleness), eval, progress, the non-finite guard, checkpoint and
/// Ctrl-C. Returns whether the run should stop now.
#[allow(clippy::too_many_arguments)]
pub(crate) fn end_step(
    s: &mut Session,
    run: &mut RunLog,
    step: usize,
    batch: &RolloutBatch,
    rewards: &Rewards,
    stats: &TrainStats,
    walls: &StepWalls,
    extra: serde_json::Map<String, serde_json::Value>,
) -> Result<bool> {
    let lengths: Vec<usize> = batch
        .samples
        .iter()
        .map(|x| x.completion_ids.len())
        .collect();
    let (rollout_s, reward_s, train_s, sync_s, step_s) = (
        walls.rollout_s,
        walls.reward_s,
        walls.train_s,
        walls.sync_s,
        walls.step_s,
    );
    let total_steps = run.total_steps;
    let target = run.target;
    s.state.step = step;
    s.state.samples_generated += batch.samples.len() as u64;
    let gen_tokens: usize = lengths.iter().sum();
    s.state.trained_tokens += if stats.non_finite {
        0
    } else {
        gen_tokens as u64
    };
    if stats.non_finite {
        s.state.skipped_steps += 1;
        s.state.consecutive_skipped += 1;
    } else {
        s.state.consecutive_skipped = 0;
    }

    let n = rewards.total.len() as f64;
    let mean = rewards.total.iter().sum::<f64>() / n;
    let std = (rewards
        .total
        .iter()
        .map(|r| (r - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    let mut line = json!({
        "step": step,
        "kind": "train",
        "policy_version": s.state.policy_version,
        "reward/mean": mean,
        "reward/std": std,
        "completions/mean_length": gen_tokens as f64 / n,
        "completions/clipped_ratio": batch.samples.iter().filter(|x| x.truncated).count() as f64 / n,
        "completions/lengths": lengths,
        "loss/rlvr": stats.loss_rlvr,
        "loss/hint": stats.loss_hint,
        "loss/replay": stats.loss_replay,
        "loss/replay_dpo": stats.loss_dpo,
        "loss/replay_kl": stats.loss_teacher_kl,
        "kl": stats.kl,
        "entropy": stats.entropy,
        "clip_ratio/low": stats.clip_low,
        "clip_ratio/high": stats.clip_high,
        "grad_norm": stats.grad_norm,
        "lr": stats.lr,
        "hint/samples": stats.hinted,
        "replay/dpo_pairs": stats.dpo_pairs,
        "time/rollout_s": rollout_s,
        "time/reward_s": reward_s,
        "time/train_s": train_s,
        "time/sync_s": sync_s,
        "time/step_s": step_s,
        "tokens_per_s": gen_tokens as f64 / rollout_s.max(1e-9),
        "trained_tokens": s.state.trained_tokens,
        "samples": s.state.samples_generated,
        "skipped_steps": s.state.skipped_steps,
        "env/latency_s": rewards.latency_s,
    });
    if stats.non_finite {
        line["skipped"] = json!(true);
    }
    if let Some(obj) = line.as_object_mut() {
        obj.extend(extra);
    }
    run.metrics.write(&line)?;

    let every = s.recipe.train.eval_every;
    let mut eval_acc = None;
    if (every > 0 && step.is_multiple_of(every)) || step == total_steps {
        let acc = evaluate(s)?;
        eval_acc = Some(acc);
        run.final_accuracy = Some(acc);
        run.metrics.write(&json!({"step": step, "kind": "eval", "policy_version": s.state.policy_version, "eval/accuracy": acc, "samples": s.state.samples_generated}))?;
        if acc >= target && run.reached_target.is_none() {
            run.reached_target = Some((
                step,
                s.state.samples_generated,
                run.started.elapsed().as_secs_f64(),
            ));
        }
    }
    run.progress.update(&StepSnapshot {
        step: step as u64,
        reward_mean: mean,
        eval_accuracy: eval_acc,
        tokens_per_s: gen_tokens as f64 / rollout_s.max(1e-9),
        extra: stats.non_finite.then(|| "skipped: non-finite".to_string()),
    });

    let ck = s.recipe.train.checkpoint_every;
    if run.sigint_steps.contains(&step) {
        // SAFETY: raising a signal whose handler (installed by run_train) only stores an atomic.
        unsafe {
            libc::raise(libc::SIGINT);
        }
    }
    let interrupted = INTERRUPTED.load(Ordering::SeqCst);
    run.interrupted = interrupted;
    let stop_early = s.recipe.train.stop_at_accuracy > 0.0 && eval_acc.is_some_and(|a| a >= target);
    if s.state.consecutive_skipped >= s.recipe.train.max_nonfinite_steps.max(1) {
        let last_good = checkpoint::find_checkpoint(&s.run_dir)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "none yet (no checkpoint was written)".into());
        bail!(
            "stopping at step {step}: {} consecutive steps had a non-finite loss or gradient \
         (limit `[train] max_nonfinite_steps` = {}); the last good checkpoint is {last_good}",
            s.state.consecutive_skipped,
            s.recipe.train.max_nonfinite_steps
        );
    }
    if (ck > 0 && step.is_multiple_of(ck)) || step == total_steps || interrupted || stop_early {
        save(s)?;
    }
    if interrupted {
        run.progress.println(format!(
            "interrupted: checkpoint written at step {step}; continue with --resume {}",
            s.run_dir.display()
        ));
        return Ok(true);
    }
    Ok(stop_early)
}

fn fmt_pct(x: Option<f64>) -> String {
    x.map(|a| format!("{:.1}%", a * 100.0))
        .unwrap_or_else(|| "n/a".into())
}

/// Write the session's checkpoint.
pub fn save(s: &Session) -> Result<PathBuf> {
    let weights = {
        let data = s
            .model
            .varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))?;
        data.iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect()
    };
    let mut state = s.state.clone();
    state.optimizer_step = s.opt.step;
    let tokenizer_json = s
        .tok
        .to_string(true)
        .map_err(|e| anyhow::anyhow!("serialising tokenizer: {e}"))?;
    checkpoint::save_checkpoint(
        &s.run_dir,
        &CheckpointData {
            config: s.model.hf_config(s.eos, s.eos),
            weights,
            tokenizer_json,
            optimizer: s.opt.state_tensors(),
            tokenizer_config: s.model.hf().and_then(|h| {
                std::fs::read_to_string(h.source_dir.join("tokenizer_config.json")).ok()
            }),
            chat_template: s.model.hf().and_then(|h| {
                std::fs::read_to_string(h.source_dir.join("chat_template.jinja")).ok()
            }),
            state: &state,
            recipe_text: &s.recipe_text,
        },
    )
}

/// Sample the step's prompts and `num_generations` completions for each.
pub fn rollout_batch(s: &Session, step: usize) -> Result<RolloutBatch> {
    if let Some(env) = &s.env_rollout {
        return env.rollout_batch(s, step);
    }
    sample_rollouts(
        &s.model,
        s.state.policy_version,
        &s.recipe,
        &s.train_rows,
        &s.tok,
        s.eos,
        step,
    )
}

/// The step's prompts (drawn from `(seed, step)`) and their completions sampled by `model`,
/// which holds weights version `policy_version`. Shared by the sync loop and the async
/// generator, which samples with a published snapshot.
pub fn sample_rollouts(
    model: &TinyModel,
    policy_version: u64,
    recipe: &Recipe,
    train_rows: &[PromptRow],
    tok: &Tokenizer,
    eos: u32,
    step: usize,
) -> Result<RolloutBatch> {
    let seed = recipe.train.seed;
    let n_prompts = recipe.train.prompts_per_step;
    let prompts: Vec<usize> = (0..n_prompts)
        .map(|i| {
            (mix_seed(seed, step as u64, 1_000_000 + i as u64) % train_rows.len() as u64) as usize
        })
        .collect();
    let prompt_ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|&i| chartok::encode(tok, &train_rows[i].prompt))
        .collect::<Result<_>>()?;
    let r = &recipe.rollout;
    let params = SamplingParams {
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k,
        max_new_tokens: r.max_completion_length,
    };
    let samples = policy::generate(
        model,
        &prompt_ids,
        r.num_generations,
        &params,
        eos,
        policy_version,
        |i| mix_seed(seed, step as u64, i as u64),
    )?;
    let texts = samples
        .iter()
        .map(|x| chartok::decode(tok, &x.completion_ids))
        .collect();
    Ok(RolloutBatch {
        prompts,
        samples,
        texts,
    })
}

/// Score every completion with the verifiers.
pub fn reward_batch(s: &Session, batch: &RolloutBatch) -> Rewards {
    if let Some(env) = &s.env_rollout {
        return env.reward_batch(s, batch);
    }
    score_rollouts(
        &s.reward,
        &s.train_rows,
        s.recipe.rollout.num_generations,
        s.recipe.train.reward_latency_s,
        batch,
    )
}

/// Scores `batch` against its prompts' answers; `added_latency_s` is slept per sample (the
/// async benchmark's slow environment). Shared by the sync loop and the async rewarder.
pub fn score_rollouts(
    reward: &RewardFn,
    train_rows: &[PromptRow],
    num_generations: usize,
    added_latency_s: f64,
    batch: &RolloutBatch,
) -> Rewards {
    let max = reward.max_reward();
    let mut out = Rewards {
        total: vec![],
        per_func: vec![],
        passed: vec![],
        latency_s: vec![],
    };
    for (i, text) in batch.texts.iter().enumerate() {
        let t0 = Instant::now();
        if added_latency_s > 0.0 {
            std::thread::sleep(std::time::Duration::from_secs_f64(added_latency_s));
        }
        let answer = &train_rows[batch.prompts[i / num_generations]].answer;
        let (total, comps) = reward.score(text, answer);
        out.latency_s.push(t0.elapsed().as_secs_f64());
        out.passed.push(total >= max - 1e-9);
        out.total.push(total);
        out.per_func.push(comps);
    }
    out
}

impl Rewards {
    /// Per-verifier rewards already multiplied by their weights (the advantage code then sums
    /// them with unit weights unless `[loss] reward_weights` says otherwise).
    pub fn per_func_weighted(&self, f: &RewardFn) -> Vec<Vec<f64>> {
        self.per_func
            .iter()
            .map(|r| r.iter().zip(&f.parts).map(|(x, (_, w))| x * w).collect())
            .collect()
    }
}

/// Bump the policy version (colocated synchronous layout: the generator reads the trainer's
/// weights directly, so publishing is the version bump).
pub fn publish_weights(s: &mut Session, stats: &TrainStats) {
    if stats.updates > 0 {
        s.state.policy_version += 1;
    }
}

/// Greedy accuracy on the held-out set.
pub fn evaluate(s: &Session) -> Result<f64> {
    let params = SamplingParams {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        max_new_tokens: s.recipe.rollout.max_completion_length,
    };
    let max = s.reward.max_reward();
    let mut correct = 0usize;
    for chunk in s.eval_rows.chunks(256) {
        let ids: Vec<Vec<u32>> = chunk
            .iter()
            .map(|r| chartok::encode(&s.tok, &r.prompt))
            .collect::<Result<_>>()?;
        let out = policy::generate(
            &s.model,
            &ids,
            1,
            &params,
            s.eos,
            s.state.policy_version,
            |_| 0,
        )?;
        for (row, smp) in chunk.iter().zip(&out) {
            let text = chartok::decode(&s.tok, &smp.completion_ids);
            if s.reward.score(&text, &row.answer).0 >= max - 1e-9 {
                correct += 1;
            }
        }
    }
    Ok(correct as f64 / s.eval_rows.len().max(1) as f64)
}

/// Supervised warm-up: cross-entropy on completion tokens (+ EOS) only, constant lr, its own
/// AdamW. Returns the last step's loss.
pub fn warmup(s: &mut Session, w: &crate::recipe::WarmupSection) -> Result<f64> {
    let rows: Vec<SftRow> = match &w.dataset {
        Some(p) => data::load_sft(p, &data::render_chatml)?,
        None => s
            .train_rows
            .iter()
            .map(|r| SftRow {
                prompt: r.prompt.clone(),
                completion: r.answer.clone(),
            })
            .collect(),
    };
    let seed = s.recipe.train.seed;
    let mut opt = AdamW::new(s.opt.vars.clone(), s.opt.params)?;
    let tmpl = &s.recipe.loss.hint.template;
    let mut last = f64::NAN;
    for step in 0..w.steps {
        let mut pairs_owned = Vec::with_capacity(w.batch_size);
        for i in 0..w.batch_size {
            let r = mix_seed(seed, 2_000_000_000 + step as u64, i as u64);
            let row = &rows[(r % rows.len() as u64) as usize];
            // A fraction of generated examples is shown in the hint format so the model learns
            // to read a hint (the hinted teacher of the hint channel).
            let hinted =
                w.dataset.is_none() && ((r >> 32) as f64 / u32::MAX as f64) < w.hint_fraction;
            let prompt = if hinted {
                tmpl.reprompt
                    .replace(
                        "{solution}",
                        &tmpl
                            .solution
                            .replace("{successful_previous_attempt}", &row.completion),
                    )
                    .replace("{feedback}", "")
                    .replace("{prompt}", &row.prompt)
            } else {
                row.prompt.clone()
            };
            let p = chartok::encode(&s.tok, &prompt)?;
            let mut c = chartok::encode(&s.tok, &row.completion)?;
            c.push(s.eos);
            pairs_owned.push((p, c));
        }
        let pairs: Vec<(&[u32], &[u32])> = pairs_owned
            .iter()
            .map(|(p, c)| (p.as_slice(), c.as_slice()))
            .collect();
        let tb = policy::token_batch(&pairs, s.eos, s.model.device())?;
        let (lp, _) = policy::token_logprobs(&s.model, &tb, 1.0)?;
        let loss = policy::masked_mean(&lp.neg()?, &tb.mask)?;
        last = scalar(&loss)?;
        let mut grads = collect_grads(&opt, &loss)?;
        let names: Vec<String> = opt.vars.iter().map(|(n, _)| n.clone()).collect();
        let norm = optim::grad_norm(&names, &grads)?;
        if !last.is_finite() || !norm.is_finite() {
            continue;
        }
        optim::clip_grads(&mut grads, norm, s.recipe.optimizer.max_grad_norm)?;
        opt.step(&grads, w.lr)?;
    }
    Ok(last)
}

fn collect_grads(opt: &AdamW, loss: &Tensor) -> Result<HashMap<String, Tensor>> {
    let store = loss.backward()?;
    let mut out = HashMap::new();
    for (name, var) in &opt.vars {
        if let Some(g) = store.get(var.as_tensor()) {
            out.insert(name.clone(), g.clone());
        }
    }
    Ok(out)
}

/// Per micro-batch tensors fixed before the first update (μ > 1): old log-probs of the
/// rollouts and reference sequence log-probs of the chosen teacher traces.
struct Frozen {
    old_logprobs: Option<Tensor>,
    trace_ref: Option<Tensor>,
}

/// μ passes over the batch; each pass splits it into `mini_batches` optimizer steps (by prompt
/// group), each accumulating gradients over `gradient_accumulation_steps` micro-batches.
pub fn train_on_batch(
    s: &mut Session,
    step: usize,
    batch: &RolloutBatch,
    rewards: &Rewards,
    advantages: &[f64],
    inject_nan: bool,
) -> Result<TrainStats> {
    let g = s.recipe.rollout.num_generations;
    let n_groups = batch.prompts.len();
    let tr = s.recipe.train.clone();

    // Hint prompts: for each sample, the teacher prompt with a successful peer's completion.
    let mut hint_ids: Vec<Option<Vec<u32>>> = vec![None; batch.samples.len()];
    if s.recipe.loss.hint_weight > 0.0 {
        for gi in 0..n_groups {
            // Env rollouts: the prompt the student saw and the env's feedback (e.g. the
            // failing test); otherwise the `[data]` prompt row, without feedback.
            let env_group = s
                .env_rollout
                .as_ref()
                .and_then(|e| e.hint_group(batch, rewards, gi, g));
            let group: Vec<RolloutForHint> = match env_group {
                Some(group) => group,
                None => {
                    let prompt_text = &s.train_rows[batch.prompts[gi]].prompt;
                    (gi * g..(gi + 1) * g)
                        .map(|i| RolloutForHint {
                            prompt_text: prompt_text.clone(),
                            completion_text: batch.texts[i].clone(),
                            reward: rewards.total[i],
                            passed: rewards.passed[i],
                            feedback: None,
                        })
                        .collect()
                }
            };
            for (k, hp) in build_hint_prompts(&group, &s.recipe.loss.hint.template)
                .into_iter()
                .enumerate()
            {
                let i = gi * g + k;
                if s.recipe.loss.hint.only_failed && rewards.passed[i] {
                    continue;
                }
                if let Some(text) = hp {
                    hint_ids[i] = Some(chartok::encode(&s.tok, &text)?);
                }
            }
        }
    }

    // Mini-batches and micro-batches as lists of sample indices (whole groups).
    let groups_per_mb = n_groups.div_ceil(tr.mini_batches);
    let mini: Vec<Vec<Vec<usize>>> = (0..n_groups)
        .collect::<Vec<_>>()
        .chunks(groups_per_mb.max(1))
        .map(|gs| {
            let per_micro = gs.len().div_ceil(tr.gradient_accumulation_steps).max(1);
            gs.chunks(per_micro)
                .map(|c| c.iter().flat_map(|&gi| gi * g..(gi + 1) * g).collect())
                .collect()
        })
        .collect();

    // Old log-probs (and DPO reference) recomputed once before the first update when μ > 1;
    // with μ = 1 the detached current values are used (ratio 1 at the single update).
    let mut frozen: Vec<Vec<Frozen>> = Vec::new();
    for mb in &mini {
        let mut v = Vec::new();
        for micro in mb {
            if tr.num_iterations > 1 {
                let (_, old, trace_ref) = micro_loss(
                    s, step, micro, batch, rewards, advantages, &hint_ids, None, true, None,
                )?;
                v.push(Frozen {
                    old_logprobs: old,
                    trace_ref,
                });
            } else {
                v.push(Frozen {
                    old_logprobs: None,
                    trace_ref: None,
                });
            }
        }
        frozen.push(v);
    }

    let names: Vec<String> = s.opt.vars.iter().map(|(n, _)| n.clone()).collect();
    let mut stats = TrainStats::default();
    let mut n_micro = 0f64;
    let total_updates = tr.steps * tr.num_iterations * tr.mini_batches;
    for _pass in 0..tr.num_iterations {
        for (mb_i, mb) in mini.iter().enumerate() {
            let mut grads: HashMap<String, Tensor> = HashMap::new();
            let mut finite = true;
            let scale = optimizer_step_scale(s, batch, mb);
            for (mi, micro) in mb.iter().enumerate() {
                let fz = &frozen[mb_i][mi];
                let (out, _, _) = micro_loss(
                    s,
                    step,
                    micro,
                    batch,
                    rewards,
                    advantages,
                    &hint_ids,
                    Some(fz),
                    false,
                    Some(&scale),
                )?;
                let Some(out) = out else { continue };
                let loss = if inject_nan {
                    (&out.loss * f64::NAN)?
                } else {
                    out.loss.clone()
                };
                let value = scalar(&loss)?;
                stats.loss_rlvr += out.rlvr;
                stats.loss_hint += out.hint;
                stats.loss_replay += out.replay;
                stats.loss_dpo += out.dpo;
                stats.loss_teacher_kl += out.teacher_kl;
                stats.kl += out.kl;
                stats.entropy += out.entropy;
                stats.clip_low += out.clip_low;
                stats.clip_high += out.clip_high;
                stats.hinted += out.hinted;
                stats.dpo_pairs += out.dpo_pairs;
                n_micro += 1.0;
                if !value.is_finite() {
                    finite = false;
                    continue;
                }
                for (k, gk) in collect_grads(&s.opt, &loss)? {
                    let acc = match grads.remove(&k) {
                        Some(a) => (a + gk)?,
                        None => gk,
                    };
                    grads.insert(k, acc);
                }
            }
            let norm = optim::grad_norm(&names, &grads)?;
            stats.grad_norm = norm;
            if !finite || !norm.is_finite() {
                stats.non_finite = true;
                continue;
            }
            optim::clip_grads(&mut grads, norm, s.recipe.optimizer.max_grad_norm)?;
            let o = &s.recipe.optimizer;
            let lr = optim::lr_at(
                o.lr,
                s.opt.step as usize,
                o.warmup_steps,
                total_updates,
                o.schedule == "cosine",
            );
            stats.lr = lr;
            s.opt.step(&grads, lr)?;
            stats.updates += 1;
        }
    }
    if n_micro > 0.0 {
        for x in [
            &mut stats.loss_rlvr,
            &mut stats.loss_hint,
            &mut stats.loss_replay,
            &mut stats.loss_dpo,
            &mut stats.loss_teacher_kl,
            &mut stats.kl,
            &mut stats.entropy,
            &mut stats.clip_low,
            &mut stats.clip_high,
        ] {
            *x /= n_micro;
        }
        stats.hinted /= tr.num_iterations;
        stats.dpo_pairs /= tr.num_iterations;
    }
    Ok(stats)
}

/// One micro-batch's combined loss `L_rlvr + α·L_hint + β·L_replay` and its parts.
struct MicroOut {
    loss: Tensor,
    rlvr: f64,
    hint: f64,
    replay: f64,
    dpo: f64,
    teacher_kl: f64,
    kl: f64,
    entropy: f64,
    clip_low: f64,
    clip_high: f64,
    hinted: usize,
    dpo_pairs: usize,
}

/// The RLVR normaliser of one optimizer step made of the micro-batches `micro` (lists of
/// sample indices): active completion tokens and sequences over all of them, counted as
/// `LossScale::from_micro_batches` counts them (truncated samples excluded when
/// `mask_truncated_completions`, observation tokens excluded by `loss_mask`). With it the
/// summed micro-batch losses equal the loss of the step's whole batch (DAPO, CISPO, DPPO...).
fn optimizer_step_scale(s: &Session, batch: &RolloutBatch, micro: &[Vec<usize>]) -> LossScale {
    let mask_truncated = s.recipe.loss.rlvr.mask_truncated_completions;
    let (mut tokens, mut sequences) = (0.0, 0.0);
    for &i in micro.iter().flatten() {
        let smp = &batch.samples[i];
        let active = if mask_truncated && smp.truncated {
            0
        } else {
            match &smp.loss_mask {
                Some(mask) => mask.iter().filter(|&&m| m != 0).count(),
                None => smp.completion_ids.len(),
            }
        };
        tokens += active as f64;
        if active > 0 {
            sequences += 1.0;
        }
    }
    LossScale {
        global_active_tokens: tokens,
        global_sequences: sequences,
        num_micro_batches: micro.len().max(1) as f64,
    }
}

/// Builds the micro-batch's loss. With `freeze_only`, returns the detached old log-probs and
/// trace reference log-probs instead (the μ > 1 pre-pass).
#[allow(clippy::too_many_arguments)]
fn micro_loss(
    s: &Session,
    _step: usize,
    idx: &[usize],
    batch: &RolloutBatch,
    rewards: &Rewards,
    advantages: &[f64],
    hint_ids: &[Option<Vec<u32>>],
    frozen: Option<&Frozen>,
    freeze_only: bool,
    rlvr_scale: Option<&LossScale>,
) -> Result<(Option<MicroOut>, Option<Tensor>, Option<Tensor>)> {
    let dev = s.model.device().clone();
    let temp = s.recipe.rollout.temperature;
    let temp = if temp > 0.0 { temp } else { 1.0 };
    let samples: Vec<&Sample> = idx.iter().map(|&i| &batch.samples[i]).collect();
    let pairs: Vec<(&[u32], &[u32])> = samples
        .iter()
        .map(|x| (x.prompt_ids.as_slice(), x.completion_ids.as_slice()))
        .collect();
    let mut tb = policy::token_batch(&pairs, s.eos, &dev)?;
    let (b, l) = tb.input.dims2()?;
    if samples.iter().any(|x| x.loss_mask.is_some()) {
        // Multi-turn episodes: environment observation tokens are input, not trained on.
        let mut keep = vec![1f32; b * l];
        for (r, smp) in samples.iter().enumerate() {
            if let Some(mask) = &smp.loss_mask {
                for (k, &pos) in tb.completion_positions[r].iter().enumerate() {
                    if mask.get(k) == Some(&0) {
                        keep[pos] = 0.0;
                    }
                }
            }
        }
        let keep = Tensor::from_vec(keep, (b, l), &dev)?.to_dtype(tb.mask.dtype())?;
        tb.mask = (&tb.mask * keep)?;
    }
    let (lp, ls) = policy::token_logprobs(&s.model, &tb, temp)?;

    // Teacher traces of this micro-batch's prompts: chosen = passing trace, rejected = failing
    // rollouts of the same prompt.
    let g = s.recipe.rollout.num_generations;
    let replay_on = s.recipe.loss.replay_weight > 0.0 && !s.traces.is_empty();
    let mut trace_ids: Vec<usize> = Vec::new();
    if replay_on {
        let mut seen = std::collections::BTreeSet::new();
        for &i in idx {
            let gi = i / g;
            if seen.insert(gi) {
                if let Some(ts) = s.traces_by_prompt.get(&batch.samples[i].prompt_ids) {
                    trace_ids.extend(ts.iter().copied());
                }
            }
        }
    }
    let trace_pairs: Vec<(&[u32], &[u32])> = trace_ids
        .iter()
        .map(|&t| {
            (
                s.traces[t].0.prompt_ids.as_slice(),
                s.traces[t].0.completion_ids.as_slice(),
            )
        })
        .collect();
    let trace_fw = if trace_pairs.is_empty() {
        None
    } else {
        let ttb = policy::token_batch(&trace_pairs, s.eos, &dev)?;
        let (tlp, tls) = policy::token_logprobs(&s.model, &ttb, 1.0)?;
        Some((ttb, tlp, tls))
    };
    if freeze_only {
        let tref = match &trace_fw {
            Some((ttb, tlp, _)) => Some((tlp * &ttb.mask)?.sum(1)?.detach()),
            None => None,
        };
        return Ok((None, Some(lp.detach()), tref));
    }

    // RLVR.
    let mut sampler = vec![0f32; b * l];
    for (r, smp) in samples.iter().enumerate() {
        for (k, &pos) in tb.completion_positions[r].iter().enumerate() {
            sampler[pos] = smp.sampler_logprobs[k];
        }
    }
    let sampler = Tensor::from_vec(sampler, (b, l), &dev)?;
    let adv: Vec<f32> = idx.iter().map(|&i| advantages[i] as f32).collect();
    let adv = Tensor::from_vec(adv, b, &dev)?;
    let entropies = (ls.exp()? * &ls)?.sum(D::Minus1)?.neg()?;
    let mut inputs = LossInputs::new(lp.clone(), adv, tb.mask.clone());
    inputs.old_logprobs = frozen.and_then(|f| f.old_logprobs.clone());
    inputs.sampler_logprobs = Some(sampler);
    inputs.truncated = Some(samples.iter().map(|x| x.truncated).collect());
    inputs.entropies = Some(entropies.clone());
    let mut cfg = s.recipe.loss.rlvr.clone();
    cfg.max_completion_length = s.recipe.rollout.max_completion_length;
    // The step's normaliser (global token count across gradient-accumulation micro-batches),
    // or this micro-batch alone.
    let scale = match rlvr_scale {
        Some(sc) => *sc,
        None => LossScale::local(&inputs, cfg.mask_truncated_completions)?,
    };
    debug_assert!(
        scale.num_micro_batches != 1.0
            || scale == LossScale::local(&inputs, cfg.mask_truncated_completions)?,
        "optimizer_step_scale disagrees with LossScale::local"
    );
    // Hint and replay are per-micro-batch means: averaged over the step's micro-batches.
    let per_micro = 1.0 / scale.num_micro_batches;

    // Hint: the same weights score the student's completion after the hinted prompt.
    let alpha = s.recipe.loss.hint_weight;
    let has_hint: Vec<bool> = idx.iter().map(|&i| hint_ids[i].is_some()).collect();
    let hinted = has_hint.iter().filter(|h| **h).count();
    if alpha > 0.0 && hinted > 0 {
        let k = s.recipe.loss.hint.top_k.min(s.model.vocab_size);
        let tpairs: Vec<(&[u32], &[u32])> = idx
            .iter()
            .zip(&samples)
            .map(|(&i, smp)| {
                (
                    hint_ids[i].as_deref().unwrap_or(smp.prompt_ids.as_slice()),
                    smp.completion_ids.as_slice(),
                )
            })
            .collect();
        let ttb = policy::token_batch(&tpairs, s.eos, &dev)?;
        let (_, tls) = policy::token_logprobs(&s.model, &ttb, temp)?;
        let tls = tls.detach();
        let (_, lt, v) = tls.dims3()?;
        // Map each student position to the teacher position predicting the same token.
        let mut map = vec![0u32; b * l];
        for r in 0..b {
            for (kk, &pos) in tb.completion_positions[r].iter().enumerate() {
                map[pos] = (ttb.completion_positions[r][kk]) as u32;
            }
        }
        let map = Tensor::from_vec(map, b * l, &dev)?;
        let teacher_full = tls
            .reshape((b * lt, v))?
            .index_select(&map, 0)?
            .reshape((b, l, v))?;
        let topk = topk_ids(&ls.detach(), k)?;
        inputs.hint = Some(HintInputs {
            student_topk_logprobs: Some(ls.gather(&topk, 2)?),
            teacher_topk_logprobs: Some(teacher_full.gather(&topk, 2)?),
            topk_ids: Some(topk),
            teacher_token_logprobs: Some(
                teacher_full
                    .gather(&tb.targets.unsqueeze(2)?, 2)?
                    .squeeze(2)?,
            ),
            has_hint,
        });
    }
    let (l_rlvr, m_rlvr) = rlvr_loss(&inputs, &cfg, &scale).context("RLVR loss")?;
    let mut loss = l_rlvr;
    let mut hint_value = 0.0;
    if inputs.hint.is_some() {
        let (l_hint, m_hint) =
            hint_loss(&inputs, &s.recipe.loss.hint.config).context("hint loss")?;
        hint_value = m_hint.loss;
        loss = (loss + (l_hint * (alpha * per_micro))?)?;
    }

    // Replay: DPO on (passing teacher trace, failing rollout) pairs + token KL on the traces.
    let (mut dpo_v, mut kl_v, mut dpo_pairs) = (0.0, 0.0, 0usize);
    let mut replay_value = 0.0;
    if let Some((ttb, tlp, tls)) = &trace_fw {
        let rc = &s.recipe.loss.replay;
        let weights: Vec<f32> = trace_ids.iter().map(|&t| s.traces[t].1 as f32).collect();
        let w = Tensor::from_vec(weights, trace_ids.len(), &dev)?;
        // Token-level forward KL(teacher ‖ student) over the recorded top-K plus a tail bucket.
        let (bt, lt) = ttb.input.dims2()?;
        let kmax = trace_ids
            .iter()
            .flat_map(|&t| s.traces[t].0.topk_ids.iter().map(|x| x.len()))
            .max()
            .unwrap_or(1);
        let mut ids = vec![0u32; bt * lt * kmax];
        let mut tlps = vec![-1e4f32; bt * lt * kmax];
        for (r, &t) in trace_ids.iter().enumerate() {
            let tr = &s.traces[t].0;
            for (kk, &pos) in ttb.completion_positions[r].iter().enumerate() {
                for (j, (&id, &lpv)) in tr.topk_ids[kk]
                    .iter()
                    .zip(&tr.topk_logprobs[kk])
                    .enumerate()
                {
                    ids[pos * kmax + j] = id;
                    tlps[pos * kmax + j] = lpv;
                }
            }
        }
        let ids = Tensor::from_vec(ids, (bt, lt, kmax), &dev)?;
        let t_top = Tensor::from_vec(tlps, (bt, lt, kmax), &dev)?;
        let s_top = tls.gather(&ids, 2)?;
        let with_tail = |x: &Tensor| -> Result<Tensor> {
            let mass = x.exp()?.sum_keepdim(D::Minus1)?;
            let tail = (mass.neg()? + 1.0)?.clamp(1e-6, 1.0)?.log()?;
            Ok(Tensor::cat(&[x, &tail], D::Minus1)?)
        };
        let (t_all, s_all) = (with_tail(&t_top)?, with_tail(&s_top)?);
        let per_tok = (t_all.exp()? * (t_all - s_all)?)?.sum(D::Minus1)?; // [bt, lt]
        let wmask = ttb.mask.broadcast_mul(&w.unsqueeze(1)?)?;
        let l_kl = (((per_tok * &wmask)?.sum_all()?) / (scalar(&ttb.mask.sum_all()?)?.max(1.0)))?;
        kl_v = scalar(&l_kl)?;

        // DPO (sigmoid): −log σ(β·[(log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r))]),
        // reference = the policy before this step's updates.
        let chosen = (tlp * &ttb.mask)?.sum(1)?; // [bt]
        let chosen_ref = frozen
            .and_then(|f| f.trace_ref.clone())
            .unwrap_or_else(|| chosen.detach());
        let rejected = (&lp * &tb.mask)?.sum(1)?; // [b]
        let rejected_ref = match frozen.and_then(|f| f.old_logprobs.clone()) {
            Some(old) => (old * &tb.mask)?.sum(1)?,
            None => rejected.detach(),
        };
        let mut pc = Vec::new();
        let mut pr = Vec::new();
        for (ti, &t) in trace_ids.iter().enumerate() {
            for (r, &i) in idx.iter().enumerate() {
                if !rewards.passed[i] && batch.samples[i].prompt_ids == s.traces[t].0.prompt_ids {
                    pc.push(ti as u32);
                    pr.push(r as u32);
                }
            }
        }
        dpo_pairs = pc.len();
        let mut l_replay = (l_kl * rc.kl_weight)?;
        if !pc.is_empty() {
            let pc = Tensor::from_vec(pc, dpo_pairs, &dev)?;
            let pr = Tensor::from_vec(pr, dpo_pairs, &dev)?;
            let margin = ((chosen.index_select(&pc, 0)? - chosen_ref.index_select(&pc, 0)?)?
                - (rejected.index_select(&pr, 0)? - rejected_ref.index_select(&pr, 0)?)?)?;
            let z = (margin * rc.dpo_beta)?;
            // softplus(−z) = log(1 + exp(−z)), written stably as relu(−z) + log(1 + exp(−|z|)).
            let sp = (z.neg()?.relu()? + ((z.abs()?.neg()?.exp()? + 1.0)?.log()?))?;
            let pw = w.index_select(&pc, 0)?;
            let l_dpo = (sp * pw)?.mean_all()?;
            dpo_v = scalar(&l_dpo)?;
            l_replay = (l_replay + (l_dpo * rc.dpo_weight)?)?;
        }
        replay_value = scalar(&l_replay)?;
        loss = (loss + (l_replay * (s.recipe.loss.replay_weight * per_micro))?)?;
    }
    let ent = scalar(&policy::masked_mean(&entropies.detach(), &tb.mask)?)?;
    // k3 estimate of KL(sampler ‖ trainer) on the sampled tokens (the sampler/trainer mismatch).
    let kl = m_rlvr.kl.or(m_rlvr.mismatch_kl).unwrap_or(0.0);
    Ok((
        Some(MicroOut {
            loss,
            // This micro-batch's share times their number: the mean over micro-batches is
            // the step's RLVR loss.
            rlvr: m_rlvr.loss * scale.num_micro_batches,
            hint: hint_value,
            replay: replay_value,
            dpo: dpo_v,
            teacher_kl: kl_v,
            kl,
            entropy: ent,
            clip_low: m_rlvr.clip_ratio_low,
            clip_high: m_rlvr.clip_ratio_high,
            hinted,
            dpo_pairs,
        }),
        None,
        None,
    ))
}

/// Top-K token ids per position `[B, L, K]` (u32) of detached log-probs `[B, L, V]`.
fn topk_ids(ls: &Tensor, k: usize) -> Result<Tensor> {
    let (b, l, v) = ls.dims3()?;
    let rows: Vec<f32> = ls.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let mut out = Vec::with_capacity(b * l * k);
    let mut order: Vec<u32> = Vec::with_capacity(v);
    for row in rows.chunks(v) {
        order.clear();
        order.extend(0..v as u32);
        order.select_nth_unstable_by(k.saturating_sub(1).min(v - 1), |&a, &c| {
            row[c as usize].total_cmp(&row[a as usize])
        });
        let mut top: Vec<u32> = order[..k].to_vec();
        top.sort_by(|&a, &c| row[c as usize].total_cmp(&row[a as usize]).then(a.cmp(&c)));
        out.extend(top);
    }
    Ok(Tensor::from_vec(out, (b, l, k), ls.device())?)
}
