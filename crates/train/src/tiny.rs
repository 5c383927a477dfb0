//! The built-in tiny policy: a Llama-architecture decoder (RMSNorm, RoPE, grouped-query
//! attention, SwiGLU MLP, untied lm_head) whose weights live in a `VarMap` under Hugging Face
//! Llama names (`model.layers.0.self_attn.q_proj.weight`, ...), so `save` writes a checkpoint
//! that transformers loads as `LlamaForCausalLM`.
//!
//! Every op on the training path is a differentiable composition (candle's fused rms_norm /
//! rope / softmax have no backward). Initialisation draws from a ChaCha RNG seeded by the
//! recipe seed, so the same seed gives bit-identical weights.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::VarMap;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Shape of the built-in tiny model (`[model.builtin_tiny]` in a recipe).
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
    /// Std of the normal initialisation.
    #[serde(default = "default_init_std")]
    pub init_std: f64,
    /// Longest sequence the model is used with (written to config.json).
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
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

/// A tiny Llama decoder over a `VarMap` (f32 master weights).
pub struct TinyModel {
    /// Shape.
    pub cfg: TinyConfig,
    /// Vocabulary size (from the tokenizer).
    pub vocab_size: usize,
    /// All trainable variables, by HF name.
    pub varmap: VarMap,
    device: Device,
    /// An HF checkpoint loaded through composer-model (then `cfg` is informational).
    hf: Option<HfBackbone>,
}

/// A Hugging Face checkpoint loaded through composer-model, with trainable f32 variables.
pub struct HfBackbone {
    /// The transformer (its tensors share storage with the `VarMap`'s variables).
    pub transformer: composer_model::Transformer,
    /// Its config.
    pub config: composer_model::ModelConfig,
    /// The checkpoint directory (tokenizer_config.json, chat template are copied from it).
    pub source_dir: std::path::PathBuf,
}

