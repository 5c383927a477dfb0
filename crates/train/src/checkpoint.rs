//! Checkpoints: `RUN_DIR/checkpoint/` holds the model in HF format (config.json,
//! model.safetensors, and the tokenizer side: for a model loaded from an HF directory, every
//! other file of that directory copied byte-identical — tokenizer.json,
//! tokenizer_config.json, chat_template.jinja, generation_config.json...; for the built-in
//! model its char tokenizer and ChatML template), the AdamW state (optimizer.safetensors),
//! the frozen reference policy when there is one (reference.safetensors), the trainer state
//! (step, policy version, counters; the RNG state is the seed, since every random draw is
//! ChaCha8(mix(seed, step, index))) and the recipe.
//!
//! Atomicity: everything is written into `checkpoint.tmp/`, each file fsynced, then the old
//! checkpoint is renamed to `checkpoint.old/`, the new one renamed into place, and the old one
//! removed. A kill at any moment leaves a complete `checkpoint/` or (between the two renames)
//! a complete `checkpoint.old/`, which [`find_checkpoint`] falls back to.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// Test hook: when set to a step number, the process aborts half-way through writing that
/// step's checkpoint (after the weights, before the rename), like a `kill -9`.
pub const ABORT_HOOK_ENV: &str = "COMPOSER_TRAIN_ABORT_DURING_CHECKPOINT";

/// ChatML chat template written next to the built-in tiny model.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The reference policy's weights inside a checkpoint.
pub const REFERENCE_FILE: &str = "reference.safetensors";

/// Where a LoRA run keeps its frozen built-in base model (HF format; a function of the
/// seed, written by every session of the run).
pub const LORA_BASE_DIR: &str = "base_model";

/// Files the trainer writes itself (never copied from a loaded model directory).
const OWN_FILES: [&str; 6] = [
    composer_model::lora::ADAPTER_CONFIG_FILE,
    "config.json",
    "optimizer.safetensors",
    "trainer_state.json",
    "recipe.toml",
    REFERENCE_FILE,
];

/// What the trainer needs to continue exactly where it stopped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Last completed RL step.
    pub step: usize,
    /// Weights version (bumped after every step's updates).
    pub policy_version: u64,
    /// AdamW steps taken.
    pub optimizer_step: u64,
    /// Steps skipped for non-finite loss/gradients, in total.
    pub skipped_steps: usize,
    /// Consecutive skipped steps at the time of the checkpoint.
    pub consecutive_skipped: usize,
    /// Completions generated so far.
    pub samples_generated: u64,
    /// Completion tokens trained on so far.
    pub trained_tokens: u64,
    /// The recipe seed; with (step, index) it determines every random draw.
    pub seed: u64,
    /// Warm-up accuracy (eval before RL), if measured.
    pub warmup_accuracy: Option<f64>,
    /// The sha256 of each data file the recipe names, by recipe key: a resumed run refuses
    /// data that changed (`resume_check::same_data`).
    #[serde(default)]
    pub data_digests: BTreeMap<String, String>,
}

/// Everything one checkpoint holds, borrowed from the trainer.
pub struct CheckpointData<'a> {
    /// HF config.json contents.
    pub config: serde_json::Value,
    /// Model weights by HF name (with LoRA: the adapters, by PEFT name).
    pub weights: HashMap<String, Tensor>,
    /// With LoRA: PEFT's adapter_config.json; `weights` are then written as PEFT's
    /// adapter_model.safetensors instead of model.safetensors.
    pub adapter_config: Option<serde_json::Value>,
    /// tokenizer.json contents.
    pub tokenizer_json: String,
    /// Optimizer moments.
    pub optimizer: HashMap<String, Tensor>,
    /// The HF directory the model was loaded from: its files other than weights and
    /// config.json are copied byte-identical, and `config` keeps that directory's config.json
    /// with only the dtype changed. None: the built-in model (char tokenizer, ChatML).
    pub source_dir: Option<&'a Path>,
    /// The frozen reference policy's weights, if any.
    pub reference: Option<HashMap<String, Tensor>>,
    /// Trainer state.
    pub state: &'a TrainerState,
    /// The recipe text.
    pub recipe_text: &'a str,
    /// Files a step hook keeps with the checkpoint (relative paths, e.g. a DiLoCo replica's
    /// outer state): written before `trainer_state.json`, so a checkpoint is complete with
    /// them or not there at all.
    pub extra_files: Vec<(String, Vec<u8>)>,
}

