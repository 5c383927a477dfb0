//! The policy the trainer optimises: composer-model's [`Transformer`] over a `VarMap` of f32
//! master weights (with `[train] bf16`, over a bf16 [`ComputeCopy`] of them; see
//! [`crate::mixed_precision`]). Two ways in, one forward pass:
//!
//! - an HF checkpoint (`[model] path`), loaded by composer-model with its tokenizer, chat
//!   template and every EOS id of `config.json` / `generation_config.json`;
//! - the built-in tiny model (`[model.builtin_tiny]`): a Qwen2-shaped [`ModelConfig`] filled
//!   from the recipe's keys, built by [`Transformer::random_init`] from a seed, with the
//!   character tokenizer of [`crate::tokenizer`] and the ChatML template.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use composer_model::lora::{ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use composer_model::{LoraConfig, ModelConfig, ModelType, Transformer};
use serde::{Deserialize, Serialize};

use crate::mixed_precision::{self, ComputeCopy};

/// Shape of the built-in tiny model (`[model.builtin_tiny]` in a recipe): a Qwen2-shaped
/// decoder (q/k/v bias, RMSNorm, RoPE, grouped-query attention, SwiGLU).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TinyConfig {
    /// Model width.
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention); must divide `heads`.
    pub kv_heads: usize,
    /// SwiGLU inner width.
    pub intermediate_size: usize,
    /// RoPE base.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    /// Std of the normal initialisation (`initializer_range`).
    #[serde(default = "default_init_std")]
    pub init_std: f64,
    /// Longest sequence the model is used with (written to config.json).
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Share the embedding matrix with the LM head.
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn default_rope_theta() -> f64 {
    10000.0
}
fn default_rms_eps() -> f64 {
    1e-5
}
fn default_init_std() -> f64 {
    0.02
}
fn default_max_pos() -> usize {
    256
}

impl TinyConfig {
    /// The composer-model config of this shape (Qwen2 family) for a vocabulary of
    /// `vocab_size` tokens whose end-of-text token is `eos`.
    pub fn model_config(&self, vocab_size: usize, eos: u32) -> Result<ModelConfig> {
        let c = self;
        if c.hidden_size == 0
            || c.layers == 0
            || c.heads == 0
            || c.kv_heads == 0
            || c.intermediate_size == 0
        {
            bail!("key `[model.builtin_tiny]`: hidden_size, layers, heads, kv_heads and intermediate_size must be > 0");
        }
        if !c.hidden_size.is_multiple_of(c.heads) || !(c.hidden_size / c.heads).is_multiple_of(2) {
            bail!(
                "key `[model.builtin_tiny] hidden_size`: {} must be divisible by heads ({}) with an even head size",
                c.hidden_size,
                c.heads
            );
        }
        if !c.heads.is_multiple_of(c.kv_heads) {
            bail!(
                "key `[model.builtin_tiny] kv_heads`: {} must divide heads ({})",
                c.kv_heads,
                c.heads
            );
        }
        let cfg = ModelConfig {
            model_type: ModelType::Qwen2,
            vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_hidden_layers: c.layers,
            num_attention_heads: c.heads,
            num_key_value_heads: c.kv_heads,
            head_dim: c.hidden_size / c.heads,
            max_position_embeddings: c.max_position_embeddings,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
            tie_word_embeddings: c.tie_word_embeddings,
            attention_bias: false,
            mlp_bias: false,
            initializer_range: c.init_std,
            bos_token_id: None,
            eos_token_ids: vec![eos],
            pad_token_id: Some(eos),
        };
        cfg.validate()
            .context("key `[model.builtin_tiny]`: invalid shape")?;
        Ok(cfg)
    }
}

