//! The decode step's stacked projections: a layer's q/k/v and gate/up weights (with their
//! adapters) stacked for one product each, and the split-k counters of the layer's skinny
//! decode products ([`crate::ops::decode_product`]), built once per rollout
//! ([`super::DecodeStacks`]); and the decode layer with its norms and residual adds inside
//! those products ([`DecoderLayer::forward_decode_norms_in_products`]).

use super::layers::{DecoderLayer, Linear, RmsNorm};
use super::Ctx;
use crate::lora_adapter::LoraAdapter;
use crate::ops::{decode_product, DecodeEpilogue, InputNorm, SplitCounters};
use crate::paged_kv::{PagedStep, PoolLayer};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

/// Projections that read the same input stacked for the decode step's one product: q/k/v's
/// weights `[(heads + 2·kv_heads)·head_dim, hidden]` (q's rows, k's, v's) and their biases
/// alike, or gate's and up's `[2·intermediate, hidden]`; with their LoRA adapters, if any.
#[derive(Debug)]
pub(crate) struct Stacked {
    pub(super) weight: Tensor,
    pub(super) bias: Option<Tensor>,
    pub(super) lora: Option<StackedLora>,
}

impl Stacked {
    /// `linears` (reading the same input, biases on all or none) stacked in their order.
    fn of(linears: &[&Linear]) -> Result<Stacked> {
        let stack = |ts: &[&Tensor]| -> Result<Tensor> { Ok(Tensor::cat(ts, 0)?.detach()) };
        let weights: Vec<&Tensor> = linears.iter().map(|l| &l.weight).collect();
        let biases: Vec<&Tensor> = linears.iter().filter_map(|l| l.bias.as_ref()).collect();
        Ok(Stacked {
            weight: stack(&weights)?,
            bias: (!biases.is_empty()).then(|| stack(&biases)).transpose()?,
            lora: StackedLora::of(linears)?,
        })
    }

    /// The stacked projections of `x` `[rows, in]`, without the biases: `x·Wᵀ` (the skinny
    /// decode product with `counters`, [`crate::ops::decode_product`]), plus the adapters'
    /// packed delta.
    pub(super) fn product(&self, x: &Tensor, counters: Option<&SplitCounters>) -> Result<Tensor> {
        let y = decode_product(
            x,
            &self.weight,
            DecodeEpilogue::Product,
            None,
            None,
            counters,
        )?;
        match &self.lora {
            Some(l) => l.add_to(&y, x),
            None => Ok(y),
        }
    }
}

/// The LoRA adapters of stacked projections as two products: `x·aᵀ`, with `a` the adapted
/// projections' `lora_A` stacked (`[Σ r, in]`), then `·bᵀ`, with `b` `[Σ out, Σ r]`
/// block-diagonal — each adapter's `scaling · lora_B` on its projection's rows and its own
/// rank's columns, zero rows for a projection without one. The result is the packed delta
/// of the stacked product (exactly zero where `lora_B` is zero).
#[derive(Debug)]
pub(super) struct StackedLora {
    a: Tensor,
    b: Tensor,
}

impl StackedLora {
    /// Of `linears` in stacking order; None when none has an adapter.
    fn of(linears: &[&Linear]) -> Result<Option<StackedLora>> {
        let adapters: Vec<&LoraAdapter> = linears.iter().filter_map(|l| l.lora.as_ref()).collect();
        if adapters.is_empty() {
            return Ok(None);
        }
        let a = Tensor::cat(&adapters.iter().map(|ad| &ad.lora_a).collect::<Vec<_>>(), 0)?;
        let rank = a.dim(0)?;
        let mut blocks = Vec::with_capacity(linears.len());
        let mut col = 0;
        for l in linears {
            let (out, dtype, dev) = (l.weight.dim(0)?, l.weight.dtype(), l.weight.device());
            let zeros = |cols: usize| Tensor::zeros((out, cols), dtype, dev);
            blocks.push(match &l.lora {
                Some(ad) => {
                    let r = ad.lora_a.dim(0)?;
                    let b = (&ad.lora_b * ad.scaling)?;
                    let block = Tensor::cat(&[&zeros(col)?, &b, &zeros(rank - col - r)?], 1)?;
                    col += r;
                    block
                }
                None => zeros(rank)?,
            });
        }
        Ok(Some(StackedLora {
            a: a.detach(),
            b: Tensor::cat(&blocks, 0)?.detach(),
        }))
    }

    /// `y + (x·aᵀ)·bᵀ` for the stacked product `y` of `x` `[rows, in]`.
    fn add_to(&self, y: &Tensor, x: &Tensor) -> Result<Tensor> {
        let delta = crate::ops::linear(&crate::ops::linear(x, &self.a, None)?, &self.b, None)?;
        Ok((y + delta)?)
    }
}

/// A decoder layer's projections stacked for the decode step, where they can be (see
/// [`DecoderLayer::stack_for_decode`]): on a GPU, where the decode step is bound by launches,
/// two products fewer per layer than the separate projections (with adapters, two products
/// per stack for all of its adapters instead of two per adapter). A copy of those weights,
/// built from the weights the rollout samples with.
#[derive(Debug)]
pub(crate) struct LayerStacks {
    pub(super) qkv: Option<Stacked>,
    pub(super) gate_up: Option<Stacked>,
    /// The split-k counters of the layer's skinny decode products, where they run
    /// ([`SplitCounters::for_device`]).
    pub(super) counters: Option<SplitCounters>,
    /// Whether the layer runs [`DecoderLayer::forward_decode_norms_in_products`]: the skinny
    /// products are turned on (`COMPOSER_DECODE_GEMM=1`, [`crate::ops::decode_gemm_on`]), q/k/v
    /// and gate/up are stacked without adapters, o and down have neither bias nor adapter.
    pub(super) norms_in_products: bool,
}

