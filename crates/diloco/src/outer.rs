//! The outer optimizer: SGD with (Nesterov) momentum applied to averaged pseudo-gradients.
//!
//! Pure functions on flat f32 slices so every replica computes the identical result.

/// Pseudo-gradient Δ = θ_global(round start) − θ_local, elementwise (torchft `_save_grads`).
///
/// With this sign, an SGD step `θ ← θ_global − lr·Δ` moves the global weights towards the
/// local ones; lr = 1 and no momentum gives back θ_local.
pub fn pseudo_gradient(global: &[f32], local: &[f32]) -> Vec<f32> {
    global.iter().zip(local).map(|(g, l)| g - l).collect()
}

/// Δ = θ_global − θ_local in f64. The difference of two f32 values is exact in f64 unless
/// their exponents are more than 29 apart, so θ_global − Δ gives back θ_local bit for bit.
pub fn pseudo_gradient_f64(global: &[f32], local: &[f32]) -> Vec<f64> {
    global
        .iter()
        .zip(local)
        .map(|(g, l)| *g as f64 - *l as f64)
        .collect()
}

/// Mean of the replicas' pseudo-gradients, accumulated in f64 in the order given (callers pass
/// replicas sorted by id so every replica sums in the same order).
pub fn average(deltas: &[&[f64]]) -> Vec<f64> {
    let n = deltas.len().max(1) as f64;
    let len = deltas.first().map_or(0, |d| d.len());
    (0..len)
        .map(|i| deltas.iter().map(|d| d[i]).sum::<f64>() / n)
        .collect()
}

/// One outer SGD step on `param` with gradient `grad` (the averaged pseudo-gradient), following
/// torch.optim.SGD (dampening 0, weight decay 0):
///
/// ```text
/// buf ← μ·buf + g            (buf starts at 0, so the first step gives buf = g like torch)
/// g'  ← g + μ·buf  if nesterov, else buf
/// θ   ← θ − lr·g'
/// ```
///
/// With μ = 0 the momentum buffer is left untouched (torch keeps no buffer then either).
/// Computed in f64 and rounded once to f32 (weights and buffer are stored in f32): with lr = 1,
/// μ = 0 and an exact f64 Δ, θ − Δ is exactly θ_local, so the step returns θ_local bit for bit.
pub fn sgd_step(
    param: &mut [f32],
    momentum_buf: &mut [f32],
    grad: &[f64],
    lr: f64,
    momentum: f64,
    nesterov: bool,
) {
    if momentum == 0.0 {
        for (p, g) in param.iter_mut().zip(grad) {
            *p = (*p as f64 - lr * g) as f32;
        }
        return;
    }
    for ((p, b), g) in param.iter_mut().zip(momentum_buf.iter_mut()).zip(grad) {
        let buf = momentum * *b as f64 + g;
        let step = if nesterov { g + momentum * buf } else { buf };
        *b = buf as f32;
        *p = (*p as f64 - lr * step) as f32;
    }
}

/// torchft's `_merge_parameters`: `global.lerp_(local, α)` = (1−α)·global + α·local.
pub fn merge(global: &[f32], local: &[f32], alpha: f64) -> Vec<f32> {
    if alpha == 0.0 {
        return global.to_vec();
    }
    let a = alpha as f32;
    global
        .iter()
        .zip(local)
        .map(|(g, l)| g + a * (l - g))
        .collect()
}