/// The trainable policy: the transformer, its f32 variables, and where it came from.
pub struct PolicyModel {
    /// The decoder; its tensors are the `varmap`'s variables, or with a compute copy
    /// (`[train] bf16`) the copy's.
    pub transformer: Transformer,
    /// All trainable variables, by HF name; with LoRA only the adapters (PEFT names), the
    /// base weights being frozen tensors of `transformer`. The f32 master weights the
    /// optimizer updates and checkpoints store (a [`PolicyModel::sampling_copy`] of a bf16
    /// policy holds bf16 values here: it is never trained).
    pub varmap: VarMap,
    /// `[train] bf16`: the bf16 variables the forward and backward run on; None in f32.
    compute: Option<ComputeCopy>,
    /// The HF checkpoint directory it was loaded from (tokenizer files, chat template and
    /// generation config are copied from it into checkpoints); None for the built-in model.
    pub source_dir: Option<PathBuf>,
    /// `[train] padding_free`: teacher-forcing forwards pack a batch's rows without padding
    /// ([`crate::batch::token_stats`]); the same values, no FLOPs on padding.
    pub padding_free: bool,
}

/// The `mix_seed` index of the LoRA streams (apart from sampling's): the adapters' init is
/// `mix_seed(seed, LORA_SEED_STREAM, 0)`, the dropout masks of RL step `k` (1-based)
/// `mix_seed(seed, k, LORA_SEED_STREAM)` and of the warm-up step 0's.
pub const LORA_SEED_STREAM: u64 = u64::MAX - 7;

impl PolicyModel {
    /// A randomly initialised model of `cfg`, deterministic in `seed`.
    pub fn random_init(cfg: &ModelConfig, seed: u64, device: &Device) -> Result<Self> {
        let (transformer, varmap) = Transformer::random_init(cfg, seed, device)?;
        Ok(Self {
            transformer,
            varmap,
            compute: None,
            source_dir: None,
            padding_free: false,
        })
    }

    /// Loads an HF checkpoint directory with trainable f32 weights.
    pub fn load_hf(dir: &Path, device: &Device) -> Result<Self> {
        let (transformer, varmap) = Transformer::load_trainable(dir, device, DType::F32)
            .with_context(|| format!("loading HF checkpoint {}", dir.display()))?;
        Ok(Self {
            transformer,
            varmap,
            compute: None,
            source_dir: Some(dir.to_path_buf()),
            padding_free: false,
        })
    }

    /// `[model] use_peft = true`: freezes the weights and makes fresh LoRA adapters (`A` from
    /// the recipe's `seed`, `B` = 0; see [`LORA_SEED_STREAM`]) the only trainable variables.
    /// Returns the absolute directory of the frozen base (`base_model_name_or_path` of the checkpoints' adapter_config.json): the
    /// recipe's HF directory `hf_path`, or for the built-in model (which exists only in
    /// memory) `RUN_DIR/base_model`, written here so that PEFT and `export --merge` can load
    /// the base the adapters belong to.
    pub fn enable_lora(
        &mut self,
        cfg: &LoraConfig,
        seed: u64,
        hf_path: Option<&Path>,
        run_dir: &Path,
    ) -> Result<PathBuf> {
        if self.compute.is_some() {
            bail!("LoRA adapters must be added before the compute dtype is set");
        }
        let base = match hf_path {
            Some(p) => p.to_path_buf(),
            None => {
                // A function of the seed: rewriting it on resume writes the same bytes.
                let b = run_dir.join(crate::checkpoint::LORA_BASE_DIR);
                self.transformer
                    .save_pretrained(&b)
                    .with_context(|| format!("writing the LoRA base model {}", b.display()))?;
                b
            }
        };
        let init_seed = crate::seed::mix_seed(seed, LORA_SEED_STREAM, 0);
        self.varmap = self.transformer.add_lora(cfg, init_seed)?;
        // add_lora starts the dropout masks from the init seed: the warm-up's come from a
        // stream of their own, not from A's values again.
        self.transformer
            .reseed_lora_dropout(crate::seed::mix_seed(seed, 0, LORA_SEED_STREAM))?;
        std::path::absolute(&base).with_context(|| format!("resolving {}", base.display()))
    }

