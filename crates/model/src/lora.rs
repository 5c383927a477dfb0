//! LoRA adapters on the decoder's linear layers, with PEFT's semantics and file format.
//!
//! An adapted projection computes `y = x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ` with `A: [r, in]`,
//! `B: [out, r]` and `s = lora_alpha / r` (PEFT's `LoraLayer`, `use_rslora = False`). A new
//! adapter starts as PEFT's does: `A` kaiming-uniform with `a = √5` (uniform in ±1/√in), `B`
//! zeros, so the adapted model starts equal to the base model.
//!
//! The base weights are frozen (plain tensors, no gradient); only the adapter tensors are
//! variables, held in their own `VarMap` under PEFT's names
//! (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), so an optimizer over
//! that map trains and stores only the adapter. [`Transformer::save_lora`] writes PEFT's
//! `adapter_config.json` + `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained`
//! loads; [`Transformer::merge_lora`] folds the adapter into full weights for an HF export.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::checkpoint;
use crate::transformer::{Linear, Transformer};

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
struct PeftAdapterConfig {
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
    base_model_name_or_path: Option<String>,
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
/// ([`Transformer::reseed_lora_dropout`]).
#[derive(Debug, Clone)]
pub struct LoraDropout {
    /// Drop probability.
    pub p: f64,
    rng: Arc<Mutex<ChaCha8Rng>>,
}

impl LoraDropout {
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

    /// `s · B A`, the update merged into the base weight `[out, in]`.
    fn merged_update(&self) -> Result<Tensor> {
        Ok((self.lora_b.matmul(&self.lora_a)? * self.scaling)?)
    }
}

/// PEFT's tensor name of `which` (`lora_A` / `lora_B`) of the module `module`
/// (`model.layers.0.self_attn.q_proj`).
pub fn peft_tensor_name(module: &str, which: &str) -> String {
    format!("{PEFT_PREFIX}{module}.{which}.weight")
}

impl Transformer {
    /// The adapted projections: (module name, short name, the linear layer), in layer order.
    fn lora_linears_mut(&mut self) -> Vec<(String, &'static str, &mut Linear)> {
        let mut out = Vec::new();
        for (i, l) in self.model.layers.iter_mut().enumerate() {
            let a = &mut l.self_attn;
            let m = &mut l.mlp;
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.self_attn.q_proj"), "q_proj", &mut a.q_proj));
            out.push((format!("{p}.self_attn.k_proj"), "k_proj", &mut a.k_proj));
            out.push((format!("{p}.self_attn.v_proj"), "v_proj", &mut a.v_proj));
            out.push((format!("{p}.self_attn.o_proj"), "o_proj", &mut a.o_proj));
            out.push((format!("{p}.mlp.gate_proj"), "gate_proj", &mut m.gate_proj));
            out.push((format!("{p}.mlp.up_proj"), "up_proj", &mut m.up_proj));
            out.push((format!("{p}.mlp.down_proj"), "down_proj", &mut m.down_proj));
        }
        out
    }

