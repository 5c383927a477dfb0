//! Decoder-only transformer for the Llama, Qwen2 and Qwen3 families: the model and its
//! forwards here; the layers in the `layers` submodule, building and loading in
//! `construction`, the packed batch in `packed` and gradient checkpointing in
//! `checkpointing`.
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

use crate::checkpoint;
use crate::config::ModelConfig;
pub use crate::kv_cache::KvCache;
use crate::lora_adapter::LoraConfig;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::path::Path;

mod checkpointing;
mod construction;
mod decode_layer;
mod decode_stacks;
mod layers;
mod packed;
mod paged_decode;
pub use layers::{Attention, DecoderLayer, Linear, Mlp, RmsNorm};
use layers::{Ctx, LayerCache, OpPath, Products, Rope};
pub use packed::PackedBatch;
pub(crate) use paged_decode::DecodeStacks;

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
/// Weights are plain tensors; when built from a [`VarMap`](candle_nn::VarMap) they are that
/// map's variables (f32 master weights), so gradients of a training forward land on the
/// optimizer's vars.
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
    /// Whether differentiable forwards (no KV cache) and the LM head's softmax algebra use the
    /// custom ops of [`crate::ops`] where they apply (the default) rather than compositions of
    /// candle ops; off only to compare the two (benchmarks, equivalence tests).
    pub training_kernels: bool,
    /// TRL's `gradient_checkpointing`: differentiable forwards keep only each decoder
    /// layer's input and recompute the layer's activations in the backward
    /// (module `transformer::checkpointing`); the same gradients for less memory, one more
    /// layer forward each.
    pub gradient_checkpointing: bool,
}

impl Transformer {
    /// An error naming `what` if a position lies past the RoPE tables
    /// (`max_position_embeddings`): every forward that takes explicit positions checks here.
    pub(crate) fn check_positions(
        &self,
        positions: impl IntoIterator<Item = usize>,
        what: &str,
    ) -> Result<()> {
        let max_pos = self.cfg.max_position_embeddings;
        if let Some(p) = positions.into_iter().find(|&p| p >= max_pos) {
            bail!("{what}: position {p} exceeds max_position_embeddings = {max_pos}");
        }
        Ok(())
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
        self.widened(self.head_logits(hidden)?)
    }

    /// The LM head's `logits` in f32 (f64 for an f64 model).
    fn widened(&self, logits: Tensor) -> Result<Tensor> {
        let out_dtype = if self.dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        Ok(logits.to_dtype(out_dtype)?)
    }