    /// The LoRA config when adapters are trained.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.transformer.lora.as_ref()
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.transformer.cfg
    }

    /// Vocabulary size (rows of the embedding).
    pub fn vocab_size(&self) -> usize {
        self.transformer.cfg.vocab_size
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        self.transformer.device()
    }

    /// Differentiable final hidden states `[B, T, hidden]` for right-padded ids `[B, T]`;
    /// the LM head runs fused with the log-probs ([`crate::batch::token_stats`]).
    pub fn hidden(&self, ids: &Tensor) -> Result<Tensor> {
        self.transformer.forward_hidden(ids, None, None, true)
    }

    /// `[train] bf16`: from now on the forward and backward run on a copy of the variables
    /// in `dtype` (a frozen LoRA base is cast once, here); the variables stay the f32
    /// masters. Call after [`PolicyModel::enable_lora`]; with LoRA the adapters' dropout
    /// restarts at the warm-up stream of `seed`, as after it. `DType::F32` changes nothing.
    pub fn set_compute_dtype(&mut self, dtype: DType, seed: u64) -> Result<()> {
        if dtype == DType::F32 {
            return Ok(());
        }
        if self.compute.is_some() {
            bail!(
                "the policy already computes in {:?}",
                self.transformer.dtype()
            );
        }
        let compute = ComputeCopy::of(&self.varmap, dtype)?;
        let mut transformer = match self.lora() {
            Some(cfg) => {
                let mut t = self.transformer.to_dtype(dtype)?;
                t.attach_lora(cfg, &compute.varmap, 0)?;
                t.reseed_lora_dropout(crate::seed::mix_seed(seed, 0, LORA_SEED_STREAM))?;
                t
            }
            None => Transformer::from_varmap(self.config(), &compute.varmap, self.device())?,
        };
        transformer.gradient_checkpointing = self.transformer.gradient_checkpointing;
        transformer.training_kernels = self.transformer.training_kernels;
        transformer.source_shards = self.transformer.source_shards;
        self.transformer = transformer;
        self.compute = Some(compute);
        Ok(())
    }

    /// The dtype the forward and backward run in (bf16 with `[train] bf16`, else f32).
    pub fn compute_dtype(&self) -> DType {
        self.transformer.dtype()
    }

    /// Casts the f32 masters into the compute copy again (nothing without one): after every
    /// change of the masters (an optimizer step, loaded weights, an EMA update).
    pub fn refresh_compute(&self) -> Result<()> {
        match &self.compute {
            Some(c) => c.refresh(&self.varmap),
            None => Ok(()),
        }
    }

    /// The gradient of every trainable variable in `store` (from a loss's backward), in f32
    /// and keyed by the master's name: with a compute copy its bf16 gradients cast to f32.
    pub fn master_grads(&self, store: &GradStore) -> Result<HashMap<String, Tensor>> {
        match &self.compute {
            Some(c) => c.master_grads(store),
            None => mixed_precision::direct_grads(&self.varmap, store),
        }
    }

    /// An independent copy of the weights (one copy of every tensor, the f32 masters and, in
    /// bf16, a compute copy of them): the frozen reference policy, whose masters an EMA
    /// (`sync_ref_model`) updates in f32.
    pub fn snapshot(&self) -> Result<PolicyModel> {
        let varmap = copy_vars(&self.varmap)?;
        let compute = match &self.compute {
            Some(c) => Some(ComputeCopy::of(&varmap, c.dtype)?),
            None => None,
        };
        let transformer = self.frozen_over(compute.as_ref().map_or(&varmap, |c| &c.varmap))?;
        Ok(PolicyModel {
            transformer,
            varmap,
            compute,
            source_dir: self.source_dir.clone(),
            padding_free: self.padding_free,
        })
    }

    /// The weights rollouts sample with, as an independent copy: what the trainer publishes
    /// to an async generator. In f32 a [`PolicyModel::snapshot`]; in bf16 a copy of the
    /// compute variables only (the values the synchronous loop samples with), which its
    /// `varmap` holds: a sampling copy is never trained.
    pub fn sampling_copy(&self) -> Result<PolicyModel> {
        let Some(c) = &self.compute else {
            return self.snapshot();
        };
        let varmap = copy_vars(&c.varmap)?;
        Ok(PolicyModel {
            transformer: self.frozen_over(&varmap)?,
            varmap,
            compute: None,
            source_dir: self.source_dir.clone(),
            padding_free: self.padding_free,
        })
    }

    /// A transformer over `vars` (this model's variable names, in the compute dtype) that is
    /// never trained.
    fn frozen_over(&self, vars: &VarMap) -> Result<Transformer> {
        match self.lora() {
            // The frozen base is shared (never written); only the adapter is copied. A copy
            // is never trained, so it has no dropout (TRL's reference model has none either):
            // its log-probs are a function of its weights alone, and a resumed run's
            // reference scores exactly as the uninterrupted run's.
            Some(cfg) => {
                let frozen = LoraConfig {
                    dropout: 0.0,
                    ..cfg.clone()
                };
                let mut t = self.transformer.clone();
                t.attach_lora(&frozen, vars, 0)?;
                Ok(t)
            }
            None => Transformer::from_varmap(self.config(), vars, self.device()),
        }
    }

    /// Every weight by name (shares storage with the variables).
    pub fn weights(&self) -> Result<Vec<(String, Tensor)>> {
        let data = lock(&self.varmap)?;
        let mut out: Vec<(String, Tensor)> = data
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Overwrites every weight from `tensors` (by name); a missing or mis-shaped tensor is
    /// an error naming it and `origin`.
    pub fn set_weights(&self, tensors: &HashMap<String, Tensor>, origin: &Path) -> Result<()> {
        let data = lock(&self.varmap)?;
        for (name, var) in data.iter() {
            let t = tensors
                .get(name)
                .with_context(|| format!("{}: missing tensor {name}", origin.display()))?;
            if t.dims() != var.dims() {
                bail!(
                    "{}: tensor {name} has shape {:?}, expected {:?}",
                    origin.display(),
                    t.dims(),
                    var.dims()
                );
            }
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
        }
        drop(data);
        self.refresh_compute()
    }

    /// The file of a checkpoint directory holding the trainable weights: PEFT's
    /// `adapter_model.safetensors` with LoRA, else `model.safetensors`.
    pub fn weights_file(&self, dir: &Path) -> PathBuf {
        if self.lora().is_some() {
            dir.join(ADAPTER_WEIGHTS_FILE)
        } else {
            dir.join("model.safetensors")
        }
    }

    /// PEFT's `adapter_config.json` of the adapters (None without LoRA), naming `base` as
    /// `base_model_name_or_path`.
    pub fn adapter_config(&self, base: &Path) -> Option<serde_json::Value> {
        self.lora().map(|c| c.to_peft_json(&base.to_string_lossy()))
    }

    /// Checks that a checkpoint's adapter matches this model's LoRA config (rank, alpha,
    /// targets): resuming with other `lora_*` keys is an error naming the file.
    pub fn check_adapter_config(&self, dir: &Path) -> Result<()> {
        let Some(cfg) = self.lora() else {
            return Ok(());
        };
        let p = dir.join(ADAPTER_CONFIG_FILE);
        let saved = LoraConfig::from_peft_file(&p)?;
        if (saved.r, saved.alpha, &saved.target_modules) != (cfg.r, cfg.alpha, &cfg.target_modules)
        {
            bail!(
                "{}: adapter r = {}, lora_alpha = {}, target_modules = {:?} differ from the recipe's {}, {}, {:?}",
                p.display(),
                saved.r,
                saved.alpha,
                saved.target_modules,
                cfg.r,
                cfg.alpha,
                cfg.target_modules
            );
        }
        Ok(())
    }

    /// Loads weights from a safetensors file with HF names (a checkpoint's model or
    /// reference weights).
    pub fn load_weights(&self, path: &Path) -> Result<()> {
        let tensors = candle_core::safetensors::load(path, self.device())
            .with_context(|| format!("reading weights {}", path.display()))?;
        self.set_weights(&tensors, path)
    }
}

/// A new `VarMap` with a copy of every variable of `src`.
fn copy_vars(src: &VarMap) -> Result<VarMap> {
    let varmap = VarMap::new();
    {
        let src = lock(src)?;
        let mut dst = lock(&varmap)?;
        for (name, var) in src.iter() {
            // `detach` shares the storage; `Var::from_tensor` of a non-variable copies it.
            dst.insert(name.clone(), Var::from_tensor(&var.as_tensor().detach())?);
        }
    }
    Ok(varmap)
}

fn lock(v: &VarMap) -> Result<std::sync::MutexGuard<'_, HashMap<String, Var>>> {
    v.data()
        .lock()
        .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))
}