    /// Freezes the base weights and adds fresh adapters (PEFT init: `A` kaiming-uniform from
    /// `seed`, `B` zeros). Returns the `VarMap` of the adapter variables (PEFT names): the
    /// only trainable parameters of the model from now on.
    pub fn add_lora(&mut self, cfg: &LoraConfig, seed: u64) -> Result<VarMap> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let varmap = VarMap::new();
        let device = self.device().clone();
        let dtype = self.dtype();
        {
            let mut data = varmap
                .data()
                .lock()
                .map_err(|_| anyhow::anyhow!("VarMap lock poisoned"))?;
            for (module, short, lin) in self.lora_linears_mut() {
                if !cfg.targets(short) {
                    continue;
                }
                let (out_f, in_f) = lin.weight.dims2()?;
                // kaiming_uniform_(a=√5): bound = √(6 / ((1 + a²) · fan_in)) = 1 / √fan_in.
                let bound = 1.0 / (in_f as f64).sqrt();
                let a: Vec<f32> = (0..cfg.r * in_f)
                    .map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * bound) as f32)
                    .collect();
                let a = Tensor::from_vec(a, (cfg.r, in_f), &device)?.to_dtype(dtype)?;
                let b = Tensor::zeros((out_f, cfg.r), dtype, &device)?;
                data.insert(peft_tensor_name(&module, "lora_A"), Var::from_tensor(&a)?);
                data.insert(peft_tensor_name(&module, "lora_B"), Var::from_tensor(&b)?);
            }
        }
        self.attach_lora(cfg, &varmap, seed)?;
        Ok(varmap)
    }

    /// Freezes the base weights and attaches the adapters whose tensors are the variables of
    /// `varmap` (PEFT names); a missing or mis-shaped tensor, or one no target uses, is an
    /// error naming it. Dropout draws start from `dropout_seed`.
    pub fn attach_lora(
        &mut self,
        cfg: &LoraConfig,
        varmap: &VarMap,
        dropout_seed: u64,
    ) -> Result<()> {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("VarMap lock poisoned"))?;
        let dropout = (cfg.dropout > 0.0).then(|| LoraDropout {
            p: cfg.dropout,
            rng: Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(dropout_seed))),
        });
        // Base weights become plain tensors: no gradient reaches them.
        *self = self.detached();
        let mut used = 0usize;
        for (module, short, lin) in self.lora_linears_mut() {
            lin.lora = None;
            if !cfg.targets(short) {
                continue;
            }
            let (out_f, in_f) = lin.weight.dims2()?;
            let get = |which: &str, shape: [usize; 2]| -> Result<Tensor> {
                let name = peft_tensor_name(&module, which);
                let v = data
                    .get(&name)
                    .with_context(|| format!("LoRA adapter is missing tensor `{name}`"))?;
                if v.dims() != shape {
                    bail!(
                        "LoRA tensor `{name}` has shape {:?}, expected {shape:?} (r = {})",
                        v.dims(),
                        cfg.r
                    );
                }
                Ok(v.as_tensor().clone())
            };
            lin.lora = Some(LoraAdapter {
                lora_a: get("lora_A", [cfg.r, in_f])?,
                lora_b: get("lora_B", [out_f, cfg.r])?,
                scaling: cfg.scaling(),
                dropout: dropout.clone(),
            });
            used += 2;
        }
        if used != data.len() {
            let mut extra: Vec<&String> = data
                .keys()
                .filter(|k| !self.lora_tensors().iter().any(|(n, _)| n == *k))
                .collect();
            extra.sort();
            bail!(
                "LoRA adapter has tensors for modules outside target_modules {:?}: {extra:?}",
                cfg.target_modules
            );
        }
        self.lora = Some(cfg.clone());
        Ok(())
    }

    /// Restarts the dropout stream of every adapter from `seed` (one stream per model).
    pub fn reseed_lora_dropout(&self, seed: u64) -> Result<()> {
        for l in &self.model.layers {
            for lin in [
                &l.self_attn.q_proj,
                &l.self_attn.k_proj,
                &l.self_attn.v_proj,
                &l.self_attn.o_proj,
                &l.mlp.gate_proj,
                &l.mlp.up_proj,
                &l.mlp.down_proj,
            ] {
                if let Some(d) = lin.lora.as_ref().and_then(|a| a.dropout.as_ref()) {
                    *d.rng
                        .lock()
                        .map_err(|_| anyhow::anyhow!("LoRA dropout RNG lock poisoned"))? =
                        ChaCha8Rng::seed_from_u64(seed);
                    // The stream is shared: one reseed covers every adapter.
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Every adapter tensor under its PEFT name, in layer order (empty without LoRA).
    pub fn lora_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, l) in self.model.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            for (name, lin) in [
                ("self_attn.q_proj", &l.self_attn.q_proj),
                ("self_attn.k_proj", &l.self_attn.k_proj),
                ("self_attn.v_proj", &l.self_attn.v_proj),
                ("self_attn.o_proj", &l.self_attn.o_proj),
                ("mlp.gate_proj", &l.mlp.gate_proj),
                ("mlp.up_proj", &l.mlp.up_proj),
                ("mlp.down_proj", &l.mlp.down_proj),
            ] {
                if let Some(a) = &lin.lora {
                    let m = format!("{p}.{name}");
                    out.push((peft_tensor_name(&m, "lora_A"), a.lora_a.clone()));
                    out.push((peft_tensor_name(&m, "lora_B"), a.lora_b.clone()));
                }
            }
        }
        out
    }

    /// Writes the adapter as PEFT does: `adapter_config.json` (with
    /// `base_model_name_or_path`) and `adapter_model.safetensors` (PEFT names, the model's
    /// dtype), atomically.
    pub fn save_lora(&self, dir: &Path, base_model_name_or_path: &str) -> Result<()> {
        let cfg = self
            .lora
            .as_ref()
            .context("save_lora: the model has no LoRA adapter")?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let tensors: Vec<(String, Tensor)> = self
            .lora_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.detach()))
            .collect();
        checkpoint::save_file(&dir.join(ADAPTER_WEIGHTS_FILE), &tensors)?;
        checkpoint::write_atomic(
            &dir.join(ADAPTER_CONFIG_FILE),
            serde_json::to_string_pretty(&cfg.to_peft_json(base_model_name_or_path))?.as_bytes(),
        )?;
        Ok(())
    }

    /// Attaches the PEFT adapter saved in `dir` (as variables of the returned `VarMap`, in
    /// the model's dtype, so it can be trained further).
    pub fn load_lora(&mut self, dir: &Path) -> Result<(LoraConfig, VarMap)> {
        let cfg = LoraConfig::from_peft_file(&dir.join(ADAPTER_CONFIG_FILE))?;
        let wp = dir.join(ADAPTER_WEIGHTS_FILE);
        let tensors = candle_core::safetensors::load(&wp, self.device())
            .with_context(|| format!("reading {}", wp.display()))?;
        let varmap = VarMap::new();
        {
            let mut data = varmap
                .data()
                .lock()
                .map_err(|_| anyhow::anyhow!("VarMap lock poisoned"))?;
            for (name, t) in tensors {
                data.insert(name, Var::from_tensor(&t.to_dtype(self.dtype())?)?);
            }
        }
        self.attach_lora(&cfg, &varmap, 0)
            .with_context(|| format!("loading the LoRA adapter {}", dir.display()))?;
        Ok((cfg, varmap))
    }

    /// The model with every adapter folded into its base weight (`W + s·B·A`, computed in
    /// f32) and no adapters: what `PeftModel.merge_and_unload()` returns.
    pub fn merge_lora(&self) -> Result<Transformer> {
        let mut m = self.detached();
        for (_, _, lin) in m.lora_linears_mut() {
            if let Some(a) = lin.lora.take() {
                let dtype = lin.weight.dtype();
                let w = lin.weight.to_dtype(DType::F32)?;
                let upd = LoraAdapter {
                    lora_a: a.lora_a.to_dtype(DType::F32)?,
                    lora_b: a.lora_b.to_dtype(DType::F32)?,
                    ..a
                }
                .merged_update()?;
                lin.weight = (w + upd)?.to_dtype(dtype)?;
            }
        }
        m.lora = None;
        Ok(m)
    }
}

