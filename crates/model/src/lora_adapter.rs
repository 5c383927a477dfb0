//! The LoRA adapter's parts the decoder holds, with PEFT's semantics and file format: the
//! hyper-parameters ([`LoraConfig`], read from and written as PEFT's `adapter_config.json`),
//! one projection's adapter weights ([`LoraAdapter`]) and the training-time dropout.
//!
//! The decoder's layers ([`crate::transformer`]) depend on this module and nothing here
//! depends on the decoder; attaching, saving, merging and exporting adapters on a whole
//! model is [`crate::lora`]'s.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// The decoder's adaptable projections, as PEFT names them (`target_modules` entries).
pub const LINEAR_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// PEFT's default targets for the Llama / Qwen2 / Qwen3 families
/// (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`), used when none are given.
pub const DEFAULT_TARGET_MODULES: [&str; 2] = ["q_proj", "v_proj"];

/// Adapter file names inside an adapter directory (PEFT's `save_pretrained`).
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// See [`ADAPTER_CONFIG_FILE`].
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// Prefix PEFT puts before a module name in adapter tensor names (`PeftModel` wraps the
/// causal LM as `base_model.model`).
const PEFT_PREFIX: &str = "base_model.model.";

/// LoRA hyper-parameters (TRL `ModelConfig`'s `lora_*` keys, PEFT `LoraConfig` semantics).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` (≥ 1).
    pub r: usize,
    /// `lora_alpha`: the update is scaled by `lora_alpha / r`.
    pub alpha: f64,
    /// Dropout probability on the adapter's input during training, in `[0, 1)`.
    pub dropout: f64,
    /// Adapted projections: entries of [`LINEAR_MODULES`] (resolved from `"all-linear"`).
    pub target_modules: Vec<String>,
}

impl LoraConfig {
    /// A config from the recipe's keys: `target_modules` entries are module names of
    /// [`LINEAR_MODULES`] or the single entry `"all-linear"` (every projection of the
    /// decoder, not the LM head, as PEFT); None means PEFT's default for the family. Every
    /// bad value is an error naming its key.
    pub fn new(
        r: usize,
        alpha: f64,
        dropout: f64,
        target_modules: Option<&[String]>,
    ) -> Result<Self> {
        if r == 0 {
            bail!("key `lora_r` = 0 is out of range; allowed: an integer >= 1 (the adapter rank)");
        }
        if !(alpha > 0.0) || !alpha.is_finite() {
            bail!("key `lora_alpha` = {alpha} is out of range; allowed: a finite number > 0 (the update is scaled by lora_alpha / lora_r)");
        }
        if !(0.0..1.0).contains(&dropout) {
            bail!("key `lora_dropout` = {dropout} is out of range; allowed: [0, 1)");
        }
        let target_modules = match target_modules {
            None => DEFAULT_TARGET_MODULES
                .iter()
                .map(|s| s.to_string())
                .collect(),
            Some(t) => resolve_targets(t)?,
        };
        Ok(LoraConfig {
            r,
            alpha,
            dropout,
            target_modules,
        })
    }

    /// `lora_alpha / r`.
    pub fn scaling(&self) -> f64 {
        self.alpha / self.r as f64
    }

    /// Whether projection `module` (e.g. `q_proj`) is adapted.
    pub fn targets(&self, module: &str) -> bool {
        self.target_modules.iter().any(|t| t == module)
    }

    /// PEFT's `adapter_config.json` for this adapter on `base_model_name_or_path`.
    pub fn to_peft_json(&self, base_model_name_or_path: &str) -> serde_json::Value {
        serde_json::to_value(PeftAdapterConfig {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            r: self.r,
            lora_alpha: self.alpha,
            lora_dropout: self.dropout,
            target_modules: TargetModules::List(self.target_modules.clone()),
            bias: "none".into(),
            fan_in_fan_out: false,
            use_rslora: false,
            use_dora: false,
            inference_mode: true,
            init_lora_weights: serde_json::Value::Bool(true),
            layers_to_transform: None,
            modules_to_save: None,
            rank_pattern: HashMap::new(),
            alpha_pattern: HashMap::new(),
            base_model_name_or_path: Some(base_model_name_or_path.to_string()),
        })
        .expect("adapter config serialises")
    }

