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
//!
//! The adapter types and PEFT's config format are [`crate::lora_adapter`]'s (the decoder's
//! layers hold them); this module adds, attaches, reseeds, saves, loads, merges and exports
//! the adapters of a whole [`Transformer`].

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::checkpoint;
use crate::lora_adapter::PeftAdapterConfig;
pub use crate::lora_adapter::{
    peft_tensor_name, LoraAdapter, LoraConfig, LoraDropout, ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE, DEFAULT_TARGET_MODULES, LINEAR_MODULES,
};
use crate::transformer::{Linear, Transformer};

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
        let dropout = (cfg.dropout > 0.0).then(|| LoraDropout::new(cfg.dropout, dropout_seed));
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
                    d.reseed(seed)?;
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
