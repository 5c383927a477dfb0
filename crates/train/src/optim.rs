//! AdamW over named f32 `Var`s, with its state (m, v, step) saveable for checkpoints (candle's
//! `AdamW` keeps its state private). The update is `torch.optim.AdamW`'s (decoupled weight
//! decay, bias-corrected moments, ε added after the square root), in its arithmetic order, as
//! two in-place passes per parameter ([`composer_model::ops::adamw_update`]):
//!
//! ```text
//! θ ← θ − lr·λ·θ
//! m ← β1·m + (1−β1)·g          v ← β2·v + (1−β2)·g²
//! m̂ = m / (1−β1^t)             v̂ = v / (1−β2^t)
//! θ ← θ − lr · m̂ / (√v̂ + ε)
//! ```

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::{Tensor, Var};
use composer_model::ops::{adamw_update, AdamWStep};

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    /// β1, β2.
    pub betas: [f64; 2],
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
}

impl AdamWParams {
    /// Check the ranges the recipe checks (`[optimizer] betas`, `eps`, `weight_decay`), for
    /// callers that build the optimizer without a recipe: ε = 0 divides by √v̂ = 0 on a zero
    /// gradient (NaN weights), β = 1 makes the bias correction divide by 0.
    pub fn validate(&self) -> Result<()> {
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            bail!("AdamW eps = {}: must be a finite number > 0", self.eps);
        }
        if let Some(b) = self.betas.iter().find(|b| !(0.0..1.0).contains(*b)) {
            bail!(
                "AdamW betas = {:?}: each beta must be in [0, 1), got {b}",
                self.betas
            );
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            bail!(
                "AdamW weight_decay = {}: must be a finite number >= 0",
                self.weight_decay
            );
        }
        Ok(())
    }
}

/// AdamW state over a fixed, name-sorted list of variables.
pub struct AdamW {
    /// (name, var), sorted by name so every reduction has a fixed order.
    pub vars: Vec<(String, Var)>,
    /// Moments by name: `[2, …]` of the variable's shape, m then v (one tensor: the update's
    /// first pass writes both).
    pub moments: HashMap<String, Tensor>,
    /// Optimizer steps taken.
    pub step: u64,
    /// Hyper-parameters.
    pub params: AdamWParams,
}

impl AdamW {
    /// Fresh state (zero moments) for `vars`.
    pub fn new(mut vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        params.validate()?;
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut moments = HashMap::new();
        for (name, var) in &vars {
            let t = var.as_tensor();
            let mut shape = vec![2];
            shape.extend_from_slice(t.dims());
            moments.insert(name.clone(), Tensor::zeros(shape, t.dtype(), t.device())?);
        }
        Ok(Self {
            vars,
            moments,
            step: 0,
            params,
        })
    }

    /// One update with learning rate `lr` from `grads` (by name; a variable without a gradient
    /// is not updated, its moments not decayed).
    pub fn step(&mut self, grads: &HashMap<String, Tensor>, lr: f64) -> Result<()> {
        self.step += 1;
        let h = AdamWStep {
            lr,
            betas: self.params.betas,
            eps: self.params.eps,
            weight_decay: self.params.weight_decay,
            step: self.step,
        };
        for (name, var) in &self.vars {
            let Some(g) = grads.get(name) else { continue };
            let moments = self.moments.get(name).context("optimizer state")?;
            adamw_update(var.as_tensor(), moments, g, &h)
                .with_context(|| format!("AdamW update of {name}"))?;
        }
        Ok(())
    }

    /// Moments as named tensors (`m.<name>`, `v.<name>`) for a safetensors file.
    pub fn state_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for (k, t) in &self.moments {
            out.insert(format!("m.{k}"), t.get(0)?);
            out.insert(format!("v.{k}"), t.get(1)?);
        }
        Ok(out)
    }

    /// Restore moments from [`AdamW::state_tensors`] output and the step count.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        for (name, var) in &self.vars {
            let mut halves = Vec::with_capacity(2);
            for prefix in ["m", "v"] {
                let key = format!("{prefix}.{name}");
                let t = tensors
                    .get(&key)
                    .with_context(|| format!("optimizer state: missing tensor {key}"))?;
                if t.dims() != var.dims() {
                    anyhow::bail!(
                        "optimizer state: tensor {key} has shape {:?}, expected {:?}",
                        t.dims(),
                        var.dims()
                    );
                }
                let t = t.to_dtype(var.dtype())?.to_device(var.device())?;
                halves.push(t);
            }
            self.moments
                .insert(name.clone(), Tensor::stack(&halves, 0)?);
        }
        self.step = step;
        Ok(())
    }
}

/// Global L2 norm of the gradients: each one's sum of squares on its device, then one
/// read-back of them all (not one per gradient: on a GPU each is a synchronisation), summed in
/// f64 in name order.
pub fn grad_norm(names: &[String], grads: &HashMap<String, Tensor>) -> Result<f64> {
    let sums: Vec<Tensor> = names
        .iter()
        .filter_map(|n| grads.get(n))
        .map(|g| g.to_dtype(candle_core::DType::F32)?.sqr()?.sum_all())
        .collect::<candle_core::Result<_>>()?;
    if sums.is_empty() {
        return Ok(0.0);
    }
    let sums: Vec<f32> = Tensor::stack(&sums, 0)?.to_vec1()?;
    Ok(sums.iter().map(|&x| x as f64).sum::<f64>().sqrt())
}

/// Scale all gradients so their global norm is at most `max_norm` (torch clip_grad_norm_:
/// factor = max_norm / (norm + 1e-6), applied when < 1). `max_norm = 0` means no clipping
/// (`[optimizer] max_grad_norm = 0`); a negative, NaN or infinite `max_norm` is an error (it
/// used to skip clipping silently; the recipe refuses it at parse time).
pub fn clip_grads(grads: &mut HashMap<String, Tensor>, norm: f64, max_norm: f64) -> Result<()> {
    if !(max_norm >= 0.0 && max_norm.is_finite()) {
        bail!("max_grad_norm = {max_norm}: must be a finite number >= 0 (0 = no clipping)");
    }
    if max_norm == 0.0 {
        return Ok(());
    }
    let factor = max_norm / (norm + 1e-6);
    if factor < 1.0 {
        for g in grads.values_mut() {
            *g = (&*g * factor)?;
        }
    }
    Ok(())
}

/// Learning rate at optimizer step `step` (0-based): linear warm-up over `warmup` steps, then
/// constant or cosine decay to 0 at `total`.
pub fn lr_at(base: f64, step: usize, warmup: usize, total: usize, cosine: bool) -> f64 {
    if warmup > 0 && step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    if !cosine || total <= warmup {
        return base;
    }
    let p = ((step - warmup) as f64 / (total - warmup).max(1) as f64).min(1.0);
    base * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
}
