//! `[train] bf16`: mixed-precision training. The optimizer's variables stay f32 master
//! weights (AdamW's moments are f32 too, and checkpoints store the masters, so a resumed run
//! continues exactly); the forward and backward of every training pass run on a
//! [`ComputeCopy`], variables of the same names in the compute dtype (bf16) that the policy's
//! transformer is built over. Its gradients come back cast to f32 per micro-batch
//! ([`ComputeCopy::master_grads`]), so accumulation, the norm, clipping, the non-finite guard
//! and the AdamW step all work in f32; after every change of the masters the copy is cast
//! again ([`ComputeCopy::refresh`]), and rollouts sample with it.
//!
//! candle's own `AdamW` updates in the variables' dtype, which is why the masters are kept
//! apart from the compute copy rather than training bf16 variables directly.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

/// The compute dtype a recipe asks for: bf16 with `[train] bf16 = true`, else f32 (no copy).
pub fn compute_dtype(bf16: bool) -> DType {
    if bf16 {
        DType::BF16
    } else {
        DType::F32
    }
}

/// A copy of master variables in a lower-precision compute dtype, by the same names.
pub struct ComputeCopy {
    /// The compute dtype (bf16).
    pub dtype: DType,
    /// The compute variables: the tensors the policy's forward reads and the backward
    /// differentiates.
    pub varmap: VarMap,
}

impl ComputeCopy {
    /// Fresh compute variables: every variable of `masters` cast to `dtype`.
    pub fn of(masters: &VarMap, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            bail!("mixed precision: compute dtype must be bf16 or f16, got {dtype:?}");
        }
        let varmap = VarMap::new();
        {
            let src = lock(masters)?;
            let mut dst = lock(&varmap)?;
            for (name, master) in src.iter() {
                dst.insert(
                    name.clone(),
                    Var::from_tensor(&master.as_tensor().detach().to_dtype(dtype)?)?,
                );
            }
        }
        Ok(Self { dtype, varmap })
    }

    /// Casts `masters` into the compute variables again, in place (the transformer built
    /// over them sees the new values): called after every change of the masters.
    pub fn refresh(&self, masters: &VarMap) -> Result<()> {
        let src = lock(masters)?;
        let dst = lock(&self.varmap)?;
        if src.len() != dst.len() {
            bail!(
                "mixed precision: {} master variables but {} compute variables",
                src.len(),
                dst.len()
            );
        }
        for (name, master) in src.iter() {
            let var = dst
                .get(name)
                .with_context(|| format!("mixed precision: no compute variable {name}"))?;
            var.set(&master.as_tensor().detach().to_dtype(self.dtype)?)?;
        }
        Ok(())
    }

    /// The gradient of every compute variable found in `store`, cast to f32 and keyed by the
    /// master's name: what the f32 accumulators, the clip and AdamW read.
    pub fn master_grads(&self, store: &GradStore) -> Result<HashMap<String, Tensor>> {
        let vars = lock(&self.varmap)?;
        let mut out = HashMap::new();
        for (name, var) in vars.iter() {
            if let Some(g) = store.get(var.as_tensor()) {
                out.insert(name.clone(), g.to_dtype(DType::F32)?);
            }
        }
        Ok(out)
    }
}

/// The gradients of the variables of `varmap` (f32 masters trained directly) in `store`.
pub fn direct_grads(varmap: &VarMap, store: &GradStore) -> Result<HashMap<String, Tensor>> {
    let vars = lock(varmap)?;
    let mut out = HashMap::new();
    for (name, var) in vars.iter() {
        if let Some(g) = store.get(var.as_tensor()) {
            out.insert(name.clone(), g.clone());
        }
    }
    Ok(out)
}

fn lock(v: &VarMap) -> Result<std::sync::MutexGuard<'_, HashMap<String, Var>>> {
    v.data()
        .lock()
        .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))
}