/// Files of a checkpoint directory that describe the tokenizer side of the model (carried
/// into an export unchanged).
fn is_tokenizer_file(name: &str) -> bool {
    name.starts_with("tokenizer")
        || matches!(
            name,
            "chat_template.jinja"
                | "special_tokens_map.json"
                | "generation_config.json"
                | "vocab.json"
                | "merges.txt"
                | "added_tokens.json"
        )
}

/// Exports the LoRA adapter of `checkpoint` (a directory with `adapter_config.json`, e.g. a
/// LoRA run's checkpoint) into `out`: with `merge`, the base model named by its
/// `base_model_name_or_path` (relative to `checkpoint` when not absolute) with the adapter
/// folded in, as a full HF checkpoint in f32; without, the PEFT adapter files.
/// The tokenizer files of `checkpoint` are copied along.
pub fn export_adapter(checkpoint: &Path, out: &Path, merge: bool) -> Result<()> {
    let cp = checkpoint.join(ADAPTER_CONFIG_FILE);
    if !cp.is_file() {
        bail!(
            "{}: no {ADAPTER_CONFIG_FILE}; not a LoRA checkpoint (a full checkpoint is already an HF model directory)",
            checkpoint.display()
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    if merge {
        let conf: PeftAdapterConfig = serde_json::from_str(
            &std::fs::read_to_string(&cp).with_context(|| format!("reading {}", cp.display()))?,
        )
        .with_context(|| format!("{}: not a PEFT LoRA adapter config", cp.display()))?;
        let base = conf.base_model_name_or_path.with_context(|| {
            format!("{}: key `base_model_name_or_path` is missing", cp.display())
        })?;
        let base = checkpoint.join(base);
        let mut model = Transformer::load(&base, &candle_core::Device::Cpu, DType::F32)
            .with_context(|| format!("loading the base model named by {}", cp.display()))?;
        model.load_lora(checkpoint)?;
        model.merge_lora()?.save_pretrained(out)?;
    } else {
        for f in [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE] {
            copy_file(&checkpoint.join(f), &out.join(f))?;
        }
    }
    let entries = std::fs::read_dir(checkpoint)
        .with_context(|| format!("listing {}", checkpoint.display()))?;
    for e in entries {
        let e = e.with_context(|| format!("listing {}", checkpoint.display()))?;
        let name = e.file_name().to_string_lossy().to_string();
        if e.file_type()?.is_file() && is_tokenizer_file(&name) {
            copy_file(&e.path(), &out.join(&name))?;
        }
    }
    Ok(())
}

fn copy_file(from: &Path, to: &Path) -> Result<()> {
    let bytes = std::fs::read(from).with_context(|| format!("reading {}", from.display()))?;
    checkpoint::write_atomic(to, &bytes)
}
