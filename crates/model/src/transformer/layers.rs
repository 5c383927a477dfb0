//! The decoder's layers, named as the checkpoint's modules: [`Linear`] (with an optional LoRA
//! adapter), [`RmsNorm`], the RoPE tables, grouped-query [`Attention`], the SwiGLU [`Mlp`] and
//! the pre-norm [`DecoderLayer`], each with its forward on every op path (fused inference
//! kernels, differentiable compositions, the custom ops of [`crate::ops`]). The decode step's
//! forwards over the paged pool are in [`super::decode_layer`].

use crate::config::ModelConfig;
use crate::kv_cache::LayerKv;
use crate::lora_adapter::LoraAdapter;
use crate::paged_kv::{PagedStep, PoolLayer};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};

/// Which implementation of the non-matmul ops a forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpPath {
    /// candle-nn fused kernels (no backward): rollouts and scoring.
    Fused,
    /// Differentiable compositions of candle ops: training where no kernel applies (e.g.
    /// f16), f64 with a cache.
    Differentiable,
    /// The custom ops of [`crate::ops`] (with a backward): training without a KV cache on
    /// the CPU (f32/f64; attention over packed segments) and on CUDA (f32/bf16; attention over
    /// the padded batch with the fused masked softmax, or over a padding-free packed batch
    /// with the varlen attention kernel).
    Kernels,
}

/// How a forward's projections compute their products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Products {
    /// [`crate::ops::linear`] (and the adapters' matmuls), no dropout.
    Plain,
    /// As `Plain`, LoRA dropout active: a training forward.
    Train,
    /// [`crate::ops::linear_rows_invariant`] for the base and the adapters: every row's bits
    /// independent of the batch (deterministic mode).
    RowsInvariant,
}

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
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, Products::Plain)
    }

    /// `forward`, its products as `products` says.
    pub(super) fn forward_with(&self, x: &Tensor, products: Products) -> Result<Tensor> {
        let y = if products == Products::RowsInvariant {
            let y = crate::ops::linear_rows_invariant(x, &self.weight)?;
            match &self.bias {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            }
        } else {
            // One graph node whatever x's rank; a frozen weight (LoRA's base) gets no
            // gradient, the bias added in place to the product (one node, no broadcast pass).
            crate::ops::linear(x, &self.weight, self.bias.as_ref())?
        };
        match &self.lora {
            Some(_) => self.plus_adapter(&rows_of(x)?, y, products),
            None => Ok(y),
        }
    }

    /// `y`, this projection's product of the rows `x2` `[n, in]` (in any shape of n rows), plus
    /// the adapter's delta when there is one, computed as `products` says.
    pub(super) fn plus_adapter(
        &self,
        x2: &Tensor,
        y: Tensor,
        products: Products,
    ) -> Result<Tensor> {
        let Some(a) = &self.lora else {
            return Ok(y);
        };
        let delta = match products {
            Products::RowsInvariant => a.delta_rows_invariant(x2)?,
            _ => a.delta(x2, products == Products::Train)?,
        };
        let delta = delta.reshape(y.shape())?;
        Ok((y + delta)?)
    }
}

/// `x` `[.., in]` as rows `[n, in]` (a free reshape).
pub(super) fn rows_of(x: &Tensor) -> Result<Tensor> {
    let in_f = *x.dims().last().context("linear input has no dims")?;
    Ok(x.reshape((x.elem_count() / in_f.max(1), in_f))?)
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
    pub(super) fn forward(&self, x: &Tensor, path: OpPath) -> Result<Tensor> {
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

    /// `(x + delta, self(x + delta))`: a residual add and the norm after it, fused into one
    /// op on the kernel path (inference only: [`crate::ops::add_rms_norm`] has no backward).
    pub(super) fn add_forward(
        &self,
        x: &Tensor,
        delta: &Tensor,
        path: OpPath,
    ) -> Result<(Tensor, Tensor)> {
        if path == OpPath::Kernels {
            return crate::ops::add_rms_norm(x, delta, &self.weight, self.eps);
        }
        let sum = (x + delta)?;
        let normed = self.forward(&sum, path)?;
        Ok((sum, normed))
    }
}

/// Precomputed RoPE tables `cos`, `sin`: `[max_position_embeddings, head_dim / 2]`, f32.
#[derive(Debug, Clone)]
pub(super) struct Rope {
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
}

impl Rope {
    pub(super) fn new(cfg: &ModelConfig, device: &Device) -> Result<Self> {
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
    pub(super) num_heads: usize,
    pub(super) num_kv_heads: usize,
    pub(super) head_dim: usize,
}

/// The KV cache one layer's attention extends and reads.
pub(super) enum LayerCache<'a> {
    /// A dense left-padded cache and the capacity to reserve (`KvCache`).
    Dense(&'a mut LayerKv, usize),
    /// The rollout engine's block pool, one decode token per row (`paged_kv`).
    Paged(&'a PoolLayer, &'a PagedStep),
}

/// Per-forward inputs shared by all layers (cloned into a checkpointed layer's backward).
#[derive(Clone)]
pub(super) struct Ctx {
    /// `[B, T, head_dim/2]` in the activation dtype.
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    /// Additive mask broadcastable to `[B, kv_heads, n_rep, T, T_past + T]`, or None (always
    /// None on the kernel path, which uses `cu_seqlens`).
    pub(super) mask: Option<Tensor>,
    /// Kernel path: the batch's `B·T` slots as packed segments (see `packed_segments`).
    pub(super) cu_seqlens: Vec<usize>,
    pub(super) path: OpPath,
    /// A training forward (LoRA dropout on).
    pub(super) train: bool,
    /// Every product batch-invariant ([`Products::RowsInvariant`]) and each row's attention
    /// alone ([`crate::ops::attend_one_rows_invariant`]): deterministic mode.
    pub(super) rows_invariant: bool,
}

impl Ctx {
    /// How this forward's projections compute.
    pub(super) fn products(&self) -> Products {
        match (self.rows_invariant, self.train) {
            (true, _) => Products::RowsInvariant,
            (false, true) => Products::Train,
            (false, false) => Products::Plain,
        }
    }
}

/// RoPE of `x` `[B, H, T, D]` with `cos`/`sin` `[B, T, D/2]` (the mask-based paths).
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor, path: OpPath) -> Result<Tensor> {
    match path {
        OpPath::Fused => Ok(candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin)?),
        OpPath::Differentiable | OpPath::Kernels => crate::ops::rope_composed(x, cos, sin),
    }
}

