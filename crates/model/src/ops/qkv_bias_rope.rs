//! The decode step's attention inputs in one pass: from the packed q/k/v projection (one
//! product with the stacked weights), the biases added (rounded to the dtype, as the unfused
//! add) and q, k rotated by RoPE — one launch where the unfused step takes five (three bias
//! adds, two rotations). Inference only: the op has no
//! backward (candle reports an error rather than dropping a gradient).

use super::{kernels_apply, layout_slice, par_rows, with_slice, Real};
use anyhow::{bail, Result};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// The attention's shape: query heads, key/value heads, head size.
#[derive(Debug, Clone, Copy)]
pub struct QkvHeads {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Elements per head (even).
    pub head_dim: usize,
}

impl QkvHeads {
    /// Width of the packed projection `[q | k | v]` of one token: `(heads + 2·kv_heads)·head_dim`.
    pub fn packed_width(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
}

/// `q`, `k`, `v` of `rows` tokens from their packed bias-free projection `qkv`
/// `[rows, (heads + 2·kv_heads)·head_dim]` (q's columns, then k's, then v's: one product with
/// the stacked weights) with `bias` (`[(heads + 2·kv_heads)·head_dim]`, stacked the same way)
/// added and q, k rotated by `cos`/`sin` `[rows, head_dim/2]`: returns `q`
/// `[rows, num_heads, head_dim]` and `kv` `[2, rows, num_kv_heads, head_dim]` (k, then v: what
/// [`super::write_kv_slots`] writes into the cache). The fused kernel (CPU f32/f64, CUDA
/// f32/bf16) where it applies; else the bias add and [`super::rope`].
pub fn qkv_bias_rope(
    qkv: &Tensor,
    bias: Option<&Tensor>,
    cos: &Tensor,
    sin: &Tensor,
    heads: QkvHeads,
) -> Result<(Tensor, Tensor)> {
    let QkvHeads {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: d,
    } = heads;
    if d % 2 != 0 {
        bail!("qkv_bias_rope: head_dim {d} is odd");
    }
    let width = heads.packed_width();
    let rows = qkv.dim(0)?;
    if qkv.dims() != [rows, width] {
        bail!(
            "qkv_bias_rope: qkv has shape {:?}, expected [{rows}, {width}] ({nh} + 2·{nkv} heads of {d})",
            qkv.dims()
        );
    }
    if let Some(b) = bias {
        if b.dims() != [width] {
            bail!(
                "qkv_bias_rope: the bias has shape {:?}, expected [{width}]",
                b.dims()
            );
        }
    }
    for (name, t) in [("cos", cos), ("sin", sin)] {
        if t.dims() != [rows, d / 2] {
            bail!(
                "qkv_bias_rope: {name} has shape {:?}, expected [{rows}, {}]",
                t.dims(),
                d / 2
            );
        }
    }
    let mut all = vec![qkv, cos, sin];
    all.extend(bias);
    let same = all
        .iter()
        .all(|t| t.dtype() == qkv.dtype() && t.device().same_device(qkv.device()));
    if !(kernels_apply(qkv) && same) {
        let biased = match bias {
            Some(b) => qkv.broadcast_add(b)?,
            None => qkv.clone(),
        };
        let part = |from: usize, h: usize| -> Result<Tensor> {
            Ok(biased
                .narrow(1, from * d, h * d)?
                .contiguous()?
                .reshape((rows, h, d))?)
        };
        let q = super::rope(&part(0, nh)?, cos, sin)?;
        let k = super::rope(&part(nh, nkv)?, cos, sin)?;
        return Ok((q, Tensor::stack(&[&k, &part(nh + nkv, nkv)?], 0)?));
    }
    let op = QkvBiasRopeOp {
        bias: bias.map(Tensor::contiguous).transpose()?,
        cos: cos.contiguous()?,
        sin: sin.contiguous()?,
        heads,
    };
    let out = qkv.contiguous()?.apply_op1(op)?;
    // Three contiguous blocks of one buffer: q, then k, then v.
    let (nq, nk) = (rows * nh * d, rows * nkv * d);
    Ok((
        out.narrow(0, 0, nq)?.reshape((rows, nh, d))?,
        out.narrow(0, nq, 2 * nk)?.reshape((2, rows, nkv, d))?,
    ))
}

struct QkvBiasRopeOp {
    /// The stacked q, k, v biases, contiguous.
    bias: Option<Tensor>,
    /// `[rows, head_dim/2]`, contiguous.
    cos: Tensor,
    sin: Tensor,
    heads: QkvHeads,
}

/// Adds `bias` to each of the `heads` vectors of a token and (when `rot` holds its cos and
/// sin) rotates each, from `x` into `out` (one token).
fn bias_rotate<T: Real>(
    x: &[T],
    bias: Option<&[T]>,
    rot: Option<(&[T], &[T])>,
    d: usize,
    out: &mut [T],
) {
    let half = d / 2;
    for (h, (o, xh)) in out.chunks_mut(d).zip(x.chunks(d)).enumerate() {
        let biased = |i: usize| match bias {
            Some(b) => xh[i] + b[h * d + i],
            None => xh[i],
        };
        let (o1, o2) = o.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (biased(i), biased(i + half));
            match rot {
                Some((c, s)) => {
                    o1[i] = x1 * c[i] - x2 * s[i];
                    o2[i] = x2 * c[i] + x1 * s[i];
                }
                None => {
                    o1[i] = x1;
                    o2[i] = x2;
                }
            }
        }
    }
}

