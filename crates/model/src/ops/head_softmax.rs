//! The LM head's softmax algebra over one chunk of logits `z` `[rows, V]`, one fused pass per
//! row instead of a dozen whole-chunk tensor ops (each a pass over `rows × V` and, for a
//! 151,936-token vocabulary, an f32 temporary of that size):
//!
//! - [`head_row_stats`]: per row of `x = z / T`, the log-sum-exp `lse` and the entropy
//!   `H = lse − Σ p·x` of `p = softmax(x)`;
//! - [`head_logits_grad`]: the gradient of the row's gathered log-probs (weights `Gₖ` at ids
//!   `idₖ`) and entropy (weight `E`) with respect to `z`:
//!   `∂z = (Σₖ Gₖ(δ_{idₖ} − p) − E·p·(log p + H)) / T`, written straight in `z`'s dtype.
//!
//! [`crate::chunked_logprobs`] calls them between its matrix products. Kernels: the CPU (f32,
//! f64; bf16/f16 logits are widened to f32 first) and CUDA (f32, bf16 logits, f32 math, in
//! `head_kernels.cuh`); elsewhere the candle compositions (`*_composed`), which the tests compare
//! against. Neither function builds a gradient graph: they are the inside of a custom op.

use super::{kernels_apply_to, par_map, par_rows, with_slice, work_dtype, Real};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};

/// `[rows, 2]` (work dtype: f32, f64 for f64): the log-sum-exp and the entropy of each row of
/// `softmax(z / temperature)`.
pub fn head_row_stats(z: &Tensor, temperature: f64) -> Result<Tensor> {
    let (rows, v) = z
        .dims2()
        .context("head_row_stats: z must be [rows, vocab]")?;
    check_temperature(temperature)?;
    if v == 0 {
        bail!("head_row_stats: the vocabulary is empty");
    }
    let inv_t = 1.0 / temperature;
    #[cfg(feature = "cuda")]
    if z.device().is_cuda() && kernels_apply_to(z.device(), z.dtype()) {
        return Ok(super::softmax_cuda::head_row_stats(z, inv_t)?);
    }
    if !z.device().is_cpu() {
        return head_row_stats_composed(z, temperature);
    }
    let z = cpu_kernel_input(z)?;
    let stats = match z.dtype() {
        DType::F32 => with_slice::<f32, _>(&z, "head_row_stats", |s| row_stats(s, v, inv_t))?,
        DType::F64 => {
            let s = with_slice::<f64, _>(&z, "head_row_stats", |s| row_stats(s, v, inv_t))?;
            return Ok(Tensor::from_vec(s, (rows, 2), &Device::Cpu)?);
        }
        other => bail!("head_row_stats: unsupported dtype {other:?}"),
    };
    Ok(Tensor::from_vec(stats, (rows, 2), &Device::Cpu)?)
}

/// [`head_row_stats`] from candle ops (the reference, and the path off the kernels).
pub fn head_row_stats_composed(z: &Tensor, temperature: f64) -> Result<Tensor> {
    let x = (z.to_dtype(work_dtype(z.dtype()))? * (1.0 / temperature))?;
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let lse = (sum.log()? + max)?;
    let expected_x = ((e * &x)?.sum_keepdim(D::Minus1)? / sum)?;
    let entropy = (&lse - expected_x)?;
    Ok(Tensor::cat(&[&lse, &entropy], 1)?)
}

/// `∂z` `[rows, V]` in `z`'s dtype, for upstream gradients `grad` `[rows, W + 1]` (work dtype:
/// the `W` gathered log-probs' at `ids` `[rows, W]` (u32), then the entropy's) and the
/// [`head_row_stats`] `stats` of the same `z`.
pub fn head_logits_grad(
    z: &Tensor,
    stats: &Tensor,
    ids: &Tensor,
    grad: &Tensor,
    temperature: f64,
) -> Result<Tensor> {
    let (rows, v) = z
        .dims2()
        .context("head_logits_grad: z must be [rows, vocab]")?;
    let (ri, w) = ids
        .dims2()
        .context("head_logits_grad: ids must be [rows, W]")?;
    check_temperature(temperature)?;
    let wt = work_dtype(z.dtype());
    if ri != rows
        || ids.dtype() != DType::U32
        || stats.dims() != [rows, 2]
        || grad.dims() != [rows, w + 1]
        || stats.dtype() != wt
        || grad.dtype() != wt
    {
        bail!(
            "head_logits_grad: z {:?} needs u32 ids [{rows}, W], {wt:?} stats [{rows}, 2] and \
             grad [{rows}, W + 1]; got ids {:?} {:?}, stats {:?} {:?}, grad {:?} {:?}",
            z.dims(),
            ids.dtype(),
            ids.dims(),
            stats.dtype(),
            stats.dims(),
            grad.dtype(),
            grad.dims()
        );
    }
    if rows > 0 && w > 0 {
        let max_id = ids.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        if max_id as usize >= v {
            bail!("head_logits_grad: token id {max_id} is outside the vocabulary ({v})");
        }
    }
    let inv_t = 1.0 / temperature;
    #[cfg(feature = "cuda")]
    if z.device().is_cuda() && kernels_apply_to(z.device(), z.dtype()) {
        return Ok(super::softmax_cuda::head_logits_grad(
            z, stats, ids, grad, inv_t,
        )?);
    }
    if !z.device().is_cpu() {
        return head_logits_grad_composed(z, stats, ids, grad, temperature);
    }
    let out_dtype = z.dtype();
    let z = cpu_kernel_input(z)?;
    let ids_v: Vec<u32> = ids.flatten_all()?.to_vec1()?;
    let dz = match z.dtype() {
        DType::F32 => {
            let (st, g) = (stats.to_dtype(DType::F32)?, grad.to_dtype(DType::F32)?);
            let dz = logits_grad_typed::<f32>(&z, &st, &ids_v, &g, w, inv_t)?;
            Tensor::from_vec(dz, (rows, v), &Device::Cpu)?
        }
        DType::F64 => {
            let dz = logits_grad_typed::<f64>(&z, stats, &ids_v, grad, w, inv_t)?;
            Tensor::from_vec(dz, (rows, v), &Device::Cpu)?
        }
        other => bail!("head_logits_grad: unsupported dtype {other:?}"),
    };
    Ok(dz.to_dtype(out_dtype)?)
}