    /// Reads a PEFT `adapter_config.json`; options this implementation does not compute
    /// (rsLoRA, DoRA, bias training, per-module ranks...) are errors naming the key.
    pub fn from_peft_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let c: PeftAdapterConfig = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a PEFT LoRA adapter config", path.display()))?;
        let at = path.display();
        let unsupported = |key: &str, v: String| -> Result<()> {
            bail!("{at}: key `{key}` = {v} is not supported (only plain LoRA adapters load)")
        };
        if c.peft_type != "LORA" {
            unsupported("peft_type", c.peft_type.clone())?;
        }
        if c.use_rslora {
            unsupported("use_rslora", "true".into())?;
        }
        if c.use_dora {
            unsupported("use_dora", "true".into())?;
        }
        if c.fan_in_fan_out {
            unsupported("fan_in_fan_out", "true".into())?;
        }
        if c.bias != "none" {
            unsupported("bias", c.bias.clone())?;
        }
        if !c.rank_pattern.is_empty() {
            unsupported("rank_pattern", format!("{:?}", c.rank_pattern))?;
        }
        if !c.alpha_pattern.is_empty() {
            unsupported("alpha_pattern", format!("{:?}", c.alpha_pattern))?;
        }
        if c.layers_to_transform.as_ref().is_some_and(|v| !v.is_null()) {
            unsupported(
                "layers_to_transform",
                format!("{:?}", c.layers_to_transform),
            )?;
        }
        if c.modules_to_save.as_ref().is_some_and(|v| !v.is_null()) {
            unsupported("modules_to_save", format!("{:?}", c.modules_to_save))?;
        }
        let targets = match c.target_modules {
            TargetModules::List(l) => l,
            TargetModules::One(s) => vec![s],
        };
        LoraConfig::new(c.r, c.lora_alpha, c.lora_dropout, Some(&targets))
            .with_context(|| at.to_string())
    }
}

/// `target_modules` entries → module names, each checked against [`LINEAR_MODULES`].
fn resolve_targets(targets: &[String]) -> Result<Vec<String>> {
    if targets.iter().any(|t| t == "all-linear") {
        if targets.len() != 1 {
            bail!("key `lora_target_modules` = {targets:?}: \"all-linear\" must be the only entry");
        }
        return Ok(LINEAR_MODULES.iter().map(|s| s.to_string()).collect());
    }
    if targets.is_empty() {
        bail!("key `lora_target_modules` = []: allowed: module names among {LINEAR_MODULES:?}, or \"all-linear\"");
    }
    let mut out: Vec<String> = Vec::new();
    for t in targets {
        if !LINEAR_MODULES.contains(&t.as_str()) {
            bail!(
                "key `lora_target_modules`: unknown module {t:?}; allowed: {LINEAR_MODULES:?} or \"all-linear\""
            );
        }
        if !out.contains(t) {
            out.push(t.clone());
        }
    }
    Ok(out)
}

/// `target_modules` in PEFT's config: a list of names or one string.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum TargetModules {
    List(Vec<String>),
    One(String),
}

/// The `adapter_config.json` keys this implementation reads or writes (PEFT fills the rest
/// with its defaults; unknown keys of newer PEFT versions are ignored on reading).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct PeftAdapterConfig {
    peft_type: String,
    #[serde(default)]
    task_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    lora_dropout: f64,
    target_modules: TargetModules,
    #[serde(default = "bias_none")]
    bias: String,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    inference_mode: bool,
    #[serde(default)]
    init_lora_weights: serde_json::Value,
    #[serde(default)]
    layers_to_transform: Option<serde_json::Value>,
    #[serde(default)]
    modules_to_save: Option<serde_json::Value>,
    #[serde(default)]
    rank_pattern: HashMap<String, serde_json::Value>,
    #[serde(default)]
    alpha_pattern: HashMap<String, serde_json::Value>,
    #[serde(default)]
    pub(crate) base_model_name_or_path: Option<String>,
}

fn bias_none() -> String {
    "none".into()
}