/// Write a checkpoint atomically into `run_dir/checkpoint`. On a failed write (disk full...)
/// the last good checkpoint is untouched and the partial `checkpoint.tmp` is removed, so it
/// does not keep the disk full.
pub fn save_checkpoint(run_dir: &Path, data: &CheckpointData) -> Result<PathBuf> {
    let tmp = run_dir.join("checkpoint.tmp");
    let written = write_checkpoint_tmp(&tmp, data);
    if written.is_err() && tmp.exists() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written?;
    publish_checkpoint(run_dir, &tmp)
}

/// `tensors` as safetensors bytes, sorted by name (so equal weights give equal files).
pub fn safetensors_bytes(tensors: &HashMap<String, Tensor>) -> Result<Vec<u8>> {
    let mut sorted: Vec<(&String, &Tensor)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    Ok(safetensors::serialize(
        sorted
            .into_iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>(),
        Some(HashMap::from([("format".to_string(), "pt".to_string())])),
    )?)
}

/// Writes every file of the checkpoint into `tmp` and syncs them.
fn write_checkpoint_tmp(tmp: &Path, data: &CheckpointData) -> Result<()> {
    if tmp.exists() {
        std::fs::remove_dir_all(tmp)
            .with_context(|| format!("removing stale {}", tmp.display()))?;
    }
    std::fs::create_dir_all(tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let st = safetensors_bytes;
    match &data.adapter_config {
        Some(c) => {
            composer_fsutil::write_atomic(
                &tmp.join(composer_model::lora::ADAPTER_WEIGHTS_FILE),
                &st(&data.weights)?,
            )?;
            composer_fsutil::write_atomic(
                &tmp.join(composer_model::lora::ADAPTER_CONFIG_FILE),
                serde_json::to_string_pretty(c)?.as_bytes(),
            )?;
        }
        None => composer_fsutil::write_atomic(&tmp.join("model.safetensors"), &st(&data.weights)?)?,
    }
    if std::env::var(ABORT_HOOK_ENV)
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        == Some(data.state.step)
    {
        eprintln!(
            "{ABORT_HOOK_ENV}: aborting while writing the checkpoint of step {}",
            data.state.step
        );
        std::process::abort();
    }
    match data.source_dir {
        Some(src) => copy_model_files(src, tmp, &data.config)?,
        None => {
            composer_fsutil::write_atomic(
                &tmp.join("config.json"),
                serde_json::to_string_pretty(&data.config)?.as_bytes(),
            )?;
            composer_fsutil::write_atomic(
                &tmp.join("tokenizer.json"),
                data.tokenizer_json.as_bytes(),
            )?;
            let tok_cfg = serde_json::json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": crate::tokenizer::EOS_TOKEN,
                "pad_token": crate::tokenizer::EOS_TOKEN,
                "unk_token": crate::tokenizer::UNK_TOKEN,
                "model_max_length": data.config["max_position_embeddings"],
                "chat_template": CHATML_TEMPLATE,
            });
            composer_fsutil::write_atomic(
                &tmp.join("tokenizer_config.json"),
                serde_json::to_string_pretty(&tok_cfg)?.as_bytes(),
            )?;
            composer_fsutil::write_atomic(
                &tmp.join("chat_template.jinja"),
                CHATML_TEMPLATE.as_bytes(),
            )?;
        }
    }
    if let Some(r) = &data.reference {
        composer_fsutil::write_atomic(&tmp.join(REFERENCE_FILE), &st(r)?)?;
    }
    composer_fsutil::write_atomic(&tmp.join("optimizer.safetensors"), &st(&data.optimizer)?)?;
    for (name, bytes) in &data.extra_files {
        let rel = Path::new(name);
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| c == std::path::Component::ParentDir)
        {
            bail!("checkpoint file {name:?} must be a relative path inside the checkpoint");
        }
        let path = tmp.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        composer_fsutil::write_atomic(&path, bytes)?;
        if let Some(parent) = path.parent() {
            composer_fsutil::sync_dir(parent)?;
        }
    }
    composer_fsutil::write_atomic(
        &tmp.join("trainer_state.json"),
        serde_json::to_string_pretty(data.state)?.as_bytes(),
    )?;
    composer_fsutil::write_atomic(&tmp.join("recipe.toml"), data.recipe_text.as_bytes())?;
    Ok(composer_fsutil::sync_dir(tmp)?)
}

