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

/// Mean of the replicas' pseudo-gradients, accumulated in f64 in the order given (callers pass
/// replicas sorted by id so every replica sums in the same order).
pub fn average(deltas: &[&[f32]]) -> Vec<f32> {
    let n = deltas.len().max(1) as f64;
    let len = deltas.first().map_or(0, |d| d.len());
    (0..len)
        .map(|i| (deltas.iter().map(|d| d[i] as f64).sum::<f64>() / n) as f32)
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
pub fn sgd_step(
    param: &mut [f32],
    momentum_buf: &mut [f32],
    grad: &[f32],
    lr: f64,
    momentum: f64,
    nesterov: bool,
) {
    let lr = lr as f32;
    let mu = momentum as f32;
    if momentum == 0.0 {
        for (p, g) in param.iter_mut().zip(grad) {
            *p -= lr * g;
        }
        return;
    }
    for ((p, b), g) in param.iter_mut().zip(momentum_buf.iter_mut()).zip(grad) {
        *b = mu * *b + g;
        let step = if nesterov { g + mu * *b } else { *b };
        *p -= lr * step;
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