    /// [`Self::logits`] in the model's own dtype: a bf16 model's stay bf16. The decode step
    /// hands these to the sampler, which reads them in f32 — the very values `logits` gives
    /// (widening bf16 is exact) without writing an f32 `[rows, vocab]` copy each step.
    pub(crate) fn head_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.head_products(hidden, Products::Plain)
    }

    /// `hidden · lm_headᵀ` in the model's dtype, computed as `products` says.
    fn head_products(&self, hidden: &Tensor, products: Products) -> Result<Tensor> {
        let head = Linear {
            weight: self.lm_head.clone(),
            bias: None,
            lora: None,
        };
        head.forward_with(hidden, products)
    }

    /// The fused, chunked LM head on final hidden states `[N, hidden]`: log-probs at `ids`
    /// `[N, K]`, entropy and optional top-K, without materialising `[N, vocab]` logits
    /// (see [`crate::chunked_logprobs`]). Differentiable w.r.t. the hidden states and
    /// `lm_head` (the embedding when tied). With `training_kernels` off its softmax algebra is
    /// the candle composition too.
    pub fn head_logprobs(
        &self,
        hidden: &Tensor,
        ids: &Tensor,
        opts: &crate::chunked_logprobs::HeadOptions,
    ) -> Result<crate::chunked_logprobs::HeadLogprobs> {
        crate::chunked_logprobs::head_logprobs_with(
            hidden,
            &self.lm_head,
            ids,
            opts,
            self.training_kernels,
        )
    }

    /// Final hidden states `[B, T, hidden]` (after `model.norm`). `left_pad` is used when no
    /// cache is given; with a cache, the cache's padding applies.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        left_pad: Option<&[usize]>,
        cache: Option<&mut KvCache>,
        differentiable: bool,
    ) -> Result<Tensor> {
        self.hidden_states(input_ids, left_pad, cache, differentiable, false)
    }

    /// [`Self::forward`] with an unpadded cache, every product batch-invariant
    /// ([`crate::ops::linear_rows_invariant`]) and each new query's attention over its own
    /// cache row alone ([`crate::ops::attend_one_rows_invariant`]): a position's logits, to the
    /// bit, depend neither on the other rows fed with it nor on how many of its row's tokens
    /// come in the same call — deterministic mode's forward, on the CPU and on CUDA (f32,
    /// bf16). The rest of the forward is already row by row (norms, RoPE, the element-wise
    /// ops). With `last_only`, the logits of each row's last position only (`[B, 1, V]`).
    pub(crate) fn forward_rows_invariant(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        last_only: bool,
    ) -> Result<Tensor> {
        if cache.left_pad.iter().any(|&p| p != 0) {
            bail!("a batch-invariant forward takes an unpadded KV cache");
        }
        let h = self.hidden_states(input_ids, None, Some(cache), false, true)?;
        let h = if last_only {
            let t = h.dim(1)?;
            h.narrow(1, t - 1, 1)?
        } else {
            h
        };
        self.widened(self.head_products(&h, Products::RowsInvariant)?)
    }

    /// [`Self::forward_hidden`], the products batch-invariant with `rows_invariant`.
    fn hidden_states(
        &self,
        input_ids: &Tensor,
        left_pad: Option<&[usize]>,
        mut cache: Option<&mut KvCache>,
        differentiable: bool,
        rows_invariant: bool,
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
        let (mask, cu_seqlens) = if path == OpPath::Kernels && padded_batch_varlen(&self.device) {
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
            rows_invariant,
        };
        let x = crate::ops::embedding(&self.model.embed_tokens, input_ids, differentiable)?
            .reshape((b, t, self.cfg.hidden_size))?;
        let x = self.decoder_stack(x, &ctx, cache.as_deref_mut())?;
        if let Some(c) = cache {
            c.len = past + t;
        }
        self.model.norm.forward(&x, path)
    }

    /// Differentiable final hidden states `[N, hidden]` (after `model.norm`) of a packed
    /// batch: the same values as [`Transformer::forward_hidden`] on the padded batch, at the
    /// real tokens. On the CPU in f32/f64 and on CUDA in f32/bf16 the custom kernels run (on
    /// CUDA the varlen flash-attention kernel: no `[heads, N, N]` scores); elsewhere (or with
    /// `training_kernels` off) the differentiable compositions, attention segment by segment.
    pub fn forward_hidden_packed(&self, batch: &PackedBatch) -> Result<Tensor> {
        let n = batch.len();
        if n == 0 {
            bail!("packed batch has no tokens");
        }
        if batch.positions.len() != n {
            bail!(
                "packed batch has {n} ids but {} positions",
                batch.positions.len()
            );
        }
        crate::ops::check_cu_seqlens(&batch.cu_seqlens, n).context("packed batch")?;
        self.check_positions(batch.positions.iter().map(|&p| p as usize), "packed batch")?;
        let path = if self.training_kernels {
            OpPath::Kernels
        } else {
            OpPath::Differentiable
        };
        let pos = Tensor::new(batch.positions.as_slice(), &self.device)?;
        let half = self.cfg.head_dim / 2;
        let table = |t: &Tensor| -> Result<Tensor> {
            Ok(t.index_select(&pos, 0)?
                .reshape((1, n, half))?
                .to_dtype(self.dtype)?)
        };
        let ctx = Ctx {
            cos: table(&self.rope.cos)?,
            sin: table(&self.rope.sin)?,
            mask: None,
            cu_seqlens: batch.cu_seqlens.clone(),
            path,
            train: true,
            rows_invariant: false,
        };
        let x = crate::ops::embedding_of_ids(&self.model.embed_tokens, &batch.ids, true)?
            .reshape((1, n, self.cfg.hidden_size))?;
        let x = self.decoder_stack(x, &ctx, None)?;
        Ok(self.model.norm.forward(&x, path)?.squeeze(0)?)
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
            let slot = cache.as_mut().map(|c| {
                let (layer, reserved) = c.layer_mut(i);
                LayerCache::Dense(layer, reserved)
            });
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

/// Whether a padded training batch on `device` attends through the varlen kernels (its rows'
/// tokens as packed segments, [`packed_segments`]: no `[heads, T, T]` scores) rather than the
/// masked softmax over the padded batch: always on the CPU, and on CUDA unless
/// `COMPOSER_PADDED_ATTENTION=masked` (a diagnostic: on an H200 the varlen kernels trained the
/// 0.5B shape at 16×512 at 1.17× the masked softmax's tokens/s in 13.4 against 21.6 GiB,
/// BENCHMARKS.md 2026-11-27; tools/gpu_check.sh's `attn` section times both).
fn padded_batch_varlen(device: &Device) -> bool {
    static MASKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    device.is_cpu()
        || !*MASKED
            .get_or_init(|| std::env::var("COMPOSER_PADDED_ATTENTION").is_ok_and(|v| v == "masked"))
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
