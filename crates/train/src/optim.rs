//! AdamW over named f32 `Var`s, with its state (m, v, step) saveable for checkpoints (candle's
//! `AdamW` keeps its state private). The update follows `torch.optim.AdamW` (decoupled weight
//! decay, bias-corrected moments, ε added after the square root):
//!
//! ```text
//! θ ← θ − lr·λ·θ
//! m ← β1·m + (1−β1)·g          v ← β2·v + (1−β2)·g²
//! m̂ = m / (1−β1^t)             v̂ = v / (1−β2^t)
//! θ ← θ − lr · m̂ / (√v̂ + ε)
//! ```

use std::collections::HashMap;

use anyhow::{Context, Result};
use candle_core::{Tensor, Var};

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

/// AdamW state over a fixed, name-sorted list of variables.
pub struct AdamW {
    /// (name, var), sorted by name so every reduction has a fixed order.
    pub vars: Vec<(String, Var)>,
    /// First moments, by name.
    pub m: HashMap<String, Tensor>,
    /// Second moments, by name.
    pub v: HashMap<String, Tensor>,
    /// Optimizer steps taken.
    pub step: u64,
    /// Hyper-parameters.
    pub params: AdamWParams,
}

impl AdamW {
    /// Fresh state (zero moments) for `vars`.
    pub fn new(mut vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut m = HashMap::new();
        let mut v = HashMap::new();
        for (name, var) in &vars {
            m.insert(name.clone(), var.as_tensor().zeros_like()?);
            v.insert(name.clone(), var.as_tensor().zeros_like()?);
        }
        Ok(Self {
            vars,
            m,
            v,
            step: 0,
            params,
        })
    }

    /// One update with learning rate `lr` from `grads` (by name; a missing gradient counts as 0).
    pub fn step(&mut self, grads: &HashMap<String, Tensor>, lr: f64) -> Result<()> {
        self.step += 1;
        let [b1, b2] = self.params.betas;
        let t = self.step as i32;
        let bc1 = 1.0 - b1.powi(t);
        let bc2 = 1.0 - b2.powi(t);
        for (name, var) in &self.vars {
            let Some(g) = grads.get(name) else { continue };
            let m = self.m.get(name).context("optimizer state")?;
            let v = self.v.get(name).context("optimizer state")?;
            let m = ((m * b1)? + (g * (1.0 - b1))?)?;
            let v = ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let theta = var.as_tensor();
            let theta = (theta * (1.0 - lr * self.params.weight_decay))?;
            let denom = ((&v / bc2)?.sqrt()? + self.params.eps)?;
            let upd = ((&m / bc1)? / denom)?;
            var.set(&(theta - (upd * lr)?)?)?;
            self.m.insert(name.clone(), m);
            self.v.insert(name.clone(), v);
        }
        Ok(())
    }

    /// Moments as named tensors (`m.<name>`, `v.<name>`) for a safetensors file.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (k, t) in &self.m {
            out.insert(format!("m.{k}"), t.clone());
        }
        for (k, t) in &self.v {
            out.insert(format!("v.{k}"), t.clone());
        }
        out
    }

    /// Restore moments from [`AdamW::state_tensors`] output and the step count.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64) -> Result<()> {
        for (name, var) in &self.vars {
            for (prefix, map) in [("m", &mut self.m), ("v", &mut self.v)] {
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
                map.insert(name.clone(), t.clone());
            }
        }
        self.step = step;
        Ok(())
    }
}

/// Global L2 norm of the gradients (fixed summation order by name).
pub fn grad_norm(names: &[String], grads: &HashMap<String, Tensor>) -> Result<f64> {
    let mut sq = 0f64;
    for n in names {
        if let Some(g) = grads.get(n) {
            sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
    }
    Ok(sq.sqrt())
}

/// Scale all gradients so their global norm is at most `max_norm` (torch clip_grad_norm_:
/// factor = max_norm / (norm + 1e-6), applied when < 1).
pub fn clip_grads(grads: &mut HashMap<String, Tensor>, norm: f64, max_norm: f64) -> Result<()> {
    if max_norm <= 0.0 {
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
