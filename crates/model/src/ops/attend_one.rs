//! Deterministic mode's attention: the new queries of each row over the row's own dense KV
//! cache, causally, each (query, head) computed alone in one order fixed by its head_dim and
//! key count — a query's bits do not depend on the other rows of the step, nor on how many of
//! its row's queries come with it (a prompt fed whole gives each position the bits it gets
//! decoded one token a step). The ordinary cached attention (batched `q·Kᵀ` and `p·V`
//! products) does not promise that on CUDA, where cuBLAS picks its kernels by the whole
//! batched shape. On CUDA the `attend_one` kernel (`rows_invariant_kernels.cuh`: keys dealt to
//! eight warps, online softmax, warps merged in order); on the CPU an exact two-pass softmax per
//! (query, head) — its twin in what it computes and guarantees (not in its bits: the two sum in
//! different orders, so the guarantee holds on each device), tested in CI by deterministic
//! mode's bitwise tests. Inference only (no backward).

use anyhow::{bail, Result};
use candle_core::{DType, Storage, Tensor};
use half::{bf16, f16};

/// Attention work (rows × heads × keys × head_dim) past which the CPU version spreads over
/// candle's threads.
const PARALLEL_WORK: usize = 1 << 18;

/// `softmax(q·Kᵀ / √d)·V` for `q` `[rows, t, hq, d]`, the last `t` positions of each row, over
/// `k`/`v` `[rows, hkv, keys, d]` (the dense KV cache's buffers narrowed to `keys ≥ t`): query
/// `i` of a row attends to the row's first `keys − t + i + 1` keys (GQA: head `h` reads KV head
/// `h / (hq / hkv)`). `[rows, t, hq, d]` in q's dtype; a query's result depends on its own q,
/// keys and values alone.
pub fn attend_one_rows_invariant(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    const OP: &str = "attend_one_rows_invariant";
    let (rows, t, hq, d) = q.dims4().map_err(|_| {
        anyhow::anyhow!(
            "{OP}: q must be [rows, queries, heads, head_dim], got {:?}",
            q.dims()
        )
    })?;
    let kd = k.dims4().map_err(|_| {
        anyhow::anyhow!(
            "{OP}: keys must be [rows, kv_heads, keys, head_dim], got {:?}",
            k.dims()
        )
    })?;
    let (_, hkv, len, _) = kd;
    if v.dims() != k.dims() || kd.0 != rows || kd.3 != d || hkv == 0 || !hq.is_multiple_of(hkv) {
        bail!(
            "{OP}: q {:?}, keys {:?} and values {:?} do not fit",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if !k.device().same_device(q.device()) || !v.device().same_device(q.device()) {
        bail!(
            "{OP}: q on {:?}, keys on {:?}, values on {:?}: one device",
            q.device(),
            k.device(),
            v.device()
        );
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!(
            "{OP}: q {:?}, keys {:?}, values {:?}: one dtype",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    if rows == 0 || t == 0 || hq == 0 || d == 0 {
        return Ok(Tensor::zeros((rows, t, hq, d), q.dtype(), q.device())?);
    }
    if len < t {
        bail!("{OP}: {t} queries a row but {len} keys (the queries' own keys are in the cache)");
    }
    let scale = 1.0 / (d as f64).sqrt();
    // Both versions read keys and values in place through one set of strides, rows of
    // head_dim contiguous (the dense cache's narrowed buffers are); anything else is copied.
    let (k, v) = if k.layout().stride()[3] == 1 && k.layout().stride() == v.layout().stride() {
        (k.clone(), v.clone())
    } else {
        (k.contiguous()?, v.contiguous()?)
    };
    let (k, v) = (&k, &v);
    if q.device().is_cuda() {
        return cuda(q, k, v, scale);
    }
    if !q.device().is_cpu() {
        bail!("{OP}: {:?} has no kernel (CPU and CUDA only)", q.device());
    }
    let shape = Shapes {
        t,
        hq,
        hkv,
        len,
        d,
        scale,
    };
    let out = match q.dtype() {
        DType::F32 => cpu::<f32, f32>(q, k, v, &shape, |x| x, |x| x)?,
        DType::F64 => cpu::<f64, f64>(q, k, v, &shape, |x| x, |x| x)?,
        DType::BF16 => cpu::<bf16, f32>(q, k, v, &shape, bf16::to_f32, bf16::from_f32)?,
        DType::F16 => cpu::<f16, f32>(q, k, v, &shape, f16::to_f32, f16::from_f32)?,
        other => bail!("{OP}: dtype {other:?} is not a float"),
    };
    Ok(out.reshape((rows, t, hq, d))?)
}

#[cfg(feature = "cuda")]
fn cuda(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let d = q.dim(3)?;
    if d > super::rows_invariant_cuda::ATTEND_MAX_HEAD_DIM {
        bail!("attend_one_rows_invariant: head_dim {d} is past the CUDA kernel's 256");
    }
    Ok(super::rows_invariant_cuda::attend_one(q, k, v, scale)?)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &Tensor, _: &Tensor, _: &Tensor, _: f64) -> Result<Tensor> {
    bail!("attend_one_rows_invariant: a CUDA tensor in a build without the cuda feature")
}

/// What the CPU version needs of the shapes.
struct Shapes {
    /// Queries a row (its last positions).
    t: usize,
    hq: usize,
    hkv: usize,
    len: usize,
    d: usize,
    scale: f64,
}

/// The CPU version for storage type `T` summed in `A`: per (row, KV head) — its queries and
/// query heads together, each key widened once — a query's scores by [`super::dot`] over its
/// keys, their max, `p = exp(s − max)`, then `Σ p·v / Σ p` in key order. The cache is read in
/// place through its strides (k and v share them, rows contiguous: the caller's).
fn cpu<T, A>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &Shapes,
    widen: impl Fn(T) -> A + Sync + Copy,
    narrow: impl Fn(A) -> T + Sync,
) -> Result<Tensor>
where
    T: candle_core::WithDType + Copy + Send + Sync,
    A: super::Real + Send + Sync,
{
    const OP: &str = "attend_one_rows_invariant";
    let qs: Vec<A> = super::with_slice::<T, _>(q, OP, |x| x.iter().map(|&e| widen(e)).collect())?;
    let (kg, kl) = k.storage_and_layout();
    let (vg, vl) = v.storage_and_layout();
    let (Storage::Cpu(ks), Storage::Cpu(vs)) = (&*kg, &*vg) else {
        bail!("{OP}: the CPU version got a non-CPU tensor");
    };
    let (ks, vs) = (ks.as_slice::<T>()?, vs.as_slice::<T>()?);
    let (k0, v0, st) = (kl.start_offset(), vl.start_offset(), kl.stride());
    let (d, len, n_rep, t) = (s.d, s.len, s.hq / s.hkv, s.t);
    let past = len - t;
    let scale = A::from_f64(s.scale);
    // One (row, KV head): out[i][h] for its t queries and n_rep query heads, in q's order.
    let group = |task: usize| -> Vec<(usize, Vec<T>)> {
        let (row, kvh) = (task / s.hkv, task % s.hkv);
        let at = row * st[0] + kvh * st[1];
        let mut keys = vec![A::zero(); len * d];
        for j in 0..len {
            let from = k0 + at + j * st[2];
            for (x, &e) in keys[j * d..(j + 1) * d].iter_mut().zip(&ks[from..from + d]) {
                *x = widen(e);
            }
        }
        let mut outs = Vec::with_capacity(t * n_rep);
        let mut scores = Vec::with_capacity(len);
        for i in 0..t {
            let seen = past + i + 1;
            for h in 0..n_rep {
                let head = kvh * n_rep + h;
                let qi = (row * t + i) * s.hq + head;
                let qr = &qs[qi * d..(qi + 1) * d];
                scores.clear();
                scores.extend((0..seen).map(|j| super::dot(qr, &keys[j * d..(j + 1) * d]) * scale));
                let top = scores
                    .iter()
                    .copied()
                    .fold(A::NEG_INFINITY, |m, x| if x > m { x } else { m });
                let mut acc = vec![A::zero(); d];
                let mut sum = A::zero();
                for (j, &sj) in scores.iter().enumerate() {
                    let p = (sj - top).exp();
                    sum += p;
                    let from = v0 + at + j * st[2];
                    for (a, &x) in acc.iter_mut().zip(&vs[from..from + d]) {
                        *a += p * widen(x);
                    }
                }
                outs.push((qi, acc.into_iter().map(|a| narrow(a / sum)).collect()));
            }
        }
        outs
    };
    let tasks = qs.len() / (t * s.hq * d) * s.hkv;
    let parts: Vec<Vec<(usize, Vec<T>)>> = if qs.len() * len >= PARALLEL_WORK {
        super::par_map(tasks, group)
    } else {
        (0..tasks).map(group).collect()
    };
    let mut out = vec![T::zero(); qs.len()];
    for (qi, o) in parts.into_iter().flatten() {
        out[qi * d..(qi + 1) * d].copy_from_slice(&o);
    }
    Ok(Tensor::from_vec(out, qs.len(), q.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The attention of each query (f64 reference: the composed softmax over its keys), its
    /// bits the same in any batch of rows and whether its row's other queries come with it;
    /// keys read through a narrowed cache buffer; bad shapes named.
    #[test]
    fn attends_each_query_alone() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, t, hq, hkv, d, cap, len) = (5, 4, 6, 2, 24, 40, 33);
        let past = len - t;
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let q = Tensor::randn(0f32, 1.0, (rows, t, hq, d), &dev)?.to_dtype(dtype)?;
            let kb = Tensor::randn(0f32, 1.0, (rows, hkv, cap, d), &dev)?.to_dtype(dtype)?;
            let vb = Tensor::randn(0f32, 1.0, (rows, hkv, cap, d), &dev)?.to_dtype(dtype)?;
            let keys = |n: usize| -> Result<(Tensor, Tensor)> {
                Ok((kb.narrow(2, 0, n)?, vb.narrow(2, 0, n)?))
            };
            let (k, v) = keys(len)?;
            let got = attend_one_rows_invariant(&q, &k, &v)?;
            let f = |t: &Tensor| t.to_dtype(DType::F64);
            let bits =
                |t: &Tensor| -> Result<Vec<f64>> { Ok(f(t)?.flatten_all()?.to_vec1::<f64>()?) };
            let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-5 };
            for i in 0..t {
                let (ki, vi) = keys(past + i + 1)?;
                let qi = q.narrow(1, i, 1)?;
                let qg = f(&qi)?.reshape((rows, hkv, hq / hkv, d))?;
                let s = (qg.matmul(&f(&ki)?.t()?)? / (d as f64).sqrt())?;
                let p = candle_nn::ops::softmax_last_dim(&s)?;
                let want = p.matmul(&f(&vi)?)?.reshape((rows, 1, hq, d))?;
                let gi = got.narrow(1, i, 1)?;
                let err = (f(&gi)? - want)?.abs()?.max_all()?.to_scalar::<f64>()?;
                assert!(err <= tol, "{dtype:?} query {i}: {err}");
                // Decoded alone, one query over its keys: the same bits.
                let alone = attend_one_rows_invariant(&qi, &ki, &vi)?;
                assert_eq!(bits(&alone)?, bits(&gi)?, "{dtype:?} query {i}");
            }
            let all = bits(&got)?;
            let per_row = t * hq * d;
            for r in [0, 3, 4] {
                let one = |t: &Tensor| t.narrow(0, r, 1);
                let alone = attend_one_rows_invariant(&one(&q)?, &one(&k)?, &one(&v)?)?;
                assert_eq!(
                    bits(&alone)?,
                    all[r * per_row..(r + 1) * per_row],
                    "{dtype:?} row {r}"
                );
            }
        }
        let q = Tensor::zeros((2, 1, 3, 8), DType::F32, &dev)?;
        let k = Tensor::zeros((2, 2, 4, 8), DType::F32, &dev)?;
        let e = attend_one_rows_invariant(&q, &k, &k)
            .unwrap_err()
            .to_string();
        assert!(e.contains("do not fit"), "{e}");
        let q = Tensor::zeros((2, 1, 4, 8), DType::F32, &dev)?;
        let e = attend_one_rows_invariant(&q, &k.to_dtype(DType::BF16)?, &k)
            .unwrap_err()
            .to_string();
        assert!(e.contains("one dtype"), "{e}");
        let e = attend_one_rows_invariant(&q, &k.narrow(2, 0, 0)?, &k.narrow(2, 0, 0)?)
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 queries a row but 0 keys"), "{e}");
        Ok(())
    }
}
