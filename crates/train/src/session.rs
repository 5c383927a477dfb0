//! Session setup: recipe, tokenizer and chat template, data, the policy (built-in or HF), the
//! frozen reference policy, teacher traces, optimizer, and resume from a checkpoint; and
//! writing the session's checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use composer_model::ChatTemplate;
use tokenizers::Tokenizer;

use crate::checkpoint::{self, CheckpointData, TrainerState};
use crate::data::{self, Message, PromptRow, SftRow};
use crate::model::PolicyModel;
use crate::optim::{AdamW, AdamWParams};
use crate::options::TrainOptions;
use crate::prompts::{chatml_template, render_messages, screen_prompts};
use crate::recipe::{self, Recipe};
use crate::replay::{self, TeacherTrace};
use crate::resume_check;
use crate::seed::mix_seed;
use crate::task;
use crate::tokenizer as chartok;
use crate::verifiers::RewardFn;

/// Everything the loop works on.
pub struct Session {
    /// The recipe.
    pub recipe: Recipe,
    /// Its text (written to RUN_DIR/recipe.toml and into checkpoints).
    pub recipe_text: String,
    /// Run directory.
    pub run_dir: PathBuf,
    /// With LoRA: the frozen base model's directory (`base_model_name_or_path` of the
    /// checkpoints' `adapter_config.json`).
    pub lora_base: Option<PathBuf>,
    /// Tokenizer.
    pub tok: Tokenizer,
    /// The chat template `messages` rows are rendered with (the checkpoint's own, or ChatML
    /// for the built-in char tokenizer); None when an HF checkpoint has none.
    pub chat_template: Option<ChatTemplate>,
    /// Padding id (the first stop id).
    pub eos: u32,
    /// Every id that ends a completion (all EOS ids of config.json, generation_config.json
    /// and the tokenizer).
    pub stop_ids: Vec<u32>,
    /// The policy.
    pub model: PolicyModel,
    /// The frozen reference policy π_ref (KL with `beta > 0`, replay DPO); built when RL
    /// starts if the recipe needs one.
    pub reference: Option<PolicyModel>,
    /// RL optimizer.
    pub opt: AdamW,
    /// Training prompts.
    pub train_rows: Vec<PromptRow>,
    /// Held-out prompts.
    pub eval_rows: Vec<PromptRow>,
    /// The `[warmup] dataset`'s examples, when the recipe names one.
    pub warmup_rows: Option<Vec<SftRow>>,
    /// Reward.
    pub reward: RewardFn,
    /// Teacher traces.
    pub traces: Vec<TeacherTrace>,
    /// Weight of each teacher (by the traces' `teacher` name), from `[replay] teacher_weights`.
    pub teacher_weights: BTreeMap<String, f64>,
    /// Indices of passing traces, by prompt token ids.
    pub traces_by_prompt: HashMap<Vec<u32>, Vec<usize>>,
    /// Training prompts that no passing trace covers (the replay channel skips them).
    pub rows_without_trace: usize,
    /// Resumable counters.
    pub state: TrainerState,
    /// `[env]` rollouts (an env pool), when the recipe has an `[env]` section.
    pub env_rollout: Option<crate::env_rollout::EnvRollout>,
    /// This process's lock of the run directory, held as long as the session lives.
    pub run_lock: crate::run_dir::RunDirLock,
}

impl Session {
    /// Whether the loss reads reference log-probs: RLVR's KL (`beta != 0`) or replay DPO.
    pub fn needs_reference(&self) -> bool {
        let l = &self.recipe.loss;
        l.rlvr.beta != 0.0
            || (l.replay_weight > 0.0 && l.replay.dpo_weight > 0.0 && !self.traces.is_empty())
    }

    /// Builds the frozen reference policy if the loss needs one and it is not there yet:
    /// `[loss] ref_model_path`, else a copy of the current weights.
    pub fn ensure_reference(&mut self) -> Result<()> {
        if self.reference.is_some() || !self.needs_reference() {
            return Ok(());
        }
        self.reference = Some(match &self.recipe.loss.reference.ref_model_path {
            Some(p) => {
                let mut r = PolicyModel::load_hf(p, self.model.device())
                    .with_context(|| format!("key `[loss] ref_model_path` = {}", p.display()))?;
                r.padding_free = self.model.padding_free;
                r.set_compute_dtype(self.model.compute_dtype(), self.recipe.train.seed)?;
                if r.vocab_size() != self.model.vocab_size() {
                    bail!(
                        "key `[loss] ref_model_path`: {} has vocab_size {}, the policy {}",
                        p.display(),
                        r.vocab_size(),
                        self.model.vocab_size()
                    );
                }
                r
            }
            None => self.model.snapshot()?,
        });
        Ok(())
    }

