//! Decoder-only transformer for the Llama, Qwen2 and Qwen3 families (one module; packed
//! sequences and gradient checkpointing in its `packed` and `checkpointing` submodules).
//!
//! Family traits (all share: token embedding, pre-norm RMSNorm decoder layers, rotary
//! position embedding with `rope_theta` (rotate-half layout), grouped-query attention,
//! SwiGLU MLP `down(silu(gate(x)) * up(x))`, final RMSNorm, LM head):
//! - **Llama**: no biases unless `attention_bias` (q/k/v/o) / `mlp_bias`; LM head usually untied.
//! - **Qwen2**: bias on q/k/v (never on o_proj); usually tied LM head.
//! - **Qwen3**: no q/k/v bias, per-head RMSNorm `q_norm`/`k_norm` over `head_dim` applied
//!   before RoPE, explicit `head_dim` (may differ from hidden/heads).
//!
//! The structs mirror checkpoint module names (`model.layers.N.self_attn.q_proj`, ...), so
//! the weight layout is the code layout. Weights are immutable during a forward; the KV cache
//! is a value ([`KvCache`]) the caller owns and passes in.
//!
//! Two forward paths share this code: the inference path ([`Transformer::forward`]) uses
//! candle-nn's fused kernels (rms_norm, rope, softmax), which have no backward; the training
//! path ([`Transformer::forward_train`]) uses the ops of [`crate::ops`] with a backward (on the
//! CPU in f32/f64: custom kernels, attention over the batch packed as variable-length
//! segments; elsewhere: the same maths composed from differentiable candle ops).
//! The training path also takes sequences packed without padding
//! ([`Transformer::forward_hidden_packed`], `packed`) and can recompute each layer's
//! activations in the backward instead of keeping them (`gradient_checkpointing`,
//! `checkpointing`).

use crate::checkpoint::{self, LoadedCheckpoint};
use crate::config::ModelConfig;
pub use crate::kv_cache::KvCache;
use crate::kv_cache::LayerKv;
use crate::lora_adapter::{LoraAdapter, LoraConfig};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use rand::{Rng, SeedableRng};
use std::path::Path;

mod checkpointing;
mod packed;
pub use packed::PackedBatch;

/// Which implementation of the non-matmul ops a forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpPath {
    /// candle-nn fused kernels (no backward): rollouts and scoring.
    Fused,
    /// Differentiable compositions of candle ops: training where no kernel applies (e.g.
    /// f16), f64 with a cache.
    Differentiable,
    /// The custom ops of [`crate::ops`] (with a backward): training without a KV cache on
    /// the CPU (f32/f64; attention over packed segments) and on CUDA (f32/bf16; attention over
    /// the padded batch with the fused masked softmax, as CUDA has no varlen kernel yet).
    Kernels,
}

/// Fetches (or creates) one named parameter of a given shape.
type ParamGetter<'a> = dyn FnMut(&str, &[usize], ParamInit) -> Result<Tensor> + 'a;

/// `y = x Wᵀ + b`, weights stored `[out, in]` as in PyTorch.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`, if the projection has a bias.
    pub bias: Option<Tensor>,
    /// LoRA adapter (`lora_A` / `lora_B` of PEFT), if this projection is adapted.
    pub lora: Option<LoraAdapter>,
}