impl TinyModel {
    /// Names and shapes of every weight, in HF Llama layout.
    pub fn weight_shapes(cfg: &TinyConfig, vocab: usize) -> Vec<(String, Vec<usize>)> {
        let d = cfg.hidden_size;
        let hd = d / cfg.heads;
        let kv = cfg.kv_heads * hd;
        let mut w = vec![("model.embed_tokens.weight".to_string(), vec![vocab, d])];
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            w.push((format!("{p}.input_layernorm.weight"), vec![d]));
            w.push((format!("{p}.self_attn.q_proj.weight"), vec![d, d]));
            w.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, d]));
            w.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, d]));
            w.push((format!("{p}.self_attn.o_proj.weight"), vec![d, d]));
            w.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
            w.push((
                format!("{p}.mlp.gate_proj.weight"),
                vec![cfg.intermediate_size, d],
            ));
            w.push((
                format!("{p}.mlp.up_proj.weight"),
                vec![cfg.intermediate_size, d],
            ));
            w.push((
                format!("{p}.mlp.down_proj.weight"),
                vec![d, cfg.intermediate_size],
            ));
        }
        w.push(("model.norm.weight".to_string(), vec![d]));
        w.push(("lm_head.weight".to_string(), vec![vocab, d]));
        w
    }

    /// Randomly initialised model: norms at 1, matrices N(0, init_std²) from ChaCha8(seed).
    pub fn random_init(
        cfg: &TinyConfig,
        vocab_size: usize,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        validate(cfg)?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let varmap = VarMap::new();
        {
            let mut data = varmap
                .data()
                .lock()
                .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))?;
            for (name, shape) in Self::weight_shapes(cfg, vocab_size) {
                let n: usize = shape.iter().product();
                let values: Vec<f32> = if shape.len() == 1 {
                    vec![1.0; n]
                } else {
                    rand_distr_normal(&mut rng, n, cfg.init_std)
                };
                let t = Tensor::from_vec(values, shape, device)?;
                data.insert(name, Var::from_tensor(&t)?);
            }
        }
        Ok(Self {
            cfg: cfg.clone(),
            vocab_size,
            varmap,
            device: device.clone(),
            hf: None,
        })
    }

    /// Load an HF checkpoint directory with trainable f32 weights (composer-model's loader).
    pub fn load_hf(dir: &Path, device: &Device) -> Result<Self> {
        let (transformer, varmap) =
            composer_model::Transformer::load_trainable(dir, device, DType::F32)
                .with_context(|| format!("loading HF checkpoint {}", dir.display()))?;
        let config = transformer.cfg.clone();
        let cfg = TinyConfig {
            hidden_size: config.hidden_size,
            layers: config.num_hidden_layers,
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            intermediate_size: config.intermediate_size,
            rope_theta: config.rope_theta,
            rms_norm_eps: config.rms_norm_eps,
            init_std: default_init_std(),
            max_position_embeddings: config.max_position_embeddings,
        };
        Ok(Self {
            cfg,
            vocab_size: config.vocab_size,
            varmap,
            device: device.clone(),
            hf: Some(HfBackbone {
                transformer,
                config,
                source_dir: dir.to_path_buf(),
            }),
        })
    }

    /// An independent copy of the weights (one copy of every tensor, nothing else): what the
    /// trainer publishes to the generator in async mode, since its own weights keep changing
    /// in place under the optimizer.
    pub fn snapshot(&self) -> Result<TinyModel> {
        let varmap = VarMap::new();
        {
            let src = self
                .varmap
                .data()
                .lock()
                .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))?;
            let mut dst = varmap
                .data()
                .lock()
                .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))?;
            for (name, var) in src.iter() {
                // `detach` shares the storage; `Var::from_tensor` of a non-variable copies it.
                dst.insert(name.clone(), Var::from_tensor(&var.as_tensor().detach())?);
            }
        }
        let hf = match &self.hf {
            Some(h) => Some(HfBackbone {
                transformer: composer_model::Transformer::from_varmap(
                    &h.config,
                    &varmap,
                    &self.device,
                )?,
                config: h.config.clone(),
                source_dir: h.source_dir.clone(),
            }),
            None => None,
        };
        Ok(TinyModel {
            cfg: self.cfg.clone(),
            vocab_size: self.vocab_size,
            varmap,
            device: self.device.clone(),
            hf,
        })
    }

    /// The HF backbone, when this policy was loaded from a checkpoint.
    pub fn hf(&self) -> Option<&HfBackbone> {
        self.hf.as_ref()
    }

    /// Load weights from a `model.safetensors` written by [`TinyModel::save_weights`].
    pub fn load_weights(&self, path: &Path) -> Result<()> {
        let tensors = candle_core::safetensors::load(path, &self.device)
            .with_context(|| format!("reading weights {}", path.display()))?;
        let data = self
            .varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))?;
        for (name, var) in data.iter() {
            let t = tensors
                .get(name)
                .with_context(|| format!("{}: missing tensor {name}", path.display()))?;
            if t.dims() != var.dims() {
                bail!(
                    "{}: tensor {name} has shape {:?}, expected {:?}",
                    path.display(),
                    t.dims(),
                    var.dims()
                );
            }
            var.set(&t.to_dtype(DType::F32)?)?;
        }
        Ok(())
    }

    /// Write all weights to `path` (safetensors, HF names).
    pub fn save_weights(&self, path: &Path) -> Result<()> {
        self.varmap
            .save(path)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// HF `config.json` for this model (LlamaForCausalLM).
    pub fn hf_config(&self, bos: u32, eos: u32) -> serde_json::Value {
        if let Some(h) = &self.hf {
            return h.config.to_hf_json("float32");
        }
        let c = &self.cfg;
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.layers,
            "num_attention_heads": c.heads,
            "num_key_value_heads": c.kv_heads,
            "head_dim": c.hidden_size / c.heads,
            "hidden_act": "silu",
            "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": false,
            "attention_bias": false,
            "mlp_bias": false,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        })
    }

    fn w(&self, name: &str) -> Result<Tensor> {
        let data = self
            .varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))?;
        Ok(data
            .get(name)
            .with_context(|| format!("missing weight {name}"))?
            .as_tensor()
            .clone())
    }

    /// Logits `[B, T, V]` for right-padded token ids `[B, T]` (causal; padding at the end of a
    /// row never influences earlier positions). Differentiable with respect to every weight.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if let Some(h) = &self.hf {
            return h.transformer.forward_train(ids, None);
        }
        let (b, t) = ids.dims2()?;
        let c = &self.cfg;
        let d = c.hidden_size;
        let hd = d / c.heads;
        let (cos, sin) = rope_tables(t, hd, c.rope_theta, &self.device)?;
        let mask = causal_mask(t, &self.device)?;
        let emb = self.w("model.embed_tokens.weight")?;
        let mut x = emb
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, d))?;
        for l in 0..c.layers {
            let p = format!("model.layers.{l}");
            let h = rms_norm(
                &x,
                &self.w(&format!("{p}.input_layernorm.weight"))?,
                c.rms_norm_eps,
            )?;
            let q = linear(&h, &self.w(&format!("{p}.self_attn.q_proj.weight"))?)?;
            let k = linear(&h, &self.w(&format!("{p}.self_attn.k_proj.weight"))?)?;
            let v = linear(&h, &self.w(&format!("{p}.self_attn.v_proj.weight"))?)?;
            let q = q.reshape((b, t, c.heads, hd))?.transpose(1, 2)?;
            let k = k.reshape((b, t, c.kv_heads, hd))?.transpose(1, 2)?;
            let v = v
                .reshape((b, t, c.kv_heads, hd))?
                .transpose(1, 2)?
                .contiguous()?;
            let q = apply_rope(&q, &cos, &sin)?;
            let k = apply_rope(&k, &cos, &sin)?;
            let rep = c.heads / c.kv_heads;
            let (k, v) = if rep > 1 {
                (repeat_kv(&k, rep)?, repeat_kv(&v, rep)?)
            } else {
                (k, v)
            };
            let scores =
                (q.contiguous()?.matmul(&k.transpose(2, 3)?.contiguous()?)? / (hd as f64).sqrt())?;
            let scores = scores.broadcast_add(&mask)?;
            let attn = softmax_last(&scores)?;
            let o = attn.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
            let o = linear(&o, &self.w(&format!("{p}.self_attn.o_proj.weight"))?)?;
            x = (x + o)?;
            let h = rms_norm(
                &x,
                &self.w(&format!("{p}.post_attention_layernorm.weight"))?,
                c.rms_norm_eps,
            )?;
            let g = linear(&h, &self.w(&format!("{p}.mlp.gate_proj.weight"))?)?;
            let u = linear(&h, &self.w(&format!("{p}.mlp.up_proj.weight"))?)?;
            let act = (candle_nn::ops::silu(&g)? * u)?;
            let m = linear(&act, &self.w(&format!("{p}.mlp.down_proj.weight"))?)?;
            x = (x + m)?;
        }
        let x = rms_norm(&x, &self.w("model.norm.weight")?, c.rms_norm_eps)?;
        linear(&x, &self.w("lm_head.weight")?)
    }

    /// Logits for decoding: HF checkpoints use composer-model's fused inference forward; the
    /// tiny model's result is detached so no graph is kept.
    pub fn forward_inference(&self, ids: &Tensor) -> Result<Tensor> {
        if let Some(h) = &self.hf {
            return h.transformer.forward(ids, None);
        }
        Ok(self.forward(ids)?.detach())
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

fn validate(cfg: &TinyConfig) -> Result<()> {
    if cfg.hidden_size == 0
        || cfg.layers == 0
        || cfg.heads == 0
        || cfg.kv_heads == 0
        || cfg.intermediate_size == 0
    {
        bail!("model.builtin_tiny: hidden_size, layers, heads, kv_heads and intermediate_size must be > 0");
    }
    if !cfg.hidden_size.is_multiple_of(cfg.heads)
        || !(cfg.hidden_size / cfg.heads).is_multiple_of(2)
    {
        bail!("model.builtin_tiny: hidden_size ({}) must be divisible by heads ({}) with an even head size", cfg.hidden_size, cfg.heads);
    }
    if !cfg.heads.is_multiple_of(cfg.kv_heads) {
        bail!(
            "model.builtin_tiny: kv_heads ({}) must divide heads ({})",
            cfg.kv_heads,
            cfg.heads
        );
    }
    Ok(())
}

/// Box-Muller normal draws (std `std`), deterministic in `rng`.
fn rand_distr_normal(rng: &mut ChaCha8Rng, n: usize, std: f64) -> Vec<f32> {
    use rand::Rng;
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random::<f64>().max(1e-12);
            let u2: f64 = rng.random::<f64>();
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * std) as f32
        })
        .collect()
}