/// The CPU twin of the CUDA kernel: `[q | k | v]` in one buffer from the packed rows `qkv`.
fn forward<T: Real>(
    qkv: &[T],
    bias: Option<&[T]>,
    cos: &[T],
    sin: &[T],
    heads: QkvHeads,
) -> Vec<T> {
    let d = heads.head_dim;
    let half = d / 2;
    let width = heads.packed_width();
    let (qw, kw) = (heads.num_heads * d, heads.num_kv_heads * d);
    let rows = qkv.len() / width.max(1);
    let mut out = vec![T::zero(); rows * (qw + 2 * kw)];
    let (oq, okv) = out.split_at_mut(rows * qw);
    let (ok, ov) = okv.split_at_mut(rows * kw);
    // Part `from..from + w` of each packed row (and of the bias) into `o`'s rows of `w`.
    let part = |o: &mut [T], from: usize, w: usize, rotate: bool| {
        par_rows(o, w, |n, o| {
            let rot = rotate.then(|| {
                (
                    &cos[n * half..(n + 1) * half],
                    &sin[n * half..(n + 1) * half],
                )
            });
            let x = &qkv[n * width + from..n * width + from + w];
            bias_rotate(x, bias.map(|b| &b[from..from + w]), rot, d, o);
        })
    };
    part(oq, 0, qw, true);
    part(ok, qw, kw, true);
    part(ov, qw + kw, kw, false);
    out
}

impl QkvBiasRopeOp {
    fn fwd_typed<T: Real>(
        &self,
        qkv: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let what = "qkv_bias_rope";
        let qkv = layout_slice::<T>(qkv, layout, what)?;
        let out = with_slice::<T, _>(&self.cos, what, |c| {
            with_slice::<T, _>(&self.sin, what, |s| match &self.bias {
                None => Ok(forward(qkv, None, c, s, self.heads)),
                Some(b) => with_slice::<T, _>(b, what, |b| forward(qkv, Some(b), c, s, self.heads)),
            })
        })???;
        let n = out.len();
        Ok((T::to_cpu_storage_owned(out), Shape::from(n)))
    }
}

impl CustomOp1 for QkvBiasRopeOp {
    fn name(&self) -> &'static str {
        "qkv-bias-rope"
    }

    fn cpu_fwd(
        &self,
        qkv: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match qkv {
            CpuStorage::F32(_) => self.fwd_typed::<f32>(qkv, layout),
            CpuStorage::F64(_) => self.fwd_typed::<f64>(qkv, layout),
            _ => candle_core::bail!("qkv_bias_rope kernel: f32 or f64 on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qkv: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let n = layout.shape().elem_count();
        let out = super::cuda::qkv_bias_rope(
            (qkv, layout),
            self.bias.as_ref(),
            (&self.cos, &self.sin),
            self.heads,
        )?;
        Ok((out, Shape::from(n)))
    }
}