    /// TRL's `sync_ref_model`: after every `ref_model_sync_steps`-th step,
    /// π_ref ← α·π + (1 − α)·π_ref (composer-loss's EMA update with τ = α).
    pub fn sync_reference(&mut self, step: usize) -> Result<()> {
        let rc = &self.recipe.loss.reference;
        if !rc.sync_ref_model || !step.is_multiple_of(rc.ref_model_sync_steps.max(1)) {
            return Ok(());
        }
        let Some(reference) = &self.reference else {
            return Ok(());
        };
        let policy: HashMap<String, candle_core::Tensor> =
            self.model.weights()?.into_iter().collect();
        let data = reference
            .varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))?;
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        let vars: Vec<candle_core::Var> = names.iter().map(|n| data[*n].clone()).collect();
        let student: Vec<candle_core::Tensor> = names
            .iter()
            .map(|n| policy.get(*n).cloned().context("policy weight missing"))
            .collect::<Result<_>>()?;
        composer_loss::ema_update(&vars, &student, rc.ref_model_mixup_alpha)
            .map_err(|e| anyhow::anyhow!("syncing the reference policy: {e}"))?;
        drop(data);
        reference.refresh_compute()
    }

    /// Prompt token ids of a text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        chartok::encode(&self.tok, text)
    }
}

