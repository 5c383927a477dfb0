//! `x · wᵀ` with every row computed alone, in one fixed order: a row's bits do not depend on
//! the other rows, its position among them or their number. Deterministic mode
//! ([`crate::deterministic`]) batches its samples through these products.
//!
//! candle's CPU product (the `gemm` crate) is not batch-invariant: one row takes a
//! matrix-vector path that rounds differently from the same row among several, and for some
//! small shapes (in 16, out 24) its blocking changes with the number of rows. Here each output
//! is [`super::dot`] of the row and the weight row — eight lanes over `in`, summed in a fixed
//! order — in f32 for f32/bf16/f16 (the half-precision result rounded once) and f64 for f64.
//! The weight is read once a call (outputs by weight row, all rows of x each time). On CUDA the
//! `rows_linear` kernel (`rows_invariant_kernels.cuh`, f32 and bf16: a warp per weight row, its
//! lanes over every 32nd 16-byte piece of the inputs, each piece's columns in order by `fmaf`,
//! f32 sums — the same order whether the pieces load 16 bytes at a time or element-wise)
//! gives the same guarantee there — the CPU body is its twin in what it guarantees, not in
//! bits. Inference only (no backward).

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use half::{bf16, f16};

/// Multiply-adds past which a product spreads over candle's CPU threads (below, a thread's
/// start costs more than its share).
const PARALLEL_MACS: usize = 1 << 18;

/// `x` `[.., in]` times `wᵀ` for `w` `[out, in]`, giving `[.., out]` in x's dtype; row `r` of
/// the result depends on row `r` of x and on w alone (see the module's doc).
pub fn linear_rows_invariant(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (out, in_f) = super::linear::check_product(x, w, "linear_rows_invariant")?;
    if !x.device().same_device(w.device()) {
        bail!("linear_rows_invariant: x and w on different devices");
    }
    let rows = x.elem_count() / in_f.max(1);
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("x has a last dimension") = out;
    let x2 = x.reshape((rows, in_f))?.contiguous()?;
    let w = w.contiguous()?;
    if x.device().is_cuda() {
        return Ok(cuda(&x2, &w, rows, out, in_f)?.reshape(dims)?);
    }
    if !x.device().is_cpu() {
        bail!(
            "linear_rows_invariant: {:?} has no kernel (CPU and CUDA only)",
            x.device()
        );
    }
    let y = match x.dtype() {
        DType::F32 => by_weight_row::<f32, f32>(&x2, &w, rows, out, in_f, |v| v, |v| v)?,
        DType::F64 => by_weight_row::<f64, f64>(&x2, &w, rows, out, in_f, |v| v, |v| v)?,
        DType::BF16 => {
            by_weight_row::<bf16, f32>(&x2, &w, rows, out, in_f, bf16::to_f32, bf16::from_f32)?
        }
        DType::F16 => {
            by_weight_row::<f16, f32>(&x2, &w, rows, out, in_f, f16::to_f32, f16::from_f32)?
        }
        other => bail!("linear_rows_invariant: dtype {other:?} is not a float"),
    };
    Ok(y.reshape(dims)?)
}

/// The CUDA kernel `rows_linear` (`rows_invariant_kernels.cuh`, f32 and bf16): a warp per
/// weight row, each lane over every 32nd 16-byte piece of the inputs, butterfly-summed.
#[cfg(feature = "cuda")]
fn cuda(x: &Tensor, w: &Tensor, rows: usize, out: usize, k: usize) -> Result<Tensor> {
    Ok(super::rows_invariant_cuda::rows_linear(x, w, rows, out, k)?)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &Tensor, _: &Tensor, _: usize, _: usize, _: usize) -> Result<Tensor> {
    bail!("linear_rows_invariant: a CUDA tensor in a build without the cuda feature")
}

