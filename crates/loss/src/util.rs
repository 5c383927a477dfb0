//! Host-side helpers: the piecewise parts of the losses (clip selections, masks, IS weights)
//! are decided on detached host copies and enter the graph as constant tensors, so gradients
//! flow exactly through the smooth parts, as in the references.
use crate::{LossError, Result};
use candle_core::{DType, Tensor, D};

/// Detached host copy of a 2-D tensor as f64 rows.
pub(crate) fn host2(t: &Tensor) -> Result<Vec<Vec<f64>>> {
    Ok(t.detach().to_dtype(DType::F64)?.to_vec2::<f64>()?)
}

/// Detached host copy of a 1-D tensor.
pub(crate) fn host1(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.detach().to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

/// Detached host copy of a 3-D tensor.
pub(crate) fn host3(t: &Tensor) -> Result<Vec<Vec<Vec<f64>>>> {
    Ok(t.detach().to_dtype(DType::F64)?.to_vec3::<f64>()?)
}

/// A constant `[B, T]` tensor with the dtype and device of `like`.
pub(crate) fn const2(v: &[Vec<f64>], like: &Tensor) -> Result<Tensor> {
    let b = v.len();
    let t = v.first().map_or(0, |r| r.len());
    let flat: Vec<f64> = v.iter().flatten().copied().collect();
    Ok(Tensor::from_vec(flat, (b, t), like.device())?.to_dtype(like.dtype())?)
}

/// A constant 1-D tensor with the dtype and device of `like`.
pub(crate) fn const1(v: &[f64], like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::from_vec(v.to_vec(), v.len(), like.device())?.to_dtype(like.dtype())?)
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