/// Swaps the complete `tmp` in as `run_dir/checkpoint` (the previous one as
/// `checkpoint.old` until the swap is durable).
fn publish_checkpoint(run_dir: &Path, tmp: &Path) -> Result<PathBuf> {
    let final_dir = run_dir.join("checkpoint");
    let old = run_dir.join("checkpoint.old");
    if old.exists() {
        std::fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    }
    if final_dir.exists() {
        std::fs::rename(&final_dir, &old)
            .with_context(|| format!("moving {} aside", final_dir.display()))?;
    }
    std::fs::rename(tmp, &final_dir)
        .with_context(|| format!("renaming into {}", final_dir.display()))?;
    composer_fsutil::sync_dir(run_dir)?;
    if old.exists() {
        std::fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    }
    Ok(final_dir)
}

/// Copies every regular file of the loaded model directory `src` into `dst` byte-identical,
/// except the weights (`*.safetensors`, the shard index) and the trainer's own files; writes
/// `src/config.json` with only its dtype keys (`torch_dtype` / `dtype`) set to `float32`
/// (or `fallback_config` when `src` has none).
fn copy_model_files(src: &Path, dst: &Path, fallback_config: &serde_json::Value) -> Result<()> {
    let entries = std::fs::read_dir(src).with_context(|| format!("listing {}", src.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("listing {}", src.display()))?;
        let name = entry.file_name().to_string_lossy().to_string();
        let is_weights = name.ends_with(".safetensors") || name == "model.safetensors.index.json";
        if !entry.file_type()?.is_file() || is_weights || OWN_FILES.contains(&name.as_str()) {
            continue;
        }
        let bytes = std::fs::read(entry.path())
            .with_context(|| format!("reading {}", entry.path().display()))?;
        composer_fsutil::write_atomic(&dst.join(&name), &bytes)?;
    }
    let cfg_path = src.join("config.json");
    let config = if cfg_path.is_file() {
        let mut v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&cfg_path)
                .with_context(|| format!("reading {}", cfg_path.display()))?,
        )
        .with_context(|| format!("parsing {}", cfg_path.display()))?;
        if let Some(obj) = v.as_object_mut() {
            let mut set = false;
            for key in ["torch_dtype", "dtype"] {
                if obj.contains_key(key) {
                    obj.insert(key.into(), serde_json::json!("float32"));
                    set = true;
                }
            }
            if !set {
                obj.insert("torch_dtype".into(), serde_json::json!("float32"));
            }
        }
        v
    } else {
        fallback_config.clone()
    };
    composer_fsutil::write_atomic(
        &dst.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    Ok(())
}

/// The newest complete checkpoint directory of a run (`checkpoint/`, else `checkpoint.old/`).
pub fn find_checkpoint(run_dir: &Path) -> Result<PathBuf> {
    for name in ["checkpoint", "checkpoint.old"] {
        let d = run_dir.join(name);
        if d.join("trainer_state.json").is_file() {
            return Ok(d);
        }
    }
    bail!(
        "{}: no complete checkpoint (expected {}/trainer_state.json)",
        run_dir.display(),
        run_dir.join("checkpoint").display()
    )
}

/// A loaded checkpoint.
pub struct LoadedCheckpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// Trainer state.
    pub state: TrainerState,
    /// Optimizer moments.
    pub optimizer: HashMap<String, Tensor>,
    /// Recipe text.
    pub recipe_text: String,
}

/// Read trainer state, optimizer and recipe from a checkpoint directory (weights are read by
/// the model loader from `dir/model.safetensors`).
pub fn load_checkpoint(dir: &Path, device: &Device) -> Result<LoadedCheckpoint> {
    let sp = dir.join("trainer_state.json");
    let state: TrainerState = serde_json::from_str(
        &std::fs::read_to_string(&sp).with_context(|| format!("reading {}", sp.display()))?,
    )
    .with_context(|| format!("{}: not a valid trainer state", sp.display()))?;
    let op = dir.join("optimizer.safetensors");
    let optimizer = candle_core::safetensors::load(&op, device)
        .with_context(|| format!("reading {}", op.display()))?;
    let rp = dir.join("recipe.toml");
    let recipe_text =
        std::fs::read_to_string(&rp).with_context(|| format!("reading {}", rp.display()))?;
    Ok(LoadedCheckpoint {
        dir: dir.to_path_buf(),
        state,
        optimizer,
        recipe_text,
    })
}
