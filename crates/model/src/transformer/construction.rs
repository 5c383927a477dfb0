//! Building a [`Transformer`]: the module tree from a parameter source, which is a Hugging
//! Face checkpoint ([`Transformer::load`], [`Transformer::load_trainable`]), a `VarMap`
//! ([`Transformer::from_varmap`]) or a seeded random init ([`Transformer::random_init`]).

use super::layers::{Attention, DecoderLayer, Linear, Mlp, RmsNorm, Rope};
use super::{Model, Transformer};
use crate::checkpoint::{self, LoadedCheckpoint};
use crate::config::ModelConfig;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// Fetches (or creates) one named parameter of a given shape.
type ParamGetter<'a> = dyn FnMut(&str, &[usize], ParamInit) -> Result<Tensor> + 'a;

/// Where `build` gets each parameter from.
enum ParamInit {
    /// Normal(0, initializer_range) (projections, embeddings).
    Normal,
    /// Ones (norm weights).
    Ones,
    /// Zeros (biases).
    Zeros,
}

impl Transformer {
    /// Builds the module tree, asking `get(name, shape, init)` for each parameter.
    fn build(
        cfg: &ModelConfig,
        device: &Device,
        dtype: DType,
        get: &mut ParamGetter<'_>,
    ) -> Result<Self> {
        cfg.validate()?;
        // Library users get the fixed thread count too (the binary sets it in `main`).
        crate::threads::ensure_cpu_threads_configured();
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        let mut linear = |name: &str, out_f: usize, in_f: usize, bias: bool| -> Result<Linear> {
            Ok(Linear {
                weight: get(&format!("{name}.weight"), &[out_f, in_f], ParamInit::Normal)?,
                bias: if bias {
                    Some(get(&format!("{name}.bias"), &[out_f], ParamInit::Zeros)?)
                } else {
                    None
                },
                lora: None,
            })
        };
        let mut layer_linears = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layer_linears.push((
                linear(&format!("{p}.self_attn.q_proj"), nh * hd, h, cfg.qkv_bias())?,
                linear(
                    &format!("{p}.self_attn.k_proj"),
                    nkv * hd,
                    h,
                    cfg.qkv_bias(),
                )?,
                linear(
                    &format!("{p}.self_attn.v_proj"),
                    nkv * hd,
                    h,
                    cfg.qkv_bias(),
                )?,
                linear(&format!("{p}.self_attn.o_proj"), h, nh * hd, cfg.o_bias())?,
                linear(
                    &format!("{p}.mlp.gate_proj"),
                    cfg.intermediate_size,
                    h,
                    cfg.mlp_bias,
                )?,
                linear(
                    &format!("{p}.mlp.up_proj"),
                    cfg.intermediate_size,
                    h,
                    cfg.mlp_bias,
                )?,
                linear(
                    &format!("{p}.mlp.down_proj"),
                    h,
                    cfg.intermediate_size,
                    cfg.mlp_bias,
                )?,
            ));
        }
        let norm = |get: &mut ParamGetter<'_>, name: &str, dim: usize| -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: get(&format!("{name}.weight"), &[dim], ParamInit::Ones)?,
                eps: cfg.rms_norm_eps,
            })
        };
        let embed_tokens = get(
            "model.embed_tokens.weight",
            &[cfg.vocab_size, h],
            ParamInit::Normal,
        )?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, (q, k, v, o, g, u, d)) in layer_linears.into_iter().enumerate() {
            let p = format!("model.layers.{i}");
            let (q_norm, k_norm) = if cfg.qk_norm() {
                (
                    Some(norm(get, &format!("{p}.self_attn.q_norm"), hd)?),
                    Some(norm(get, &format!("{p}.self_attn.k_norm"), hd)?),
                )
            } else {
                (None, None)
            };
            layers.push(DecoderLayer {
                self_attn: Attention {
                    q_proj: q,
                    k_proj: k,
                    v_proj: v,
                    o_proj: o,
                    q_norm,
                    k_norm,
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: hd,
                },
                mlp: Mlp {
                    gate_proj: g,
                    up_proj: u,
                    down_proj: d,
                },
                input_layernorm: norm(get, &format!("{p}.input_layernorm"), h)?,
                post_attention_layernorm: norm(get, &format!("{p}.post_attention_layernorm"), h)?,
            });
        }
        let final_norm = norm(get, "model.norm", h)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            get("lm_head.weight", &[cfg.vocab_size, h], ParamInit::Normal)?
        };
        Ok(Transformer {
            cfg: cfg.clone(),
            model: Model {
                embed_tokens,
                layers,
                norm: final_norm,
            },
            lm_head,
            rope: Rope::new(cfg, device)?,
            device: device.clone(),
            dtype,
            source_shards: 1,
            lora: None,
            training_kernels: true,
            gradient_checkpointing: false,
        })
    }

    /// Loads config + weights from a Hugging Face checkpoint directory for inference
    /// (plain tensors in `dtype`, no gradient tracking).
    pub fn load(dir: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let mut ckpt = checkpoint::load_dir(dir, device)?;
        let shards = ckpt.num_shards;
        let mut m = Self::build(&cfg, device, dtype, &mut |name, shape, _| {
            ckpt.take(name, shape, dtype)
        })
        .with_context(|| format!("loading weights from {}", dir.display()))?;
        ckpt.check_no_extra_layers(cfg.num_hidden_layers)
            .with_context(|| format!("loading weights from {}", dir.display()))?;
        m.source_shards = shards;
        Ok(m)
    }

    /// Loads a checkpoint as trainable variables (`dtype`, normally f32 master weights):
    /// returns the model and the [`VarMap`] holding every parameter, keyed by checkpoint name.
    pub fn load_trainable(dir: &Path, device: &Device, dtype: DType) -> Result<(Self, VarMap)> {
        let cfg = ModelConfig::from_dir(dir)?;
        let mut ckpt: LoadedCheckpoint = checkpoint::load_dir(dir, device)?;
        let shards = ckpt.num_shards;
        let varmap = VarMap::new();
        let mut m = Self::build(&cfg, device, dtype, &mut |name, shape, _| {
            let t = ckpt.take(name, shape, dtype)?;
            insert_var(&varmap, name, &t)
        })
        .with_context(|| format!("loading weights from {}", dir.display()))?;
        ckpt.check_no_extra_layers(cfg.num_hidden_layers)
            .with_context(|| format!("loading weights from {}", dir.display()))?;
        m.source_shards = shards;
        Ok((m, varmap))
    }

    /// Builds a model whose weights are the variables of `varmap` (names as in the
    /// checkpoint); a missing or mis-shaped variable is an error naming it.
    pub fn from_varmap(cfg: &ModelConfig, varmap: &VarMap, device: &Device) -> Result<Self> {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("VarMap lock poisoned"))?;
        let mut dtype = None;
        let m = Self::build(cfg, device, DType::F32, &mut |name, shape, _| {
            let v = data
                .get(name)
                .with_context(|| format!("VarMap is missing variable `{name}`"))?;
            if v.dims() != shape {
                bail!(
                    "variable `{name}` has shape {:?}, expected {shape:?}",
                    v.dims()
                );
            }
            dtype.get_or_insert(v.dtype());
            Ok(v.as_tensor().clone())
        })?;
        Ok(Transformer {
            dtype: dtype.unwrap_or(DType::F32),
            ..m
        })
    }

    /// A randomly initialised model (HF-style: projections and embeddings ~ N(0,
    /// initializer_range), norms 1, biases 0), deterministic in `seed`, with f32 variables.
    pub fn random_init(cfg: &ModelConfig, seed: u64, device: &Device) -> Result<(Self, VarMap)> {
        let varmap = VarMap::new();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let std = cfg.initializer_range;
        let m = Self::build(cfg, device, DType::F32, &mut |name, shape, init| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = match init {
                ParamInit::Ones => vec![1.0; n],
                ParamInit::Zeros => vec![0.0; n],
                ParamInit::Normal => (0..n).map(|_| (normal(&mut rng) * std) as f32).collect(),
            };
            let t = Tensor::from_vec(data, shape, device)?;
            insert_var(&varmap, name, &t)
        })?;
        Ok((m, varmap))
    }

    /// A randomly initialised model drawn on `device` itself in `dtype` (same distributions
    /// as [`Transformer::random_init`], from the device's generator: not reproducible across
    /// devices). For benchmarks of large shapes, where drawing billions of numbers on the host
    /// and holding an f32 copy would take minutes and twice the memory.
    pub fn random_init_on_device(
        cfg: &ModelConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<(Self, VarMap)> {
        let varmap = VarMap::new();
        let std = cfg.initializer_range as f32;
        let m = Self::build(cfg, device, dtype, &mut |name, shape, init| {
            let t = match init {
                ParamInit::Ones => Tensor::ones(shape, dtype, device)?,
                ParamInit::Zeros => Tensor::zeros(shape, dtype, device)?,
                ParamInit::Normal => Tensor::randn(0f32, std, shape, device)?.to_dtype(dtype)?,
            };
            insert_var(&varmap, name, &t)
        })?;
        Ok((m, varmap))
    }
}

fn insert_var(varmap: &VarMap, name: &str, t: &Tensor) -> Result<Tensor> {
    let var = Var::from_tensor(t)?;
    let out = var.as_tensor().clone();
    varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("VarMap lock poisoned"))?
        .insert(name.to_string(), var);
    Ok(out)
}

/// Standard normal draw (Box–Muller), so `random_init` is reproducible from a seed.
fn normal(rng: &mut impl Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}
