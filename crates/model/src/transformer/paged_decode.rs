//! The rollout engine's decode forward over its paged KV cache: one token per row, each at
//! its own position, attending over the row's blocks (`crate::paged_kv`).

use super::decode_stacks::{input_norm, LayerStacks};
use super::{Ctx, LayerCache, OpPath, Transformer};
use crate::ops::{decode_product, DecodeEpilogue, SplitCounters};
use crate::paged_kv::{BlockPool, PagedStep};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

/// The model's projections stacked for the decode step, layer by layer
/// ([`LayerStacks`]); none off the kernel path. Built once per rollout by the engine, from the
/// weights it samples with: a copy of q/k/v's and gate/up's weights (about 60% of a decoder
/// layer's), held while the rollout runs; and the LM head's split-k counters.
#[derive(Debug)]
pub(crate) struct DecodeStacks {
    layers: Vec<LayerStacks>,
    /// Counters for the LM head on the skinny kernel (the final norm inside it), where the
    /// kernel serves the head; `None` elsewhere (the head is then the norm and a product).
    head_counters: Option<SplitCounters>,
}

impl DecodeStacks {
    /// Whether a decode step of `rows` runs every layer with its norms inside the products
    /// ([`LayerStacks::norms_in_products`]; at most the skinny kernel's rows, past which the
    /// separate products and `add_rms_norm` are fewer launches).
    pub(crate) fn norms_in_products(&self, rows: usize) -> bool {
        !self.layers.is_empty()
            && rows <= crate::ops::DECODE_PRODUCT_MAX_ROWS
            && self.layers.iter().all(|l| l.norms_in_products)
    }
}

impl Transformer {
    /// The ops the paged decode runs: the trainer's own kernels (RMSNorm, RoPE, SwiGLU) where
    /// they apply — the sampler's log-probs then come from the ops the trainer recomputes them
    /// with, and each is one launch (candle's SwiGLU is two, its RoPE wants heads-major
    /// copies); elsewhere candle's fused kernels, or the compositions for f64.
    fn decode_path(&self) -> OpPath {
        if self.training_kernels && crate::ops::kernels_apply_to(&self.device, self.dtype) {
            OpPath::Kernels
        } else if self.dtype == DType::F64 {
            OpPath::Differentiable
        } else {
            OpPath::Fused
        }
    }

    /// Whether the decode step runs the trainer's kernels (shapes fixed by the inputs alone,
    /// what a captured CUDA graph needs) rather than candle's fused ops or compositions.
    pub(crate) fn decode_is_kernel_path(&self) -> bool {
        self.decode_path() == OpPath::Kernels
    }

    /// [`DecodeStacks`] of this model's current weights.
    pub(crate) fn stack_for_decode(&self) -> Result<DecodeStacks> {
        if self.decode_path() != OpPath::Kernels {
            return Ok(DecodeStacks {
                layers: Vec::new(),
                head_counters: None,
            });
        }
        let layers = self.model.layers.iter().map(|l| l.stack_for_decode());
        let (vocab, hidden) = self.lm_head.dims2()?;
        let head_served = self.lm_head.dtype() == DType::BF16
            && crate::ops::decode_product_serves(vocab, hidden, DecodeEpilogue::Product);
        let head_counters = if head_served {
            SplitCounters::for_device(&self.device, vocab)?
        } else {
            None
        };
        Ok(DecodeStacks {
            layers: layers.collect::<Result<_>>()?,
            head_counters,
        })
    }

    /// Feeds `tokens[b]` to row `b` of a paged batch (inference path, no backward): each
    /// layer writes the tokens' keys/values into the slots `step` prepared and attends over
    /// the rows' blocks. `positions[b]` is row `b`'s length before the token. Returns the
    /// next-token logits `[rows, vocab]` in the model's dtype ([`Self::head_logits`]). `stacks` are [`Self::stack_for_decode`]'s of this
    /// model's weights.
    pub(crate) fn forward_paged(
        &self,
        tokens: &[u32],
        positions: &[usize],
        pool: &BlockPool,
        step: &PagedStep,
        stacks: &DecodeStacks,
    ) -> Result<Tensor> {
        let b = tokens.len();
        if positions.len() != b || step.layout.rows() != b {
            bail!(
                "paged decode: {b} tokens, {} positions, {} rows in the step",
                positions.len(),
                step.layout.rows()
            );
        }
        self.check_positions(positions.iter().copied(), "paged decode")?;
        let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let pos = Tensor::new(pos, &self.device)?;
        let ids = Tensor::new(tokens, &self.device)?;
        self.forward_paged_on(&ids, &pos, pool, step, stacks)
    }

    /// [`Self::forward_paged`] on inputs already on the device — `ids` and `positions` u32
    /// `[rows]` (checked by the caller against the model's positions) — and nothing read back:
    /// every launch reads device memory only, so the step can be captured as a CUDA graph
    /// (`crate::decode_graph`).
    pub(crate) fn forward_paged_on(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        pool: &BlockPool,
        step: &PagedStep,
        stacks: &DecodeStacks,
    ) -> Result<Tensor> {
        let b = ids.dim(0)?;
        if positions.dims() != [b] || step.layout.rows() != b {
            bail!(
                "paged decode: {b} tokens, positions {:?}, {} rows in the step",
                positions.dims(),
                step.layout.rows()
            );
        }
        let half = self.cfg.head_dim / 2;
        let table = |t: &Tensor| -> Result<Tensor> {
            Ok(t.index_select(positions, 0)?
                .reshape((b, 1, half))?
                .to_dtype(self.dtype)?)
        };
        let path = self.decode_path();
        let ctx = Ctx {
            cos: table(&self.rope.cos)?,
            sin: table(&self.rope.sin)?,
            mask: None,
            cu_seqlens: Vec::new(),
            path,
            train: false,
            rows_invariant: false,
        };
        let mut x =
            self.model
                .embed_tokens
                .index_select(ids, 0)?
                .reshape((b, 1, self.cfg.hidden_size))?;
        let layers = &self.model.layers;
        if stacks.norms_in_products(b) {
            let mut x = x.reshape((b, self.cfg.hidden_size))?;
            for (i, (layer, stack)) in layers.iter().zip(&stacks.layers).enumerate() {
                let cache = (pool.layer(i), step);
                x = layer.forward_decode_norms_in_products(&x, &ctx, cache, stack)?;
            }
            // The final norm inside the LM head's product, as the layers' norms are in theirs.
            let norm = input_norm(&self.model.norm);
            let counters = stacks.head_counters.as_ref();
            return decode_product(
                &x,
                &self.lm_head,
                DecodeEpilogue::Product,
                norm,
                None,
                counters,
            );
        }
        // `h` is `x` normalised for what reads it next: each layer's residual adds are fused
        // with the norm that follows them (the next layer's input norm, the final norm last).
        let mut h = match layers.first() {
            Some(l) => l.input_layernorm.forward(&x, path)?,
            None => self.model.norm.forward(&x, path)?,
        };
        for (i, layer) in layers.iter().enumerate() {
            let next_norm = layers
                .get(i + 1)
                .map_or(&self.model.norm, |l| &l.input_layernorm);
            let cache = LayerCache::Paged(pool.layer(i), step);
            (x, h) = layer.forward_decode(&x, &h, &ctx, cache, stacks.layers.get(i), next_norm)?;
        }
        Ok(self.head_logits(&h)?.squeeze(1)?)
    }
}
