//! Tensor helpers of the losses. The piecewise parts of the losses (clip selections, masks, IS
//! weights) are decided by comparisons on detached tensors, on the inputs' device, and enter
//! the graph as constant 0/1 gates or bounds, so gradients flow exactly through the smooth
//! parts, as in the references. Nothing per-token is copied to the host: only single numbers
//! (metrics, counts, one order statistic at a time) are read back.
use crate::{LossError, Result};
use candle_core::{DType, Device, Tensor, D};

/// One number read back from a scalar (or one-element) tensor, as f64.
pub(crate) fn value(t: &Tensor) -> Result<f64> {
    Ok(t.detach()
        .flatten_all()?
        .get(0)?
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?)
}

/// A tensor of `like`'s shape, dtype and device filled with `v`.
pub(crate) fn full_like(like: &Tensor, v: f64) -> Result<Tensor> {
    Ok((like.zeros_like()? + v)?)
}

/// A constant 1-D tensor of host data (lengths, flags) with the dtype and device of `like`.
pub(crate) fn const1(v: &[f64], like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::from_vec(v.to_vec(), v.len(), like.device())?.to_dtype(like.dtype())?)
}

/// A `[B, 1]` column of per-row host values (flags, weights) with the dtype and device of
/// `like`, to broadcast over a `[B, T]` tensor.
pub(crate) fn row_column(v: &[f64], like: &Tensor) -> Result<Tensor> {
    Ok(const1(v, like)?.unsqueeze(1)?)
}

/// A 0/1 `u8` condition as a float gate of `like`'s dtype.
pub(crate) fn gate(cond: &Tensor, like: &Tensor) -> Result<Tensor> {
    Ok(cond.to_dtype(like.dtype())?)
}

/// Element-wise `a ∧ b` of two 0/1 `u8` conditions.
pub(crate) fn and(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok((a * b)?)
}

/// Element-wise `a ∨ b` of two 0/1 `u8` conditions.
pub(crate) fn or(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(a.maximum(b)?)
}

/// Element-wise `¬a` of a 0/1 `u8` condition.
pub(crate) fn not(a: &Tensor) -> Result<Tensor> {
    Ok(a.eq(0.0)?)
}

/// `on_true` where `cond` (u8) is set, else `on_false`, both constants, with `like`'s shape.
pub(crate) fn select(cond: &Tensor, on_true: f64, on_false: f64, like: &Tensor) -> Result<Tensor> {
    Ok(cond.where_cond(&full_like(like, on_true)?, &full_like(like, on_false)?)?)
}

/// `x` where `cond` (u8) is set, else the constant `v` (the value of `x` there never enters:
/// an infinity outside the condition gives `v`, not NaN).
pub(crate) fn keep_or(cond: &Tensor, x: &Tensor, v: f64) -> Result<Tensor> {
    Ok(cond.where_cond(x, &full_like(x, v)?)?)
}

/// torch.clamp with its gradient: the value `x` where `lo ≤ x ≤ hi` (gradient 1), else the
/// bound as a constant (gradient 0), the choice made on the detached value.
pub(crate) fn clamp_const(x: &Tensor, lo: f64, hi: f64) -> Result<Tensor> {
    let xd = x.detach();
    let inside = and(&xd.ge(lo)?, &xd.le(hi)?)?;
    let bound = select(&xd.lt(lo)?, lo, hi, &xd)?;
    Ok(inside.where_cond(x, &bound)?)
}

/// Σ x·m / max(1, Σ m) as a scalar tensor (TRL's `masked_mean`, local).
pub(crate) fn masked_mean(x: &Tensor, m: &Tensor) -> Result<Tensor> {
    let n = m.sum_all()?.maximum(1.0)?;
    Ok(((x * m)?.sum_all()? / n)?)
}

/// [`masked_mean`] read back as one number (a metric).
pub(crate) fn masked_mean_value(x: &Tensor, m: &Tensor) -> Result<f64> {
    value(&masked_mean(&x.detach(), m)?)
}