/// [`head_logits_grad`] from candle ops (the reference, and the path off the kernels).
pub fn head_logits_grad_composed(
    z: &Tensor,
    stats: &Tensor,
    ids: &Tensor,
    grad: &Tensor,
    temperature: f64,
) -> Result<Tensor> {
    let w = ids.dim(1)?;
    let x = (z.to_dtype(work_dtype(z.dtype()))? * (1.0 / temperature))?;
    let logp = x.broadcast_sub(&stats.narrow(1, 0, 1)?)?;
    let p = logp.exp()?;
    let (g_ids, g_ent) = (grad.narrow(1, 0, w)?, grad.narrow(1, w, 1)?);
    let coef = logp
        .broadcast_add(&stats.narrow(1, 1, 1)?)?
        .broadcast_mul(&g_ent)?
        .broadcast_add(&g_ids.sum_keepdim(1)?)?;
    let mut dx = (p * coef)?.neg()?;
    if w > 0 {
        dx = dx.scatter_add(&ids.contiguous()?, &g_ids.contiguous()?, 1)?;
    }
    Ok((dx * (1.0 / temperature))?.to_dtype(z.dtype())?)
}

fn check_temperature(t: f64) -> Result<()> {
    if t.is_nan() || t <= 0.0 {
        bail!("the LM head's temperature must be > 0, got {t}");
    }
    Ok(())
}

/// The CPU kernels read f32 or f64: half-precision logits are widened (exactly).
fn cpu_kernel_input(z: &Tensor) -> Result<Tensor> {
    let z = if kernels_apply_to(&Device::Cpu, z.dtype()) {
        z.clone()
    } else {
        z.to_dtype(DType::F32)?
    };
    Ok(z.contiguous()?)
}

/// `(max, Σ e^{x−max}, Σ e^{x−max}·x)` of `x = z·inv_t` over one row, in two passes; the sums
/// in f64 (a sequential f32 sum over 151,936 terms drifts by ~1e-4). The LM head's statistics
/// and the CPU sampler ([`crate::sampling`]) both read a row's softmax through this.
pub(crate) fn row_sums<T: Real>(row: &[T], inv_t: T) -> (T, f64, f64) {
    let mut max = T::NEG_INFINITY;
    for &z in row {
        let x = z * inv_t;
        if x > max {
            max = x;
        }
    }
    let (mut sum, mut sum_x) = (0f64, 0f64);
    for &z in row {
        let x = z * inv_t;
        let e = (x - max).exp().to_f64();
        sum += e;
        sum_x += e * x.to_f64();
    }
    (max, sum, sum_x)
}

/// Interleaved `[lse, entropy]` of each `v`-wide row of `z`.
fn row_stats<T: Real>(z: &[T], v: usize, inv_t: f64) -> Vec<T> {
    let inv_t = T::from_f64(inv_t);
    let rows = z.len() / v;
    par_map(rows, |r| {
        let (max, sum, sum_x) = row_sums(&z[r * v..(r + 1) * v], inv_t);
        let lse = max + T::from_f64(sum.ln());
        [lse, lse - T::from_f64(sum_x / sum)]
    })
    .into_iter()
    .flatten()
    .collect()
}

/// The CPU kernel of [`head_logits_grad`] on `T` (f32 or f64) inputs.
fn logits_grad_typed<T: Real>(
    z: &Tensor,
    stats: &Tensor,
    ids: &[u32],
    grad: &Tensor,
    w: usize,
    inv_t: f64,
) -> Result<Vec<T>> {
    let stats: Vec<T> = stats.flatten_all()?.to_vec1()?;
    let grad: Vec<T> = grad.flatten_all()?.to_vec1()?;
    let inv_t = T::from_f64(inv_t);
    Ok(with_slice::<T, _>(z, "head_logits_grad", |zs| {
        let v = zs.len() / (stats.len() / 2).max(1);
        let mut dz = vec![T::zero(); zs.len()];
        par_rows(&mut dz, v, |r, out| {
            let (lse, entropy) = (stats[2 * r], stats[2 * r + 1]);
            let g = &grad[r * (w + 1)..(r + 1) * (w + 1)];
            let g_sum = g[..w].iter().fold(T::zero(), |a, &b| a + b);
            let g_ent = g[w];
            for (d, &zv) in out.iter_mut().zip(&zs[r * v..(r + 1) * v]) {
                let logp = zv * inv_t - lse;
                *d = -logp.exp() * (g_sum + g_ent * (logp + entropy)) * inv_t;
            }
            for (&id, &gk) in ids[r * w..(r + 1) * w].iter().zip(&g[..w]) {
                out[id as usize] += gk * inv_t;
            }
        });
        dz
    })?)
}
