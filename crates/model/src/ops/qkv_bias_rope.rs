//! The decode step's attention inputs in one pass: the q/k/v projections' biases added
//! (rounded to the dtype, as the unfused add) and q, k rotated by RoPE — one launch where the
//! unfused step takes five (three bias adds, two rotations). Inference only: the op has no
//! backward (candle reports an error rather than dropping a gradient).

use super::{kernels_apply, layout_slice, par_rows, with_slice, Real};
use anyhow::{bail, Result};
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

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

/// `q`, `k`, `v` of `rows` tokens (bias-free projections `[rows, heads·head_dim]`) with
/// `biases` (`[heads·head_dim]` each) added and q, k rotated by `cos`/`sin` `[rows, head_dim/2]`:
/// returns `q` `[rows, num_heads, head_dim]` and `k`, `v` `[rows, num_kv_heads, head_dim]`.
/// The fused kernel (CPU f32/f64, CUDA f32/bf16) where it applies; else the bias adds and
/// [`super::rope`].
pub fn qkv_bias_rope(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    biases: Option<[&Tensor; 3]>,
    cos: &Tensor,
    sin: &Tensor,
    heads: QkvHeads,
) -> Result<(Tensor, Tensor, Tensor)> {
    let QkvHeads {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: d,
    } = heads;
    if d % 2 != 0 {
        bail!("qkv_bias_rope: head_dim {d} is odd");
    }
    let rows = q.dim(0)?;
    for (i, (name, t, h)) in [("q", q, nh), ("k", k, nkv), ("v", v, nkv)]
        .into_iter()
        .enumerate()
    {
        if t.dims() != [rows, h * d] {
            bail!(
                "qkv_bias_rope: {name} has shape {:?}, expected [{rows}, {}]",
                t.dims(),
                h * d
            );
        }
        if let Some(b) = biases {
            if b[i].dims() != [h * d] {
                bail!(
                    "qkv_bias_rope: the {name} bias has shape {:?}, expected [{}]",
                    b[i].dims(),
                    h * d
                );
            }
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
    let mut all = vec![q, k, v, cos, sin];
    all.extend(biases.iter().flatten());
    let same = all
        .iter()
        .all(|t| t.dtype() == q.dtype() && t.device().same_device(q.device()));
    if !(kernels_apply(q) && same) {
        let add = |t: &Tensor, i: usize| -> Result<Tensor> {
            Ok(match biases {
                Some(b) => t.broadcast_add(b[i])?,
                None => t.clone(),
            })
        };
        let q = super::rope(&add(q, 0)?.reshape((rows, nh, d))?, cos, sin)?;
        let k = super::rope(&add(k, 1)?.reshape((rows, nkv, d))?, cos, sin)?;
        let v = add(v, 2)?.reshape((rows, nkv, d))?;
        return Ok((q, k, v));
    }
    let op = QkvBiasRopeOp {
        biases: match biases {
            Some(b) => Some([b[0].contiguous()?, b[1].contiguous()?, b[2].contiguous()?]),
            None => None,
        },
        cos: cos.contiguous()?,
        sin: sin.contiguous()?,
        heads,
    };
    let out = q
        .contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)?;
    // Three contiguous blocks of one buffer: q, then k, then v.
    let (nq, nk) = (rows * nh * d, rows * nkv * d);
    Ok((
        out.narrow(0, 0, nq)?.reshape((rows, nh, d))?,
        out.narrow(0, nq, nk)?.reshape((rows, nkv, d))?,
        out.narrow(0, nq + nk, nk)?.reshape((rows, nkv, d))?,
    ))
}

struct QkvBiasRopeOp {
    /// q, k, v biases, contiguous.
    biases: Option<[Tensor; 3]>,
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

/// The CPU twin of the CUDA kernel: `[q | k | v]` in one buffer.
#[allow(clippy::too_many_arguments)]
fn forward<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    biases: Option<[&[T]; 3]>,
    cos: &[T],
    sin: &[T],
    heads: QkvHeads,
) -> Vec<T> {
    let d = heads.head_dim;
    let half = d / 2;
    let (qw, kw) = (heads.num_heads * d, heads.num_kv_heads * d);
    let rows = q.len() / qw.max(1);
    let mut out = vec![T::zero(); rows * (qw + 2 * kw)];
    let (oq, okv) = out.split_at_mut(rows * qw);
    let (ok, ov) = okv.split_at_mut(rows * kw);
    let bias = |i: usize| biases.map(|b| b[i]);
    par_rows(oq, qw, |n, o| {
        let rot = (
            &cos[n * half..(n + 1) * half],
            &sin[n * half..(n + 1) * half],
        );
        bias_rotate(&q[n * qw..(n + 1) * qw], bias(0), Some(rot), d, o);
    });
    par_rows(ok, kw, |n, o| {
        let rot = (
            &cos[n * half..(n + 1) * half],
            &sin[n * half..(n + 1) * half],
        );
        bias_rotate(&k[n * kw..(n + 1) * kw], bias(1), Some(rot), d, o);
    });
    par_rows(ov, kw, |n, o| {
        bias_rotate(&v[n * kw..(n + 1) * kw], bias(2), None, d, o);
    });
    out
}

impl QkvBiasRopeOp {
    fn fwd_typed<T: Real>(
        &self,
        q: (&CpuStorage, &Layout),
        k: (&CpuStorage, &Layout),
        v: (&CpuStorage, &Layout),
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let what = "qkv_bias_rope";
        let (qs, ks, vs) = (
            layout_slice::<T>(q.0, q.1, what)?,
            layout_slice::<T>(k.0, k.1, what)?,
            layout_slice::<T>(v.0, v.1, what)?,
        );
        let n = qs.len() + ks.len() + vs.len();
        let out = with_slice::<T, _>(&self.cos, what, |c| {
            with_slice::<T, _>(&self.sin, what, |s| match &self.biases {
                None => Ok(forward(qs, ks, vs, None, c, s, self.heads)),
                Some([bq, bk, bv]) => with_slice::<T, _>(bq, what, |bq| {
                    with_slice::<T, _>(bk, what, |bk| {
                        with_slice::<T, _>(bv, what, |bv| {
                            forward(qs, ks, vs, Some([bq, bk, bv]), c, s, self.heads)
                        })
                    })
                })??,
            })
        })???;
        Ok((T::to_cpu_storage_owned(out), Shape::from(n)))
    }
}

impl CustomOp3 for QkvBiasRopeOp {
    fn name(&self) -> &'static str {
        "qkv-bias-rope"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match q {
            CpuStorage::F32(_) => self.fwd_typed::<f32>((q, lq), (k, lk), (v, lv)),
            CpuStorage::F64(_) => self.fwd_typed::<f64>((q, lq), (k, lk), (v, lv)),
            _ => candle_core::bail!("qkv_bias_rope kernel: f32 or f64 on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let n = lq.shape().elem_count() + lk.shape().elem_count() + lv.shape().elem_count();
        let out = super::cuda::qkv_bias_rope(
            [(q, lq), (k, lk), (v, lv)],
            self.biases.as_ref(),
            (&self.cos, &self.sin),
            self.heads,
        )?;
        Ok((out, Shape::from(n)))
    }
}