/// `x @ w^T` for `x` `[B, T, in]`, `w` `[out, in]`.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.broadcast_matmul(&w.t()?)?)
}

/// Differentiable RMSNorm: x / sqrt(mean(x²) + eps) * w.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&r)?.broadcast_mul(w)?)
}

/// Differentiable softmax over the last dim: exp(x - max.detach()) / sum.
fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

fn causal_mask(t: usize, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Tensor::from_vec(m, (1, 1, t, t), device)?)
}

fn rope_tables(t: usize, hd: usize, theta: f64, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = hd / 2;
    let mut cos = Vec::with_capacity(t * hd);
    let mut sin = Vec::with_capacity(t * hd);
    for pos in 0..t {
        for i in 0..hd {
            let f = 1.0 / theta.powf((2 * (i % half)) as f64 / hd as f64);
            let a = pos as f64 * f;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (1, 1, t, hd), device)?,
        Tensor::from_vec(sin, (1, 1, t, hd), device)?,
    ))
}

/// HF Llama rotate-half RoPE: x*cos + rotate_half(x)*sin, via narrow/cat (differentiable).
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(D::Minus1)?;
    let half = hd / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rot.broadcast_mul(sin)?)?)
}

fn repeat_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    let (b, h, t, hd) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, h, rep, t, hd))?
        .contiguous()?
        .reshape((b, h * rep, t, hd))?)
}