/// One projection's adapter: `A: [r, in]`, `B: [out, r]`, scale `alpha / r`.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// `lora_A.weight`, `[r, in_features]`.
    pub lora_a: Tensor,
    /// `lora_B.weight`, `[out_features, r]`.
    pub lora_b: Tensor,
    /// `lora_alpha / r`.
    pub scaling: f64,
    /// Training-time dropout on the adapter input (None when `lora_dropout` = 0).
    pub dropout: Option<LoraDropout>,
}

/// Inverted dropout with its own seeded stream, shared by every adapter of a model, so a
/// training step's masks are a function of the seed the trainer sets
/// ([`Transformer::reseed_lora_dropout`](crate::Transformer::reseed_lora_dropout)).
#[derive(Debug, Clone)]
pub struct LoraDropout {
    /// Drop probability.
    pub p: f64,
    rng: Arc<Mutex<ChaCha8Rng>>,
}

impl LoraDropout {
    /// A dropout of probability `p` drawing from a ChaCha8 stream seeded by `seed`.
    pub(crate) fn new(p: f64, seed: u64) -> LoraDropout {
        LoraDropout {
            p,
            rng: Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(seed))),
        }
    }

    /// Restarts the (shared) stream from `seed`.
    pub(crate) fn reseed(&self, seed: u64) -> Result<()> {
        *self
            .rng
            .lock()
            .map_err(|_| anyhow::anyhow!("LoRA dropout RNG lock poisoned"))? =
            ChaCha8Rng::seed_from_u64(seed);
        Ok(())
    }

    /// A dropout on a copy of this one's stream at its current state: it draws exactly the
    /// masks this one draws next, without advancing it (a checkpointed layer's recomputation
    /// must see its forward's masks).
    pub(crate) fn fork(&self) -> Result<LoraDropout> {
        let rng = self
            .rng
            .lock()
            .map_err(|_| anyhow::anyhow!("LoRA dropout RNG lock poisoned"))?
            .clone();
        Ok(LoraDropout {
            p: self.p,
            rng: Arc::new(Mutex::new(rng)),
        })
    }

    /// `x` with each entry zeroed with probability `p` and the rest scaled by `1 / (1 − p)`.
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.elem_count();
        let keep = 1.0 - self.p;
        let scale = (1.0 / keep) as f32;
        let mask: Vec<f32> = {
            let mut rng = self
                .rng
                .lock()
                .map_err(|_| anyhow::anyhow!("LoRA dropout RNG lock poisoned"))?;
            (0..n)
                .map(|_| {
                    if rng.random::<f64>() < keep {
                        scale
                    } else {
                        0.0
                    }
                })
                .collect()
        };
        let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
        Ok((x * mask)?)
    }
}

impl LoraAdapter {
    /// The adapter's contribution `s · dropout(x) Aᵀ Bᵀ` for rows `x: [rows, in]`; dropout
    /// only when `train`.
    pub(crate) fn delta(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let x = match (&self.dropout, train) {
            (Some(d), true) => d.apply(x)?,
            _ => x.clone(),
        };
        let xa = x.matmul(&self.lora_a.t()?)?;
        Ok((xa.matmul(&self.lora_b.t()?)? * self.scaling)?)
    }

    /// [`Self::delta`] without dropout, its products
    /// [`crate::ops::linear_rows_invariant`]: each row's bits independent of the batch.
    pub(crate) fn delta_rows_invariant(&self, x: &Tensor) -> Result<Tensor> {
        let xa = crate::ops::linear_rows_invariant(x, &self.lora_a)?;
        Ok((crate::ops::linear_rows_invariant(&xa, &self.lora_b)? * self.scaling)?)
    }

    /// `s · B A`, the update merged into the base weight `[out, in]`.
    pub(crate) fn merged_update(&self) -> Result<Tensor> {
        Ok((self.lora_b.matmul(&self.lora_a)? * self.scaling)?)
    }
}

/// PEFT's tensor name of `which` (`lora_A` / `lora_B`) of the module `module`
/// (`model.layers.0.self_attn.q_proj`).
pub fn peft_tensor_name(module: &str, which: &str) -> String {
    format!("{PEFT_PREFIX}{module}.{which}.weight")
}