/// The product for storage type `T` accumulated in `A`: `widen` into `A`, `narrow` back.
fn by_weight_row<T, A>(
    x: &Tensor,
    w: &Tensor,
    rows: usize,
    out: usize,
    k: usize,
    widen: impl Fn(T) -> A + Sync,
    narrow: impl Fn(A) -> T + Sync,
) -> Result<Tensor>
where
    T: candle_core::WithDType + Copy + Send + Sync,
    A: super::Real + Send + Sync,
{
    let xs: Vec<A> = super::with_slice::<T, _>(x, "linear_rows_invariant", |s| {
        s.iter().map(|&v| widen(v)).collect()
    })?;
    // Outputs weight row by weight row, in blocks of weight rows spread over candle's CPU
    // threads once the product is worth a thread (each output's arithmetic is the same on
    // any thread); each block `[rows of w, rows of x]`, then transposed into place.
    let parallel = rows * out * k >= PARALLEL_MACS;
    let block = if parallel {
        out.div_ceil(4 * candle_core::utils::get_num_threads().max(1))
    } else {
        out
    }
    .max(1);
    let blocks = super::with_slice::<T, _>(w, "linear_rows_invariant", |ws| {
        let one_block = |b: usize| {
            let (lo, hi) = (b * block, ((b + 1) * block).min(out));
            let mut ys = Vec::with_capacity((hi - lo) * rows);
            let mut wj = Vec::with_capacity(k);
            for j in lo..hi {
                wj.clear();
                wj.extend(ws[j * k..(j + 1) * k].iter().map(|&v| widen(v)));
                ys.extend((0..rows).map(|r| narrow(super::dot(&xs[r * k..(r + 1) * k], &wj))));
            }
            ys
        };
        if parallel {
            super::par_map(out.div_ceil(block), one_block)
        } else {
            (0..out.div_ceil(block)).map(one_block).collect()
        }
    })?;
    let mut y = vec![T::zero(); rows * out];
    for (b, ys) in blocks.iter().enumerate() {
        for (jj, col) in ys.chunks(rows.max(1)).enumerate() {
            let j = b * block + jj;
            for (r, &v) in col.iter().enumerate() {
                y[r * out + j] = v;
            }
        }
    }
    Ok(Tensor::from_vec(y, (rows, out), x.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Row 0's bits whatever the number of rows, and each row's bits whatever its position,
    /// for the shapes where candle's product is not batch-invariant (one row; in 16, out 24),
    /// on one thread and spread over several.
    #[test]
    fn a_row_gets_the_same_bits_in_any_batch() -> Result<()> {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            // The last shape spreads over threads at 40 rows, not at one.
            for (k, n) in [(16, 24), (64, 192), (40, 7), (256, 1100)] {
                let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(dtype)?;
                let x = Tensor::randn(0f32, 1.0, (40, k), &dev)?.to_dtype(dtype)?;
                let bits = |t: &Tensor| -> Result<Vec<Vec<f64>>> {
                    Ok(t.to_dtype(DType::F64)?.to_vec2::<f64>()?)
                };
                let all = bits(&linear_rows_invariant(&x, &w)?)?;
                for m in [1, 2, 3, 17, 40] {
                    let part = bits(&linear_rows_invariant(&x.narrow(0, 0, m)?, &w)?)?;
                    assert_eq!(part[..], all[..m], "{dtype:?} k {k} n {n} m {m}");
                }
                let alone = bits(&linear_rows_invariant(&x.narrow(0, 39, 1)?, &w)?)?;
                assert_eq!(alone[0], all[39], "{dtype:?} k {k} n {n}");
                // The product itself (f64 reference, the dtype's rounding).
                let want = x
                    .to_dtype(DType::F64)?
                    .matmul(&w.to_dtype(DType::F64)?.t()?)?;
                let got = linear_rows_invariant(&x, &w)?.to_dtype(DType::F64)?;
                let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f64>()?;
                let scale = want.abs()?.max_all()?.to_scalar::<f64>()?;
                let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-5 };
                assert!(
                    err <= tol * scale,
                    "{dtype:?} k {k} n {n}: {err} vs {scale}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_and_dtypes_are_named() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((3, 8), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((4, 6), DType::F32, &dev).unwrap();
        let e = linear_rows_invariant(&x, &w).unwrap_err().to_string();
        assert!(e.contains("do not fit"), "{e}");
        let w = Tensor::zeros((4, 8), DType::BF16, &dev).unwrap();
        let e = linear_rows_invariant(&x, &w).unwrap_err().to_string();
        assert!(e.contains("do not fit"), "{e}");
    }
}
