//! The CPU kernels of [`super::causal_attention_varlen`], flash-attention 2 style.
//!
//! Forward, per (segment, query head) task: query tiles of [`TILE_Q`] rows walk the key tiles
//! of [`TILE_K`] keys up to the diagonal, keeping a running max `m`, normaliser `l` and
//! un-normalised output per row (online softmax); the row's `lse = m + ln l` is all that is
//! kept for the backward.
//!
//! Backward, per (segment, key/value head) task — which owns `∂K`, `∂V` of its head and `∂Q`
//! of its query heads, so tasks never write the same element: with `Dᵢ = Σ ∂Oᵢ·Oᵢ`, for each
//! key tile and each query row at or after it, `P = exp(S − lse)` is recomputed and
//! `∂V += Pᵀ∂O`, `∂S = P·(∂O·Vᵀ − D)`, `∂Q += ∂S·K·scale`, `∂K += ∂Sᵀ·Q·scale`.

use super::{dot, par_map, Real};

/// Query rows per forward tile.
const TILE_Q: usize = 64;
/// Keys per tile.
const TILE_K: usize = 64;

/// Shapes of the packed inputs: `q` `[n, hq, d]`, `k`/`v` `[n, hkv, d]`.
pub(super) struct Dims {
    pub n: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
}

/// `y += a·x`.
#[inline]
fn axpy<T: Real>(y: &mut [T], a: T, x: &[T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The non-empty segments `(start, len)` of `cu_seqlens`.
fn segments(cu: &[usize]) -> Vec<(usize, usize)> {
    cu.windows(2)
        .filter(|w| w[1] > w[0])
        .map(|w| (w[0], w[1] - w[0]))
        .collect()
}

/// `(out [n, hq, d], lse [n, hq])`.
pub(super) fn forward<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    dims: &Dims,
    cu: &[usize],
    scale: f64,
) -> (Vec<T>, Vec<f64>) {
    let Dims { n, hq, hkv, d } = *dims;
    let n_rep = hq / hkv;
    let scale_t = T::from_f64(scale);
    let segs = segments(cu);
    let q_row = |i: usize, h: usize| &q[(i * hq + h) * d..(i * hq + h + 1) * d];
    let kv_row = |j: usize, g: usize| (j * hkv + g) * d..(j * hkv + g + 1) * d;
    let results = par_map(segs.len() * hq, |task| {
        let ((s, len), h) = (segs[task / hq], task % hq);
        let g = h / n_rep;
        let mut out = vec![T::zero(); len * d];
        let mut lse = vec![0f64; len];
        let mut scores = [T::zero(); TILE_K];
        for i0 in (0..len).step_by(TILE_Q) {
            let i1 = (i0 + TILE_Q).min(len);
            let mut m = vec![T::NEG_INFINITY; i1 - i0];
            let mut l = vec![T::zero(); i1 - i0];
            let acc = &mut out[i0 * d..i1 * d];
            for j0 in (0..i1).step_by(TILE_K) {
                let j1 = (j0 + TILE_K).min(i1);
                for i in i0.max(j0)..i1 {
                    let qi = i - i0;
                    let jmax = j1.min(i + 1);
                    let qr = q_row(s + i, h);
                    let mut tile_max = T::NEG_INFINITY;
                    for j in j0..jmax {
                        let sc = dot(qr, &k[kv_row(s + j, g)]) * scale_t;
                        scores[j - j0] = sc;
                        if sc > tile_max {
                            tile_max = sc;
                        }
                    }
                    let m_new = if tile_max > m[qi] { tile_max } else { m[qi] };
                    let corr = (m[qi] - m_new).exp();
                    let row = &mut acc[qi * d..(qi + 1) * d];
                    if corr != T::one() {
                        l[qi] *= corr;
                        row.iter_mut().for_each(|a| *a *= corr);
                    }
                    for j in j0..jmax {
                        let p = (scores[j - j0] - m_new).exp();
                        l[qi] += p;
                        axpy(row, p, &v[kv_row(s + j, g)]);
                    }
                    m[qi] = m_new;
                }
            }
            for qi in 0..i1 - i0 {
                let inv = T::one() / l[qi];
                acc[qi * d..(qi + 1) * d].iter_mut().for_each(|a| *a *= inv);
                lse[i0 + qi] = (m[qi] + l[qi].ln()).to_f64();
            }
        }
        (out, lse)
    });
    let mut out = vec![T::zero(); n * hq * d];
    let mut lse = vec![0f64; n * hq];
    for (task, (o, l)) in results.into_iter().enumerate() {
        let ((s, len), h) = (segs[task / hq], task % hq);
        for i in 0..len {
            let at = (s + i) * hq + h;
            out[at * d..(at + 1) * d].copy_from_slice(&o[i * d..(i + 1) * d]);
            lse[at] = l[i];
        }
    }
    (out, lse)
}

/// What the backward reads: the forward's inputs, output, log-sum-exp and the output's
/// gradient, all packed as in the forward.
pub(super) struct BackwardInputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub out: &'a [T],
    pub dout: &'a [T],
    pub lse: &'a [f64],
}

