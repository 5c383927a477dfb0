//! The decode step's layer over the paged KV pool (no backward): [`DecoderLayer::forward_decode`]
//! and the projections, attention and MLP it calls — the stacked q/k/v and gate/up products
//! ([`super::decode_stacks`]), the skinny products with their split counters on CUDA, the
//! residual adds fused with the norms after them. The training forward and the other caches'
//! forwards are in [`super::layers`]; the layer with its norms inside the products is
//! [`DecoderLayer::forward_decode_norms_in_products`].

use super::decode_stacks::{LayerStacks, Stacked};
use super::layers::{
    rows_of, Attention, Ctx, DecoderLayer, LayerCache, Linear, Mlp, OpPath, Products, RmsNorm,
};
use crate::ops::{decode_product, DecodeEpilogue, InputNorm, SplitCounters};
use crate::paged_kv::{PagedStep, PoolLayer};
use anyhow::Result;
use candle_core::Tensor;

impl Linear {
    /// The decode step's projection of `x` `[.., in]`: with `counters` and no bias the skinny
    /// product ([`crate::ops::decode_product`]; cuBLAS where it does not serve), plus the
    /// adapter's delta; else [`Self::forward`].
    pub(super) fn forward_decode(
        &self,
        x: &Tensor,
        counters: Option<&SplitCounters>,
    ) -> Result<Tensor> {
        if counters.is_none() || self.bias.is_some() {
            return self.forward(x);
        }
        let x2 = rows_of(x)?;
        let y = decode_product(
            &x2,
            &self.weight,
            DecodeEpilogue::Product,
            None,
            None,
            counters,
        )?;
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = self.weight.dim(0)?;
        }
        self.plus_adapter(&x2, y.reshape(dims)?, Products::Plain)
    }
}

impl Attention {
    /// The decode step's attention over the paged pool. With `qkv` (the stacked projections,
    /// [`Stacked`]) one product (and the adapters' two) gives q, k and v, and their biases and
    /// RoPE are one fused op ([`crate::ops::qkv_bias_rope`]); otherwise [`Self::forward`].
    pub(super) fn forward_decode(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        cache: LayerCache,
        qkv: Option<&Stacked>,
        counters: Option<&SplitCounters>,
    ) -> Result<Tensor> {
        let (LayerCache::Paged(pool, step), Some(qkv)) = (&cache, qkv) else {
            return self.forward(x, ctx, Some(cache));
        };
        let (b, t, hidden) = x.dims3()?;
        let x = x.reshape((b * t, hidden))?;
        let out = self.attend_decode(&x, None, ctx, (pool, step), qkv, counters)?;
        self.o_proj
            .forward_decode(&out.reshape((b * t, 1, out.dim(1)?))?, counters)
    }

    /// The decode step's attention output `[rows, heads·head_dim]`, before `o_proj`, of `x`
    /// `[rows, hidden]` (through `norm` first, if given): q/k/v from the stacked product —
    /// with no adapter, one op from the product to the cache
    /// ([`crate::ops::decode_qkv_into_cache`]: q back, the keys and values in their slots) —
    /// then q attending over the rows' blocks.
    pub(super) fn attend_decode(
        &self,
        x: &Tensor,
        norm: Option<InputNorm>,
        ctx: &Ctx,
        (pool, step): (&PoolLayer, &PagedStep),
        qkv: &Stacked,
        counters: Option<&SplitCounters>,
    ) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let hd = self.head_dim;
        let cos = ctx.cos.reshape((rows, hd / 2))?;
        let sin = ctx.sin.reshape((rows, hd / 2))?;
        let heads = self.qkv_heads();
        let q = if qkv.lora.is_none() {
            crate::ops::decode_qkv_into_cache(
                x,
                norm,
                &qkv.weight,
                qkv.bias.as_ref(),
                &cos,
                &sin,
                heads,
                pool.pools(),
                &step.slots,
                counters,
            )?
        } else {
            let qkv_out = qkv.product(&crate::ops::input_normed(x, norm)?, counters)?;
            let (q, kv) =
                crate::ops::qkv_bias_rope(&qkv_out, qkv.bias.as_ref(), &cos, &sin, heads)?;
            pool.write(&step.slots, &kv)?;
            q
        };
        self.attend_written(&q, pool, step)
    }
}

impl Mlp {
    /// The decode step's MLP: with `gate_up` (gate's and up's projections stacked) one product
    /// and one packed SwiGLU instead of two products and a SwiGLU — with `counters` and no
    /// adapter, one skinny product with the SwiGLU as its epilogue.
    pub(super) fn forward_decode(
        &self,
        x: &Tensor,
        path: OpPath,
        gate_up: Option<&Stacked>,
        counters: Option<&SplitCounters>,
    ) -> Result<Tensor> {
        let Some(gu) = gate_up else {
            return self.forward(x, path, Products::Plain);
        };
        let (b, t, hidden) = x.dims3()?;
        let x2 = x.reshape((b * t, hidden))?;
        let h = match &gu.lora {
            None => decode_product(
                &x2,
                &gu.weight,
                DecodeEpilogue::Swiglu,
                None,
                None,
                counters,
            )?,
            Some(_) => crate::ops::swiglu_packed(&gu.product(&x2, counters)?)?,
        };
        self.down_proj
            .forward_decode(&h.reshape((b, t, h.dim(1)?))?, counters)
    }
}

impl DecoderLayer {
    /// The decode step's layer (no backward): `h` is `x` through this layer's input norm;
    /// returns `(y, next_norm(y))` with `y` the layer's output, each residual add fused with
    /// the norm after it (this layer's post-attention norm, then `next_norm`: the next layer's
    /// input norm or the final norm).
    pub(super) fn forward_decode(
        &self,
        x: &Tensor,
        h: &Tensor,
        ctx: &Ctx,
        cache: LayerCache,
        stacks: Option<&LayerStacks>,
        next_norm: &RmsNorm,
    ) -> Result<(Tensor, Tensor)> {
        let qkv = stacks.and_then(|s| s.qkv.as_ref());
        let counters = stacks.and_then(|s| s.counters.as_ref());
        let attn = self
            .self_attn
            .forward_decode(h, ctx, cache, qkv, counters)?;
        let (x, h) = self
            .post_attention_layernorm
            .add_forward(x, &attn, ctx.path)?;
        let gate_up = stacks.and_then(|s| s.gate_up.as_ref());
        let mlp = self.mlp.forward_decode(&h, ctx.path, gate_up, counters)?;
        next_norm.add_forward(&x, &mlp, ctx.path)
    }
}