impl Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, false)
    }

    /// `forward`, with the adapter's dropout active when `train`.
    fn forward_with(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let in_f = *dims.last().context("linear input has no dims")?;
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((rows, in_f))?;
        // A frozen weight (LoRA's base) gets no gradient: only ∂x is formed.
        let y = crate::ops::frozen_linear(&x2, &self.weight)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        let y = match &self.lora {
            Some(a) => (y + a.delta(&x2, train)?)?,
            None => y,
        };
        let mut out_dims = dims;
        *out_dims.last_mut().expect("non-empty") = self.weight.dim(0)?;
        Ok(y.reshape(out_dims)?)
    }
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) * weight`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `[dim]`.
    pub weight: Tensor,
    /// Epsilon inside the square root.
    pub eps: f64,
}

impl RmsNorm {
    fn forward(&self, x: &Tensor, path: OpPath) -> Result<Tensor> {
        match path {
            OpPath::Fused => Ok(candle_nn::ops::rms_norm(
                &x.contiguous()?,
                &self.weight,
                self.eps as f32,
            )?),
            OpPath::Differentiable => crate::ops::rms_norm_composed(x, &self.weight, self.eps),
            OpPath::Kernels => crate::ops::rms_norm(x, &self.weight, self.eps),
        }
    }
}

/// Precomputed RoPE tables `cos`, `sin`: `[max_position_embeddings, head_dim / 2]`, f32.
#[derive(Debug, Clone)]
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn new(cfg: &ModelConfig, device: &Device) -> Result<Self> {
        let half = cfg.head_dim / 2;
        // Computed in f32 exactly as transformers' default RoPE does.
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0f32 / (cfg.rope_theta as f32).powf((2 * i) as f32 / cfg.head_dim as f32))
            .collect();
        let n = cfg.max_position_embeddings;
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in 0..n {
            for f in &inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok(Rope {
            cos: Tensor::from_vec(cos, (n, half), device)?,
            sin: Tensor::from_vec(sin, (n, half), device)?,
        })
    }
}

/// Self-attention with grouped-query heads (`self_attn.*` in the checkpoint).
#[derive(Debug, Clone)]
pub struct Attention {
    /// `self_attn.q_proj`.
    pub q_proj: Linear,
    /// `self_attn.k_proj`.
    pub k_proj: Linear,
    /// `self_attn.v_proj`.
    pub v_proj: Linear,
    /// `self_attn.o_proj`.
    pub o_proj: Linear,
    /// `self_attn.q_norm` (Qwen3).
    pub q_norm: Option<RmsNorm>,
    /// `self_attn.k_norm` (Qwen3).
    pub k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

/// Per-forward inputs shared by all layers (cloned into a checkpointed layer's backward).
#[derive(Clone)]
struct Ctx {
    /// `[B, T, head_dim/2]` in the activation dtype.
    cos: Tensor,
    sin: Tensor,
    /// Additive mask broadcastable to `[B, kv_heads, n_rep, T, T_past + T]`, or None (always
    /// None on the kernel path, which uses `cu_seqlens`).
    mask: Option<Tensor>,
    /// Kernel path: the batch's `B·T` slots as packed segments (see `packed_segments`).
    cu_seqlens: Vec<usize>,
    path: OpPath,
    /// A training forward (LoRA dropout on).
    train: bool,
}

/// RoPE of `x` `[B, H, T, D]` with `cos`/`sin` `[B, T, D/2]` (the mask-based paths).
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor, path: OpPath) -> Result<Tensor> {
    match path {
        OpPath::Fused => Ok(candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin)?),
        OpPath::Differentiable | OpPath::Kernels => crate::ops::rope_composed(x, cos, sin),
    }
}

impl Attention {
    fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        cache: Option<(&mut LayerKv, usize)>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = self
            .q_proj
            .forward_with(x, ctx.train)?
            .reshape((b, t, nh, hd))?;
        let k = self
            .k_proj
            .forward_with(x, ctx.train)?
            .reshape((b, t, nkv, hd))?;
        let v = self
            .v_proj
            .forward_with(x, ctx.train)?
            .reshape((b, t, nkv, hd))?;
        let q = match &self.q_norm {
            Some(n) => n.forward(&q, ctx.path)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(n) => n.forward(&k, ctx.path)?,
            None => k,
        };
        if !ctx.cu_seqlens.is_empty() && cache.is_none() {
            return self.forward_packed(&q, &k, &v, ctx);
        }
        let (q, k) = if ctx.path == OpPath::Kernels {
            // The RoPE kernel takes tokens × heads: rotate before moving heads forward.
            let half = hd / 2;
            let cos = ctx.cos.reshape((b * t, half))?;
            let sin = ctx.sin.reshape((b * t, half))?;
            let rot = |x: &Tensor, heads: usize| -> Result<Tensor> {
                let y = crate::ops::rope(&x.reshape((b * t, heads, hd))?, &cos, &sin)?;
                Ok(y.reshape((b, t, heads, hd))?
                    .transpose(1, 2)?
                    .contiguous()?)
            };
            (rot(&q, nh)?, rot(&k, nkv)?)
        } else {
            let q = q.transpose(1, 2)?.contiguous()?;
            let k = k.transpose(1, 2)?.contiguous()?;
            (
                apply_rope(&q, &ctx.cos, &ctx.sin, ctx.path)?,
                apply_rope(&k, &ctx.cos, &ctx.sin, ctx.path)?,
            )
        };
        let v = v.transpose(1, 2)?.contiguous()?;
        let (k, v) = match cache {
            Some((slot, reserved)) => slot.append(&k, &v, reserved)?,
            None => (k, v),
        };
        let tk = k.dim(2)?;
        let n_rep = nh / nkv;
        // Grouped-query attention without copying K/V: head h uses kv head h / n_rep, so
        // the query heads of one group are stacked along the query axis.
        let q = q.reshape((b, nkv, n_rep * t, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let probs = match ctx.path {
            OpPath::Fused => {
                let in_dtype = scores.dtype();
                // Softmax in f32 for half-precision activations, as transformers does.
                let scores = scores.to_dtype(DType::F32)?;
                let scores = match &ctx.mask {
                    Some(m) => scores
                        .reshape((b, nkv, n_rep, t, tk))?
                        .broadcast_add(&m.to_dtype(DType::F32)?)?
                        .reshape((b, nkv, n_rep * t, tk))?,
                    None => scores,
                };
                candle_nn::ops::softmax_last_dim(&scores.contiguous()?)?.to_dtype(in_dtype)?
            }
            // The mask is [B|1, 1, 1, T, Tk]: one [T, Tk] plane per batch entry (or shared).
            path => {
                let mask = match &ctx.mask {
                    Some(m) => Some(m.reshape((m.dim(0)?, t, tk))?),
                    None => None,
                };
                if path == OpPath::Kernels {
                    crate::ops::masked_softmax(&scores, mask.as_ref())?
                } else {
                    crate::ops::masked_softmax_composed(&scores, mask.as_ref())?
                }
            }
        };
        let out = probs.matmul(&v)?; // [B, nkv, n_rep*T, hd]
        let out = out
            .reshape((b, nh, t, hd))?
            .transpose(1, 2)?
            .reshape((b, t, nh * hd))?;
        self.o_proj.forward_with(&out, ctx.train)
    }

    /// Attention over packed segments from projected `q` `[B, T, H, D]`, `k`/`v`
    /// `[B, T, Hkv, D]`: the `B·T` tokens (a free reshape) attended segment by segment of
    /// `ctx.cu_seqlens` (the kernel path's padded batch, or a padding-free packed row).
    fn forward_packed(&self, q: &Tensor, k: &Tensor, v: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let (b, t, nh, hd) = q.dims4()?;
        let nkv = self.num_kv_heads;
        let n = b * t;
        let cos = ctx.cos.reshape((n, hd / 2))?;
        let sin = ctx.sin.reshape((n, hd / 2))?;
        let q = q.reshape((n, nh, hd))?;
        let k = k.reshape((n, nkv, hd))?;
        let v = v.reshape((n, nkv, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let out = if ctx.path == OpPath::Kernels {
            let q = crate::ops::rope(&q, &cos, &sin)?;
            let k = crate::ops::rope(&k, &cos, &sin)?;
            crate::ops::causal_attention_varlen(&q, &k, &v, &ctx.cu_seqlens, scale)?
        } else {
            let q = crate::ops::rope_composed(&q, &cos, &sin)?;
            let k = crate::ops::rope_composed(&k, &cos, &sin)?;
            crate::ops::causal_attention_varlen_composed(&q, &k, &v, &ctx.cu_seqlens, scale)?
        };
        self.o_proj
            .forward_with(&out.reshape((b, t, nh * hd))?, ctx.train)
    }
}

/// SwiGLU MLP (`mlp.*`).
#[derive(Debug, Clone)]
pub struct Mlp {
    /// `mlp.gate_proj`.
    pub gate_proj: Linear,
    /// `mlp.up_proj`.
    pub up_proj: Linear,
    /// `mlp.down_proj`.
    pub down_proj: Linear,
}

impl Mlp {
    fn forward(&self, x: &Tensor, path: OpPath, train: bool) -> Result<Tensor> {
        let gate = self.gate_proj.forward_with(x, train)?;
        let up = self.up_proj.forward_with(x, train)?;
        let h = match path {
            OpPath::Kernels => crate::ops::swiglu(&gate, &up)?,
            OpPath::Fused | OpPath::Differentiable => crate::ops::swiglu_composed(&gate, &up)?,
        };
        self.down_proj.forward_with(&h, train)
    }
}

/// One pre-norm decoder layer (`model.layers.N`).
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// `self_attn`.
    pub self_attn: Attention,
    /// `mlp`.
    pub mlp: Mlp,
    /// `input_layernorm`.
    pub input_layernorm: RmsNorm,
    /// `post_attention_layernorm`.
    pub post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        cache: Option<(&mut LayerKv, usize)>,
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x, ctx.path)?;
        let x = (x + self.self_attn.forward(&h, ctx, cache)?)?;
        let h = self.post_attention_layernorm.forward(&x, ctx.path)?;
        Ok((&x + self.mlp.forward(&h, ctx.path, ctx.train)?)?)
    }
}

impl DecoderLayer {
    /// Replaces every tensor of the layer (weights, biases, adapters, norms) by `f` of it.
    fn map_tensors(&mut self, f: &mut dyn FnMut(&Tensor) -> Result<Tensor>) -> Result<()> {
        for l in self.linears_mut() {
            l.weight = f(&l.weight)?;
            if let Some(b) = &l.bias {
                l.bias = Some(f(b)?);
            }
            if let Some(a) = &mut l.lora {
                a.lora_a = f(&a.lora_a)?;
                a.lora_b = f(&a.lora_b)?;
            }
        }
        for n in [
            Some(&mut self.input_layernorm),
            Some(&mut self.post_attention_layernorm),
            self.self_attn.q_norm.as_mut(),
            self.self_attn.k_norm.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            n.weight = f(&n.weight)?;
        }
        Ok(())
    }

    /// The seven projections, attention's then the MLP's.
    fn linears_mut(&mut self) -> [&mut Linear; 7] {
        let a = &mut self.self_attn;
        let m = &mut self.mlp;
        [
            &mut a.q_proj,
            &mut a.k_proj,
            &mut a.v_proj,
            &mut a.o_proj,
            &mut m.gate_proj,
            &mut m.up_proj,
            &mut m.down_proj,
        ]
    }
}

/// The `model.*` module: embeddings, layers, final norm.
#[derive(Debug, Clone)]
pub struct Model {
    /// `model.embed_tokens.weight`: `[vocab, hidden]`.
    pub embed_tokens: Tensor,
    /// `model.layers`.
    pub layers: Vec<DecoderLayer>,
    /// `model.norm`.
    pub norm: RmsNorm,
}

/// A decoder-only causal LM: `model.*` plus `lm_head`, its config and RoPE tables.
///
/// Weights are plain tensors; when built from a [`VarMap`] they are that map's variables
/// (f32 master weights), so gradients of a training forward land on the optimizer's vars.
#[derive(Debug, Clone)]
pub struct Transformer {
    /// Architecture.
    pub cfg: ModelConfig,
    /// `model.*`.
    pub model: Model,
    /// `lm_head.weight` `[vocab, hidden]` (the embedding tensor itself when tied).
    pub lm_head: Tensor,
    rope: Rope,
    device: Device,
    dtype: DType,
    /// Number of shard files of the checkpoint this model was loaded from (saved the same way).
    pub source_shards: usize,
    /// The LoRA adapters' config when adapters are attached ([`crate::lora`]).
    pub lora: Option<LoraConfig>,
    /// Whether differentiable forwards on the CPU (f32/f64, no KV cache) use the custom ops
    /// of [`crate::ops`] (the default) rather than compositions of candle ops; off only to
    /// compare the two (benchmarks, equivalence tests).
    pub training_kernels: bool,
    /// TRL's `gradient_checkpointing`: differentiable forwards keep only each decoder
    /// layer's input and recompute the layer's activations in the backward
    /// (module `transformer::checkpointing`); the same gradients for less memory, one more
    /// layer forward each.
    pub gradient_checkpointing: bool,
}

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

    /// The same weights without gradient tracking (shares storage: in-place optimizer
    /// updates of the variables are visible). Used by rollouts so decoding builds no graph.
    pub fn detached(&self) -> Self {
        self.map_weights(&mut |t| Ok(t.detach()))
            .expect("detach cannot fail")
    }

    /// An independent copy of the weights in `dtype` (e.g. a bf16 generator snapshot).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let mut m = self.map_weights(&mut |t| Ok(t.detach().to_dtype(dtype)?.copy()?))?;
        m.dtype = dtype;
        if self.cfg.tie_word_embeddings {
            m.lm_head = m.model.embed_tokens.clone();
        }
        Ok(m)
    }

    fn map_weights(&self, f: &mut dyn FnMut(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let mut m = self.clone();
        for layer in &mut m.model.layers {
            layer.map_tensors(f)?;
        }
        m.model.norm.weight = f(&m.model.norm.weight)?;
        m.model.embed_tokens = f(&m.model.embed_tokens)?;
        m.lm_head = if self.cfg.tie_word_embeddings {
            m.model.embed_tokens.clone()
        } else {
            f(&m.lm_head)?
        };
        Ok(m)
    }

    /// Every parameter with its checkpoint name, in transformers' order. A tied LM head is
    /// not listed (it is `model.embed_tokens.weight`).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            self.model.embed_tokens.clone(),
        )];
        for (i, l) in self.model.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let mut lin = |name: &str, l: &Linear| {
                out.push((format!("{p}.{name}.weight"), l.weight.clone()));
                if let Some(b) = &l.bias {
                    out.push((format!("{p}.{name}.bias"), b.clone()));
                }
            };
            lin("self_attn.q_proj", &l.self_attn.q_proj);
            lin("self_attn.k_proj", &l.self_attn.k_proj);
            lin("self_attn.v_proj", &l.self_attn.v_proj);
            lin("self_attn.o_proj", &l.self_attn.o_proj);
            lin("mlp.gate_proj", &l.mlp.gate_proj);
            lin("mlp.up_proj", &l.mlp.up_proj);
            lin("mlp.down_proj", &l.mlp.down_proj);
            if let Some(n) = &l.self_attn.q_norm {
                out.push((format!("{p}.self_attn.q_norm.weight"), n.weight.clone()));
            }
            if let Some(n) = &l.self_attn.k_norm {
                out.push((format!("{p}.self_attn.k_norm.weight"), n.weight.clone()));
            }
            out.push((
                format!("{p}.input_layernorm.weight"),
                l.input_layernorm.weight.clone(),
            ));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                l.post_attention_layernorm.weight.clone(),
            ));
        }
        out.push((
            "model.norm.weight".to_string(),
            self.model.norm.weight.clone(),
        ));
        if !self.cfg.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), self.lm_head.clone()));
        }
        out
    }

    /// Total number of parameters (tied head counted once).
    pub fn num_parameters(&self) -> usize {
        self.named_tensors()
            .iter()
            .map(|(_, t)| t.elem_count())
            .sum()
    }

    /// Writes `config.json`, `generation_config.json` and the weights (in the model's
    /// dtype) in transformers' layout: `model.safetensors`, or as many shards + index as
    /// the source checkpoint had. Files are written atomically.
    pub fn save_pretrained(&self, dir: &Path) -> Result<()> {
        self.save_pretrained_sharded(dir, self.source_shards)
    }

    /// As [`Transformer::save_pretrained`], with an explicit shard count (1 = single file).
    pub fn save_pretrained_sharded(&self, dir: &Path, num_shards: usize) -> Result<()> {
        if self.lora.is_some() {
            bail!(
                "{}: the model has LoRA adapters; save them with `save_lora`, or merge them \
                 first (`merge_lora`) to write full weights",
                dir.display()
            );
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let dtype_name = checkpoint::torch_dtype_name(self.dtype);
        let tensors: Vec<(String, Tensor)> = self
            .named_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.detach()))
            .collect();
        checkpoint::save_dir(dir, &tensors, num_shards)?;
        checkpoint::write_atomic(
            &dir.join("config.json"),
            serde_json::to_string_pretty(&self.cfg.to_hf_json(dtype_name))?.as_bytes(),
        )?;
        checkpoint::write_atomic(
            &dir.join("generation_config.json"),
            serde_json::to_string_pretty(&self.cfg.to_generation_config_json())?.as_bytes(),
        )?;
        Ok(())
    }

    /// Device of the weights.
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// Dtype of the weights (and activations).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Inference forward (fused kernels, no backward): `input_ids` `[B, T]` u32 →
    /// logits `[B, T, vocab]` f32. With a cache, the tokens continue the cached rows
    /// (positions and padding mask from the cache) and the cache is extended.
    pub fn forward(&self, input_ids: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let h = self.forward_hidden(input_ids, None, cache, false)?;
        self.logits(&h)
    }

    /// Inference forward over left-padded rows without a cache.
    pub fn forward_padded(&self, input_ids: &Tensor, left_pad: &[usize]) -> Result<Tensor> {
        let h = self.forward_hidden(input_ids, Some(left_pad), None, false)?;
        self.logits(&h)
    }

    /// Differentiable training forward: `input_ids` `[B, T]` u32 (optionally left-padded;
    /// right padding needs nothing thanks to the causal mask) → logits `[B, T, vocab]` f32.
    /// Uses only ops with a backward, so gradients reach every parameter.
    pub fn forward_train(&self, input_ids: &Tensor, left_pad: Option<&[usize]>) -> Result<Tensor> {
        let h = self.forward_hidden(input_ids, left_pad, None, true)?;
        self.logits(&h)
    }

    /// LM head on final hidden states `[.., hidden]` → f32 logits `[.., vocab]` (f64 for an
    /// f64 model, so finite-difference gradient checks keep their precision).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let lin = Linear {
            weight: self.lm_head.clone(),
            bias: None,
            lora: None,
        };
        let out_dtype = if self.dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        Ok(lin.forward(hidden)?.to_dtype(out_dtype)?)
    }

    /// The fused, chunked LM head on final hidden states `[N, hidden]`: log-probs at `ids`
    /// `[N, K]`, entropy and optional top-K, without materialising `[N, vocab]` logits
    /// (see [`crate::chunked_logprobs`]). Differentiable w.r.t. the hidden states and
    /// `lm_head` (the embedding when tied).
    pub fn head_logprobs(
        &self,
        hidden: &Tensor,
        ids: &Tensor,
        opts: &crate::chunked_logprobs::HeadOptions,
    ) -> Result<crate::chunked_logprobs::HeadLogprobs> {
        crate::chunked_logprobs::head_logprobs(hidden, &self.lm_head, ids, opts)
    }

    /// Final hidden states `[B, T, hidden]` (after `model.norm`). `left_pad` is used when no
    /// cache is given; with a cache, the cache's padding applies.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        left_pad: Option<&[usize]>,
        mut cache: Option<&mut KvCache>,
        differentiable: bool,
    ) -> Result<Tensor> {
        // candle-nn's fused kernels have no f64 CPU implementation; f64 models (gradient
        // checks) use the differentiable ops on every path. The custom CPU ops serve forwards
        // without a cache (their attention does not read one).
        let kernels = self.training_kernels
            && cache.is_none()
            && crate::ops::kernels_apply_to(&self.device, self.dtype);
        let path = match (differentiable || self.dtype == DType::F64, kernels) {
            (true, true) => OpPath::Kernels,
            (true, false) => OpPath::Differentiable,
            (false, _) => OpPath::Fused,
        };
        let (b, t) = input_ids
            .dims2()
            .context("input_ids must be a [batch, seq] tensor")?;
        let zeros = vec![0usize; b];
        let (pads, past): (Vec<usize>, usize) = match &cache {
            Some(c) => {
                if c.batch_size() != b {
                    bail!("KV cache has {} rows but input_ids has {b}", c.batch_size());
                }
                (c.left_pad.clone(), c.len)
            }
            None => (left_pad.map(|p| p.to_vec()).unwrap_or(zeros), 0),
        };
        if pads.len() != b {
            bail!("left_pad has {} entries for a batch of {b}", pads.len());
        }
        let min_pad = pads.iter().copied().min().unwrap_or(0);
        if past + t > min_pad + self.cfg.max_position_embeddings {
            bail!(
                "sequence of {} tokens exceeds max_position_embeddings = {}",
                past + t - min_pad,
                self.cfg.max_position_embeddings
            );
        }
        // Positions: slot index minus the row's padding (padding slots get position 0).
        let mut pos = Vec::with_capacity(b * t);
        for &p in &pads {
            for i in 0..t {
                pos.push((past + i).saturating_sub(p) as u32);
            }
        }
        let pos = Tensor::from_vec(pos, b * t, &self.device)?;
        let half = self.cfg.head_dim / 2;
        let cos = self
            .rope
            .cos
            .index_select(&pos, 0)?
            .reshape((b, t, half))?
            .to_dtype(self.dtype)?;
        let sin = self
            .rope
            .sin
            .index_select(&pos, 0)?
            .reshape((b, t, half))?
            .to_dtype(self.dtype)?;
        let (mask, cu_seqlens) = if path == OpPath::Kernels && self.device.is_cpu() {
            (None, packed_segments(&pads, t))
        } else {
            (self.build_mask(&pads, past, t)?, Vec::new())
        };
        let ctx = Ctx {
            cos,
            sin,
            mask,
            cu_seqlens,
            path,
            train: differentiable,
        };
        let ids = input_ids.flatten_all()?;
        let x =
            self.model
                .embed_tokens
                .index_select(&ids, 0)?
                .reshape((b, t, self.cfg.hidden_size))?;
        let x = self.decoder_stack(x, &ctx, cache.as_deref_mut())?;
        if let Some(c) = cache {
            c.len = past + t;
        }
        self.model.norm.forward(&x, path)
    }

    /// The decoder layers on embeddings `x` `[B, T, hidden]` (before the final norm); each
    /// layer checkpointed when `gradient_checkpointing` is on and the forward trains.
    fn decoder_stack(
        &self,
        mut x: Tensor,
        ctx: &Ctx,
        mut cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        if self.gradient_checkpointing && ctx.train && cache.is_none() {
            for layer in &self.model.layers {
                x = checkpointing::forward(layer, &x, ctx)?;
            }
            return Ok(x);
        }
        for (i, layer) in self.model.layers.iter().enumerate() {
            let slot = cache.as_mut().map(|c| c.layer_mut(i));
            x = layer.forward(&x, ctx, slot)?;
        }
        Ok(x)
    }

    /// Additive attention mask `[B|1, 1, 1, T, past+T]` (0 = attend, -inf = masked): causal,
    /// padding keys masked. A slot always attends to itself so padding rows never produce
    /// NaN (their outputs are ignored). None when nothing needs masking.
    fn build_mask(&self, pads: &[usize], past: usize, t: usize) -> Result<Option<Tensor>> {
        let any_pad = pads.iter().any(|&p| p > 0);
        if t == 1 && !any_pad {
            return Ok(None);
        }
        let tk = past + t;
        let rows = if any_pad { pads.len() } else { 1 };
        let mut m = vec![0f32; rows * t * tk];
        for r in 0..rows {
            let p = if any_pad { pads[r] } else { 0 };
            for i in 0..t {
                let q = past + i;
                let row = &mut m[(r * t + i) * tk..(r * t + i + 1) * tk];
                for (j, v) in row.iter_mut().enumerate() {
                    if j > q || (j < p && j != q) {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Ok(Some(Tensor::from_vec(
            m,
            (rows, 1, 1, t, tk),
            &self.device,
        )?))
    }
}

/// `cu_seqlens` of a `[B, T]` batch packed as `B·T` tokens, the same attention pattern as
/// `build_mask` without a cache: row `r`'s `pads[r]` padding slots are one-token segments
/// (each attends to itself only), its real tokens one causal segment.
fn packed_segments(pads: &[usize], t: usize) -> Vec<usize> {
    let mut cu = vec![0];
    for (r, &p) in pads.iter().enumerate() {
        let base = r * t;
        cu.extend((1..=p.min(t)).map(|i| base + i));
        if p < t {
            cu.push(base + t);
        }
    }
    cu
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