/// Inclusive prefix sum of a 1-D float tensor by doubling (Hillis–Steele: ⌈log₂ N⌉ shifted
/// adds), exact for 0/1 counts, with no `[N, N]` matrix.
pub(crate) fn inclusive_cumsum(x: &Tensor) -> Result<Tensor> {
    let n = x.dim(0)?;
    let mut y = x.clone();
    let mut s = 1;
    while s < n {
        let shifted = y.narrow(0, 0, n - s)?.pad_with_zeros(0, s, 0)?;
        y = (y + shifted)?;
        s *= 2;
    }
    Ok(y)
}

/// `x` rounded to the nearest value of `dtype` (f32 or f64), so a bisection pivot compares
/// the same on the device as on the host.
fn in_dtype(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        _ => x,
    }
}

/// The `k`-th smallest (0-based, ties counted) of `values` where the `u8` condition `active`
/// is set, exactly: a bisection on counts whose every round reads back one count or one
/// value, never the tensor. NaN when fewer than `k + 1` active values are ordered (NaNs
/// sort last, as `total_cmp`).
pub(crate) fn kth_smallest(values: &Tensor, active: &Tensor, k: usize) -> Result<f64> {
    let v = values.detach().flatten_all()?;
    let act = active.flatten_all()?;
    let dt = v.dtype();
    let v_act = keep_or(&act, &v, f64::INFINITY)?;
    let act_f = act.to_dtype(DType::F32)?;
    let need = (k + 1) as f64;
    let count_le = |x: f64| -> Result<f64> {
        value(&(v_act.le(x)?.to_dtype(DType::F32)? * &act_f)?.sum_all()?)
    };
    let min_above = |lo: f64| -> Result<f64> {
        value(&keep_or(&v_act.gt(lo)?, &v_act, f64::INFINITY)?.min_all()?)
    };
    let mut lo = value(&v_act.min_all()?)?;
    if count_le(lo)? >= need {
        return Ok(lo);
    }
    let mut hi = value(&keep_or(&act, &v, f64::NEG_INFINITY)?.max_all()?)?;
    loop {
        // Invariant: fewer than k + 1 active values are ≤ lo, so the answer lies above lo.
        let mid = in_dtype(lo + (hi - lo) / 2.0, dt);
        if mid > lo && mid < hi {
            if count_le(mid)? >= need {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        let next = min_above(lo)?;
        if !(next > lo) {
            return Ok(f64::NAN);
        }
        if count_le(next)? >= need {
            return Ok(next);
        }
        if next == f64::INFINITY {
            // Only NaNs are left above lo.
            return Ok(f64::NAN);
        }
        lo = next;
    }
}

/// The smallest value of `dtype` that is ≥ `x`: for values `v` of that dtype, `v ≥ x` exactly
/// when `v ≥ ceil_in_dtype(x)`, so a device comparison in f32 decides as the host's in f64.
pub(crate) fn ceil_in_dtype(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => {
            let f = x as f32;
            if (f as f64) < x {
                f.next_up() as f64
            } else {
                f as f64
            }
        }
        _ => x,
    }
}

/// Check that `t` has exactly `dims`.
pub(crate) fn check_shape(t: &Tensor, name: &'static str, dims: &[usize]) -> Result<()> {
    if t.dims() != dims {
        return Err(LossError::Shape {
            tensor: name,
            expected: format!("{dims:?}"),
            got: t.dims().to_vec(),
        });
    }
    Ok(())
}

/// Check that a tensor's dtype is f32 or f64.
pub(crate) fn check_float(t: &Tensor, name: &'static str) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::F64 => Ok(()),
        other => Err(LossError::Input {
            field: name,
            message: format!("dtype {other:?} is not supported (use f32 or f64)"),
        }),
    }
}

/// Differentiable log-sum-exp over the last dim (keepdim), the max taken as a constant.
pub(crate) fn logsumexp_last(x: &Tensor) -> Result<Tensor> {
    let max = x.detach().max_keepdim(D::Minus1)?;
    Ok((x
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + &max)?)
}

/// Differentiable logistic sigmoid, composed from exp and recip (candle's fused op has no
/// backward on every backend).
pub(crate) fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok((x.neg()?.exp()? + 1.0)?.recip()?)
}

/// Sum of `x * mask` over everything, as a scalar tensor.
pub(crate) fn masked_sum(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok((x * mask)?.sum_all()?)
}

#[cfg(test)]
pub(crate) mod tests;