impl Attention {
    pub(super) fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        cache: Option<LayerCache>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = self
            .q_proj
            .forward_with(x, ctx.products())?
            .reshape((b, t, nh, hd))?;
        let k = self
            .k_proj
            .forward_with(x, ctx.products())?
            .reshape((b, t, nkv, hd))?;
        let v = self
            .v_proj
            .forward_with(x, ctx.products())?
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
            let half = hd / 2;
            let cos = ctx.cos.reshape((b * t, half))?;
            let sin = ctx.sin.reshape((b * t, half))?;
            // Rotated straight into attention's [B, H, T, D]: one node, no transpose copy.
            (
                crate::ops::rope_to_heads(&q, &cos, &sin)?,
                crate::ops::rope_to_heads(&k, &cos, &sin)?,
            )
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
            Some(LayerCache::Dense(slot, reserved)) => slot.append(&k, &v, reserved)?,
            Some(LayerCache::Paged(pool, step)) => {
                // k, v: [rows, kv_heads, 1, head_dim].
                let kv = Tensor::stack(&[&k, &v], 0)?.reshape((2, b, nkv, hd))?;
                pool.write(&step.slots, &kv)?;
                let out = self.attend_written(&q.reshape((b, nh, hd))?, pool, step)?;
                return self.o_proj.forward(&out.reshape((b, 1, nh * hd))?);
            }
            None => (k, v),
        };
        if ctx.rows_invariant {
            // Deterministic mode: each new query over its own row's cache, causally, alone (the
            // mask is not needed: the lockstep's rows are unpadded).
            let q = q.transpose(1, 2)?; // [B, T, nh, hd]
            let out = crate::ops::attend_one_rows_invariant(&q, &k, &v)?;
            return self
                .o_proj
                .forward_with(&out.reshape((b, t, nh * hd))?, ctx.products());
        }
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
        self.o_proj.forward_with(&out, ctx.products())
    }

    /// The heads of the stacked `[q | k | v]` projection.
    pub(super) fn qkv_heads(&self) -> crate::ops::QkvHeads {
        crate::ops::QkvHeads {
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// `q` `[rows, heads, head_dim]`, one decode token per row, attending over the rows'
    /// blocks once the step's keys and values are in their slots: `[rows, heads·head_dim]`.
    pub(super) fn attend_written(
        &self,
        q: &Tensor,
        pool: &PoolLayer,
        step: &PagedStep,
    ) -> Result<Tensor> {
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let (keys, values) = (pool.keys()?, pool.values()?);
        let out = crate::ops::paged_decode_attention(q, &keys, &values, &step.layout, scale)?;
        Ok(out.reshape((q.dim(0)?, self.num_heads * self.head_dim))?)
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
            .forward_with(&out.reshape((b, t, nh * hd))?, ctx.products())
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
    pub(super) fn forward(&self, x: &Tensor, path: OpPath, products: Products) -> Result<Tensor> {
        let gate = self.gate_proj.forward_with(x, products)?;
        let up = self.up_proj.forward_with(x, products)?;
        let h = match path {
            OpPath::Kernels => crate::ops::swiglu(&gate, &up)?,
            OpPath::Fused | OpPath::Differentiable => crate::ops::swiglu_composed(&gate, &up)?,
        };
        self.down_proj.forward_with(&h, products)
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
    pub(super) fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        cache: Option<LayerCache>,
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x, ctx.path)?;
        let x = (x + self.self_attn.forward(&h, ctx, cache)?)?;
        let h = self.post_attention_layernorm.forward(&x, ctx.path)?;
        Ok((&x + self.mlp.forward(&h, ctx.path, ctx.products())?)?)
    }
}

impl DecoderLayer {
    /// Replaces every tensor of the layer (weights, biases, adapters, norms) by `f` of it.
    pub(super) fn map_tensors(
        &mut self,
        f: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<()> {
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
    pub(super) fn linears_mut(&mut self) -> [&mut Linear; 7] {
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