/// Load or build everything; on `resume`, restore weights, optimizer, reference and counters.
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
    if let (Some(c), Some(p)) = (&resume_ckpt, &opts.recipe_path) {
        resume_check::same_recipe(p, &c.recipe_text, &c.dir.join("recipe.toml"))?;
    }
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
    let data_digests = resume_check::data_digests(&recipe)?;
    if let Some(c) = &resume_ckpt {
        resume_check::same_data(&c.state.data_digests, &data_digests, &c.dir)?;
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
    let run_lock = crate::run_dir::claim(&run_dir, opts.resume.is_some(), opts.overwrite)?;
    let seed = recipe.train.seed;
    let lora = recipe.model.lora_config()?;

    // An HF checkpoint's tokenizer and chat template come first: `messages` rows are
    // rendered with the checkpoint's own template. (On resume: the checkpoint's copies.)
    let hf_dir = recipe.model.path.as_ref().map(|path| {
        resume_ckpt
            .as_ref()
            .map(|c| c.dir.clone())
            .unwrap_or_else(|| path.clone())
    });
    let hf_text = match &hf_dir {
        Some(dir) => {
            let tok = composer_model::Tokenizer::from_dir(dir)?;
            let template = ChatTemplate::from_dir(dir, Some(&tok))?;
            Some((tok, template))
        }
        None => None,
    };
    let chat_template = match &hf_text {
        Some((_, t)) => t.clone(),
        None => Some(chatml_template()),
    };
    let render = |m: &[Message]| render_messages(chat_template.as_ref(), m);

    // Data, each row with where it came from (for errors naming the file and line).
    let (train_rows, eval_rows) = match (&recipe.data.task, &recipe.data.dataset) {
        (Some(_), _) => {
            let (train, eval) =
                task::arithmetic_split(&recipe.data.arithmetic, recipe.data.eval_size, seed);
            let at = |(i, r): (usize, PromptRow)| (format!("`[data] task` row {}", i + 1), r);
            (
                train.into_iter().enumerate().map(at).collect(),
                eval.into_iter().enumerate().map(at).collect(),
            )
        }
        (None, Some(path)) => {
            let load = |p: &Path| -> Result<Vec<(String, PromptRow)>> {
                Ok(data::load_prompts_with_lines(p, &render)?
                    .into_iter()
                    .map(|(l, r)| (format!("{} line {l}", p.display()), r))
                    .collect())
            };
            let rows = load(path)?;
            match &recipe.data.eval_dataset {
                Some(e) => (rows, load(e)?),
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
    // The warm-up dataset, read once: the char tokenizer, the context check and the warm-up
    // itself all use these rows.
    let warmup_rows = match recipe.warmup.as_ref().and_then(|w| w.dataset.as_ref()) {
        Some(p) => Some(data::load_sft(p, &render)?),
        None => None,
    };
    let (train_at, train_rows): (Vec<String>, Vec<PromptRow>) = train_rows.into_iter().unzip();
    let (eval_at, eval_rows): (Vec<String>, Vec<PromptRow>) = eval_rows.into_iter().unzip();
    if train_rows.is_empty() {
        bail!("[data]: no training prompts");
    }

    // Tokenizer and model: an HF checkpoint, or the built-in tiny model with a char-level
    // tokenizer built for the data.
    let (tok, model, stop_ids) = match (hf_dir, hf_text, recipe.model.builtin_tiny.clone()) {
        (Some(dir), Some((htok, _)), _) => {
            // A LoRA checkpoint holds only the adapter: the frozen weights come from the
            // recipe's model every time.
            let weights_dir = match (&lora, &recipe.model.path) {
                (Some(_), Some(p)) => p.clone(),
                _ => dir.clone(),
            };
            let mut model = PolicyModel::load_hf(&weights_dir, &device)?;
            model.source_dir = Some(dir.clone());
            // As `composer-rl generate`: config.json ∪ generation_config.json EOS ids, plus
            // the tokenizer's eos_token.
            let mut stops = model.config().eos_token_ids.clone();
            if let Some(e) = htok.eos_token_id() {
                if !stops.contains(&e) {
                    stops.push(e);
                }
            }
            if stops.is_empty() {
                bail!(
                    "{}: no EOS token id in config.json, generation_config.json or tokenizer_config.json; completions could never stop",
                    dir.display()
                );
            }
            (htok.inner, model, stops)
        }
        (None, _, Some(tiny)) => {
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
                    for r in warmup_rows.iter().flatten() {
                        texts.push(&r.prompt);
                        texts.push(&r.completion);
                    }
                    chartok::build_char_tokenizer(texts)?
                }
            };
            let eos = chartok::token_id(&tok, chartok::EOS_TOKEN)?;
            let cfg = tiny.model_config(tok.get_vocab_size(true), eos)?;
            let model = PolicyModel::random_init(&cfg, mix_seed(seed, u64::MAX, 0), &device)?;
            (tok, model, vec![eos])
        }
        _ => bail!("key `[model]`: set `path` or `builtin_tiny`"),
    };
    let mut model = model;
    model.padding_free = recipe.train.padding_free;
    model.transformer.gradient_checkpointing = recipe.train.gradient_checkpointing;
    let lora_base = match &lora {
        Some(cfg) => Some(model.enable_lora(cfg, seed, recipe.model.path.as_deref(), &run_dir)?),
        None => None,
    };
    // After LoRA: the compute copy of a LoRA model is its adapters' (and a bf16 frozen base).
    model.set_compute_dtype(
        crate::mixed_precision::compute_dtype(recipe.train.bf16),
        seed,
    )?;
    if let Some(c) = &resume_ckpt {
        model.check_adapter_config(&c.dir)?;
        // An HF model without LoRA was loaded from the checkpoint directory itself.
        if model.lora().is_some() || recipe.model.path.is_none() {
            model
                .load_weights(&model.weights_file(&c.dir))
                .with_context(|| format!("resuming from {}", c.dir.display()))?;
        }
    }
    let eos = stop_ids[0];
    let vocab = model.vocab_size();

    // Every prompt must fit the model: token ids inside its vocabulary, and room for at
    // least one completion token in its context.
    let skip = recipe.data.overlong_prompts == "skip";
    let ctx = model.config().max_position_embeddings;
    let (train_rows, skipped_train) =
        screen_prompts(train_rows, &train_at, &tok, vocab, ctx, skip)?;
    let (eval_rows, skipped_eval) = screen_prompts(eval_rows, &eval_at, &tok, vocab, ctx, skip)?;
    if skipped_train + skipped_eval > 0 {
        tracing::warn!(
            "[data] overlong_prompts = \"skip\": skipped {skipped_train} training and \
             {skipped_eval} eval prompts longer than the model's context ({ctx} tokens)"
        );
        if train_rows.is_empty() {
            bail!(
                "[data]: every training prompt is longer than the model's context ({ctx} tokens)"
            );
        }
    }
    if let (Some(p), Some(rows)) = (
        recipe.warmup.as_ref().and_then(|w| w.dataset.as_ref()),
        &warmup_rows,
    ) {
        check_warmup_rows(p, rows, &tok, ctx)?;
    }

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

    // A resumed run's reference policy is the one its checkpoint saved.
    let mut reference = None;
    let state = match &resume_ckpt {
        Some(c) => {
            let op = c.dir.join("optimizer.safetensors");
            opt.load_state(&c.optimizer, c.state.optimizer_step)
                .with_context(|| format!("{}: not this run's optimizer state", op.display()))?;
            let ref_path = c.dir.join(checkpoint::REFERENCE_FILE);
            if ref_path.is_file() {
                let r = model.snapshot()?;
                r.load_weights(&ref_path)
                    .with_context(|| format!("resuming from {}", c.dir.display()))?;
                reference = Some(r);
            }
            TrainerState {
                data_digests,
                ..c.state.clone()
            }
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
            data_digests,
        },
    };

    // Teacher traces, and each teacher's weight (by the name its traces carry).
    let mut traces = Vec::new();
    let mut teacher_weights = BTreeMap::new();
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
                if let Some(old) = teacher_weights.insert(t.teacher.clone(), w) {
                    if old != w {
                        bail!(
                            "key `[replay] teacher_weights`: teacher {:?} appears in several trace files with different weights ({old} and {w})",
                            t.teacher
                        );
                    }
                }
                traces.push(t);
            }
        }
    }
    let mut traces_by_prompt: HashMap<Vec<u32>, Vec<usize>> = HashMap::new();
    for (i, t) in traces.iter().enumerate() {
        if t.passed {
            traces_by_prompt
                .entry(t.prompt_ids.clone())
                .or_default()
                .push(i);
        }
    }
    let rows_without_trace = if traces.is_empty() {
        0
    } else {
        let mut n = 0;
        for r in &train_rows {
            if !traces_by_prompt.contains_key(&chartok::encode(&tok, &r.prompt)?) {
                n += 1;
            }
        }
        n
    };
    let reward = RewardFn::from_specs(&recipe.data.verifiers)?;
    let env_rollout = crate::env_rollout::EnvRollout::from_recipe(&recipe, chat_template.as_ref())?;
    Ok(Session {
        run_lock,
        env_rollout,
        recipe,
        recipe_text,
        run_dir,
        lora_base,
        tok,
        chat_template,
        eos,
        stop_ids,
        model,
        reference,
        opt,
        train_rows,
        eval_rows,
        warmup_rows,
        reward,
        traces,
        teacher_weights,
        traces_by_prompt,
        rows_without_trace,
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

/// Write the session's checkpoint: the weights in f32 and, for an HF model, every other file
/// of the loaded directory byte-identical (tokenizer files, chat template, generation config;
/// config.json with only its dtype changed), plus a step hook's `extra_files`.
pub fn save(s: &Session, extra_files: Vec<(String, Vec<u8>)>) -> Result<PathBuf> {
    let weights = s.model.weights()?.into_iter().collect();
    let mut state = s.state.clone();
    state.optimizer_step = s.opt.step;
    let tokenizer_json = s
        .tok
        .to_string(true)
        .map_err(|e| anyhow::anyhow!("serialising tokenizer: {e}"))?;
    let reference = match &s.reference {
        // A LoRA run's `ref_model_path` reference is a frozen file (`sync_ref_model` is
        // refused with `use_peft`): resume loads it from there again, so it is not copied
        // into every checkpoint (its names are the full model's, not the adapter's).
        Some(_) if s.model.lora().is_some() && s.recipe.loss.reference.ref_model_path.is_some() => {
            None
        }
        Some(r) => Some(r.weights()?.into_iter().collect()),
        None => None,
    };
    checkpoint::save_checkpoint(
        &s.run_dir,
        &CheckpointData {
            config: s.model.config().to_hf_json("float32"),
            weights,
            tokenizer_json,
            optimizer: s.opt.state_tensors()?,
            source_dir: s.model.source_dir.as_deref(),
            adapter_config: s
                .lora_base
                .as_deref()
                .and_then(|b| s.model.adapter_config(b)),
            reference,
            state: &state,
            recipe_text: &s.recipe_text,
            extra_files,
        },
    )
}

/// The warm-up dataset's examples against the model's context, before any step: an example
/// (prompt, completion and EOS) longer than `ctx` is an error naming the file and row.
fn check_warmup_rows(path: &Path, rows: &[SftRow], tok: &Tokenizer, ctx: usize) -> Result<()> {
    for (i, r) in rows.iter().enumerate() {
        let n = chartok::encode(tok, &r.prompt)?.len() + chartok::encode(tok, &r.completion)?.len();
        if n + 1 > ctx {
            bail!(
                "{} row {}: the warm-up example is {} tokens (prompt, completion and EOS), more \
                 than the model's context of {ctx} (max_position_embeddings)",
                path.display(),
                i + 1,
                n + 1
            );
        }
    }
    Ok(())
}