/// `(∂q, ∂k, ∂v)` in the inputs' layouts.
pub(super) fn backward<T: Real>(
    io: &BackwardInputs<'_, T>,
    dims: &Dims,
    cu: &[usize],
    scale: f64,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let Dims { n, hq, hkv, d } = *dims;
    let n_rep = hq / hkv;
    let scale_t = T::from_f64(scale);
    let segs = segments(cu);
    let qh = |i: usize, h: usize| (i * hq + h) * d..(i * hq + h + 1) * d;
    let kvh = |j: usize, g: usize| (j * hkv + g) * d..(j * hkv + g + 1) * d;
    let results = par_map(segs.len() * hkv, |task| {
        let ((s, len), g) = (segs[task / hkv], task % hkv);
        // dq: [n_rep, len, d]; dk, dv: [len, d].
        let mut dq = vec![T::zero(); n_rep * len * d];
        let mut dk = vec![T::zero(); len * d];
        let mut dv = vec![T::zero(); len * d];
        let mut delta = vec![T::zero(); len];
        let mut lse = vec![T::zero(); len];
        for r in 0..n_rep {
            let h = g * n_rep + r;
            for i in 0..len {
                delta[i] = dot(&io.dout[qh(s + i, h)], &io.out[qh(s + i, h)]);
                lse[i] = T::from_f64(io.lse[(s + i) * hq + h]);
            }
            let dq_r = &mut dq[r * len * d..(r + 1) * len * d];
            for j0 in (0..len).step_by(TILE_K) {
                let j1 = (j0 + TILE_K).min(len);
                for i in j0..len {
                    let (qr, dor) = (&io.q[qh(s + i, h)], &io.dout[qh(s + i, h)]);
                    let dq_i = &mut dq_r[i * d..(i + 1) * d];
                    for j in j0..j1.min(i + 1) {
                        let (kr, vr) = (&io.k[kvh(s + j, g)], &io.v[kvh(s + j, g)]);
                        let p = (dot(qr, kr) * scale_t - lse[i]).exp();
                        axpy(&mut dv[j * d..(j + 1) * d], p, dor);
                        let ds = p * (dot(dor, vr) - delta[i]) * scale_t;
                        axpy(dq_i, ds, kr);
                        axpy(&mut dk[j * d..(j + 1) * d], ds, qr);
                    }
                }
            }
        }
        (dq, dk, dv)
    });
    let mut dq = vec![T::zero(); n * hq * d];
    let mut dk = vec![T::zero(); n * hkv * d];
    let mut dv = vec![T::zero(); n * hkv * d];
    for (task, (tq, tk, tv)) in results.into_iter().enumerate() {
        let ((s, len), g) = (segs[task / hkv], task % hkv);
        for i in 0..len {
            for r in 0..n_rep {
                let src = (r * len + i) * d;
                dq[qh(s + i, g * n_rep + r)].copy_from_slice(&tq[src..src + d]);
            }
            dk[kvh(s + i, g)].copy_from_slice(&tk[i * d..(i + 1) * d]);
            dv[kvh(s + i, g)].copy_from_slice(&tv[i * d..(i + 1) * d]);
        }
    }
    (dq, dk, dv)
}
