//! Per-layer gradient checkpointing (TRL's `gradient_checkpointing`): a training forward
//! keeps only each decoder layer's input; the layer's backward re-runs its forward on a
//! fresh graph and backpropagates through that, so a layer's activations live only while
//! its own gradient is computed.
//!
//! candle has no hook for this, so a layer becomes two custom ops:
//! - `Recompute(x, token) → y`: its forward returns the output of a graph-free forward of
//!   the layer (weights detached, nothing saved; only `x` stays referenced); its backward recomputes the layer from `x`
//!   with the trainable weights tracked, backpropagates the output gradient, returns `∂x`
//!   and stores every trainable weight's gradient.
//! - a chain of `ParamLink(token, w)`, one per trainable weight, producing the scalar
//!   `token`: they make each weight an ancestor of `y` in the graph, so candle's backward
//!   visits them after `Recompute` (reverse topological order) and hands each weight its
//!   stored gradient. The token is a scalar: the links cost no memory.
//!
//! LoRA dropout masks are redrawn in the recomputation from a fork of the dropout stream
//! taken before the forward, so the backward sees the forward's masks.

use super::layers::{Ctx, DecoderLayer};
use anyhow::{Context, Result};
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, Var};
use std::sync::{Arc, Mutex};

/// The gradients `Recompute`'s backward computes, one slot per trainable weight, taken by
/// the weights' `ParamLink`s.
type GradSlots = Arc<Mutex<Vec<Option<Tensor>>>>;

/// The layer's output for input `x` `[B, T, hidden]`, its activations recomputed in the
/// backward. Gradients reach `x` and every trainable (variable) tensor of the layer.
pub(super) fn forward(layer: &DecoderLayer, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
    // Taken before the forward draws its dropout masks.
    let replay = with_forked_dropout(layer)?;
    let mut plain = layer.clone();
    plain.map_tensors(&mut |t| Ok(t.detach()))?;
    let y = plain.forward(&x.detach(), ctx, None)?.contiguous()?;
    let mut params = Vec::new();
    layer.clone().map_tensors(&mut |t| {
        if t.is_variable() {
            params.push(t.clone());
        }
        Ok(t.clone())
    })?;
    let slots: GradSlots = Arc::new(Mutex::new(vec![None; params.len()]));
    let mut token = Tensor::zeros((), x.dtype(), x.device())?;
    for (index, w) in params.iter().enumerate() {
        token = token.apply_op2(
            w,
            ParamLink {
                index,
                slots: slots.clone(),
            },
        )?;
    }
    let op = Recompute {
        layer: replay,
        ctx: ctx.clone(),
        params,
        slots,
        output: Mutex::new(Some(y)),
    };
    Ok(x.apply_op2(&token, op)?)
}

/// A copy of `layer` whose LoRA adapters share one fork of the dropout stream.
fn with_forked_dropout(layer: &DecoderLayer) -> Result<DecoderLayer> {
    let mut copy = layer.clone();
    let mut fork = None;
    for l in copy.linears_mut() {
        if let Some(d) = l.lora.as_mut().and_then(|a| a.dropout.as_mut()) {
            if fork.is_none() {
                fork = Some(d.fork()?);
            }
            *d = fork.clone().expect("set above");
        }
    }
    Ok(copy)
}

/// The layer op: forward = the precomputed output, backward = recompute and backpropagate.
struct Recompute {
    /// The layer, its dropout stream forked at the forward.
    layer: DecoderLayer,
    ctx: Ctx,
    /// The layer's trainable tensors, in `slots` order.
    params: Vec<Tensor>,
    slots: GradSlots,
    /// The graph-free forward's output, moved into the op's result.
    output: Mutex<Option<Tensor>>,
}

impl CustomOp2 for Recompute {
    fn name(&self) -> &'static str {
        "checkpointed-decoder-layer"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _lx: &Layout,
        _token: &CpuStorage,
        _lt: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = self.take_output()?;
        let (storage, layout) = y.storage_and_layout();
        let candle_core::Storage::Cpu(s) = &*storage else {
            candle_core::bail!("checkpointed layer: output not on the CPU")
        };
        match layout.contiguous_offsets() {
            Some((0, end)) if end == y.elem_count() => {}
            _ => candle_core::bail!("checkpointed layer: output not a contiguous fresh tensor"),
        }
        Ok((s.clone(), y.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _lx: &Layout,
        _token: &candle_core::CudaStorage,
        _lt: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let y = self.take_output()?;
        let (storage, layout) = y.storage_and_layout();
        let candle_core::Storage::Cuda(s) = &*storage else {
            candle_core::bail!("checkpointed layer: output not on the GPU")
        };
        // The op must return an owned storage: one device copy of the layer's output.
        Ok((s.try_clone(layout)?, y.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        token: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = self
            .recompute(x, grad)
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        Ok((Some(dx), Some(token.zeros_like()?)))
    }
}

impl Recompute {
    /// The graph-free forward's output (once).
    fn take_output(&self) -> candle_core::Result<Tensor> {
        self.output
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint output lock poisoned".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("checkpointed layer applied twice".into()))
    }

    /// Re-runs the layer on `x` with the weights tracked, backpropagates `grad` (∂loss/∂y),
    /// stores the weights' gradients in the slots and returns ∂loss/∂x.
    fn recompute(&self, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        // A fresh fork for every backward, so each sees the forward's masks.
        let layer = with_forked_dropout(&self.layer)?;
        let xv = Var::from_tensor(&x.detach())?;
        let y = layer.forward(xv.as_tensor(), &self.ctx, None)?;
        let grads = (y * grad.detach())?.sum_all()?.backward()?;
        let mut slots = self
            .slots
            .lock()
            .map_err(|_| anyhow::anyhow!("checkpoint gradient lock poisoned"))?;
        for (slot, w) in slots.iter_mut().zip(&self.params) {
            *slot = Some(match grads.get(w) {
                Some(g) => g.clone(),
                None => w.zeros_like()?,
            });
        }
        grads
            .get(xv.as_tensor())
            .cloned()
            .context("checkpointed layer: the input got no gradient")
    }
}

/// Links trainable weight `index` into the graph; its backward hands the weight the
/// gradient `Recompute` stored.
struct ParamLink {
    index: usize,
    slots: GradSlots,
}

impl CustomOp2 for ParamLink {
    fn name(&self) -> &'static str {
        "checkpointed-layer-weight"
    }

    fn cpu_fwd(
        &self,
        token: &CpuStorage,
        layout: &Layout,
        _w: &CpuStorage,
        _lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((token.clone(), layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        token: &candle_core::CudaStorage,
        layout: &Layout,
        _w: &candle_core::CudaStorage,
        _lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        Ok((token.try_clone(layout)?, layout.shape().clone()))
    }

    fn bwd(
        &self,
        _token: &Tensor,
        _w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = self
            .slots
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint gradient lock poisoned".into()))?
            .get_mut(self.index)
            .and_then(Option::take)
            .ok_or_else(|| {
                candle_core::Error::Msg(
                    "checkpointed layer: weight gradient missing (the layer's backward did not run first)"
                        .into(),
                )
            })?;
        Ok((Some(grad.clone()), Some(g)))
    }
}