impl DecoderLayer {
    /// This layer's projections stacked for the decode step ([`LayerStacks`]), adapters
    /// included: q/k/v where the layer has no q/k norms (they act between the projection and
    /// RoPE) and all or none have biases; gate/up where neither has a bias.
    pub(crate) fn stack_for_decode(&self) -> Result<LayerStacks> {
        let a = &self.self_attn;
        let qkv = [&a.q_proj, &a.k_proj, &a.v_proj];
        let biases = qkv.iter().filter(|p| p.bias.is_some()).count();
        let qkv = if a.q_norm.is_none() && a.k_norm.is_none() && (biases == 0 || biases == 3) {
            Some(Stacked::of(&qkv)?)
        } else {
            None
        };
        let m = &self.mlp;
        let gate_up = [&m.gate_proj, &m.up_proj];
        let gate_up = if gate_up.iter().all(|p| p.bias.is_none()) {
            Some(Stacked::of(&gate_up)?)
        } else {
            None
        };
        // The products that take counters: the q/k/v and gate/up stacks, o and down.
        let rows = |ps: &[&Linear]| -> candle_core::Result<usize> {
            ps.iter().map(|p| p.weight.dim(0)).sum()
        };
        let max_out = [
            rows(&[&a.q_proj, &a.k_proj, &a.v_proj])?,
            rows(&[&a.o_proj])?,
            rows(&[&m.gate_proj, &m.up_proj])?,
            rows(&[&m.down_proj])?,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let device = a.q_proj.weight.device();
        let counters = SplitCounters::for_device(device, max_out)?;
        let plain = |l: &Linear| l.bias.is_none() && l.lora.is_none();
        let stacked = |s: &Option<Stacked>| s.as_ref().is_some_and(|s| s.lora.is_none());
        // On CUDA only where every product runs on the kernel (elsewhere two rms_norm and two
        // adds would replace two add_rms_norm: more launches); on the CPU always, the
        // kernel's twin.
        let on_kernel = || -> Result<bool> {
            let (product, swiglu) = (DecodeEpilogue::Product, DecodeEpilogue::Swiglu);
            let serves = |l: &[&Linear], epilogue| -> Result<bool> {
                let (rows, k) = (rows(l)?, l[0].weight.dim(1)?);
                Ok(crate::ops::decode_product_serves(rows, k, epilogue))
            };
            Ok(counters.is_some()
                && a.q_proj.weight.dtype() == DType::BF16
                && crate::ops::decode_qkv_serves(a.qkv_heads(), a.q_proj.weight.dim(1)?)
                && serves(&[&a.o_proj], product)?
                && serves(&[&m.gate_proj, &m.up_proj], swiglu)?
                && serves(&[&m.down_proj], product)?)
        };
        let norms_in_products = crate::ops::decode_gemm_on()
            && stacked(&qkv)
            && stacked(&gate_up)
            && plain(&a.o_proj)
            && plain(&m.down_proj)
            && (device.is_cpu() || on_kernel()?);
        Ok(LayerStacks {
            qkv,
            gate_up,
            counters,
            norms_in_products,
        })
    }

    /// The decode step's layer with its norms and residual adds inside the products that read
    /// them ([`LayerStacks::norms_in_products`]): `x` `[rows, hidden]` is the residual stream
    /// in; returns the stream out. On the skinny kernel five launches — q/k/v with the input
    /// norm in front and the keys and values into the cache, the attention, o with the residual
    /// added, gate/up with the post-attention norm in front and SwiGLU after, down with the
    /// residual added — where [`Self::forward_decode`] has two `add_rms_norm` besides; elsewhere
    /// the same ops one by one (the norm, the product, the add: the trainer's).
    pub(super) fn forward_decode_norms_in_products(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        cache: (&PoolLayer, &PagedStep),
        stacks: &LayerStacks,
    ) -> Result<Tensor> {
        let (Some(qkv), Some(gate_up), true) =
            (&stacks.qkv, &stacks.gate_up, stacks.norms_in_products)
        else {
            bail!("decode layer: its projections are not stacked for norms in the products");
        };
        let counters = stacks.counters.as_ref();
        let (attn, mlp) = (&self.self_attn, &self.mlp);
        let out = attn.attend_decode(
            x,
            input_norm(&self.input_layernorm),
            ctx,
            cache,
            qkv,
            counters,
        )?;
        let product = DecodeEpilogue::Product;
        let x = decode_product(&out, &attn.o_proj.weight, product, None, Some(x), counters)?;
        let post_norm = input_norm(&self.post_attention_layernorm);
        let swiglu = DecodeEpilogue::Swiglu;
        let h = decode_product(&x, &gate_up.weight, swiglu, post_norm, None, counters)?;
        decode_product(&h, &mlp.down_proj.weight, product, None, Some(&x), counters)
    }
}

/// `n` as the norm in front of a decode product.
pub(super) fn input_norm(n: &RmsNorm) -> Option<InputNorm<'_>> {
    Some(InputNorm {
        weight: &n.weight,
        eps: n.eps,
    })
}
