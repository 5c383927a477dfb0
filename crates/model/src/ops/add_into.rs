//! `acc += x` in place, `acc` the running sum in the work dtype (f32, or f64 on the CPU) and `x`
//! one term in the same dtype or bf16. The LM head's weight gradient is such a sum over token
//! chunks of `[vocab, hidden]` terms: as `acc + x.to_dtype(f32)` each chunk cost a widened copy
//! and a fresh sum (on an H200, Qwen2.5-0.5B, 16×512 tokens: `cast_bf16_f32` 1.33 ms and
//! `badd_f32` 0.58 ms per chunk, ten chunks a step); this is one pass that reads `x` and updates
//! `acc`.

use super::contiguous_range;
use anyhow::{bail, Result};
use candle_core::{CpuStorage, DType, Device, InplaceOp2, Layout, Tensor};

/// `*acc += x` (same shape; `x` widened to `acc`'s dtype). In place where a kernel serves the
/// pair — the CPU with an f32 sum of f32/bf16/f16 terms or an f64 sum of f64 terms, CUDA with
/// an f32 sum of f32/bf16 terms — else `*acc` becomes the composed sum.
pub(crate) fn add_into(acc: &mut Tensor, x: &Tensor) -> Result<()> {
    if acc.shape() != x.shape() {
        bail!(
            "add_into: a sum of {:?} and a term of {:?}",
            acc.shape(),
            x.shape()
        );
    }
    let pair = (acc.device(), acc.dtype(), x.dtype());
    let cpu = matches!(
        pair,
        (
            Device::Cpu,
            DType::F32,
            DType::F32 | DType::BF16 | DType::F16
        ) | (Device::Cpu, DType::F64, DType::F64)
    );
    let cuda = cfg!(feature = "cuda")
        && matches!(
            pair,
            (Device::Cuda(_), DType::F32, DType::F32 | DType::BF16)
        );
    if (cpu || cuda) && acc.is_contiguous() {
        acc.inplace_op2(&x.contiguous()?, &AddInto)?;
    } else {
        *acc = (&*acc + x.to_dtype(acc.dtype())?)?;
    }
    Ok(())
}

/// The in-place pass of [`add_into`] (CUDA kernel `add_into_f32_<x dtype>` in kernels.cu).
struct AddInto;

fn add_widened<T: Copy>(dst: &mut [f32], src: &[T], widen: impl Fn(T) -> f32) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += widen(s);
    }
}

impl InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        ld: &Layout,
        src: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        let (a, b) = contiguous_range(ld, "add_into", "sum")?;
        let (c, d) = contiguous_range(ls, "add_into", "term")?;
        if b - a != d - c {
            candle_core::bail!("add_into: {} elements and {}", b - a, d - c)
        }
        match (dst, src) {
            (CpuStorage::F32(dst), CpuStorage::F32(src)) => {
                add_widened(&mut dst[a..b], &src[c..d], |x| x)
            }
            (CpuStorage::F32(dst), CpuStorage::BF16(src)) => {
                add_widened(&mut dst[a..b], &src[c..d], |x| x.to_f32())
            }
            (CpuStorage::F32(dst), CpuStorage::F16(src)) => {
                add_widened(&mut dst[a..b], &src[c..d], |x| x.to_f32())
            }
            (CpuStorage::F64(dst), CpuStorage::F64(src)) => {
                for (x, &y) in dst[a..b].iter_mut().zip(&src[c..d]) {
                    *x += y;
                }
            }
            _ => candle_core::bail!("add_into: an f32 sum of f32/bf16/f16, or f64 of f64"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        ld: &Layout,
        src: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        super::cuda::add_into_f32((dst, ld), (src, ls))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_in_place_and_composes_elsewhere() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1.5f32, -2.0], [0.25, 4.0]], &dev)?;
        for term in [DType::F32, DType::BF16, DType::F16] {
            let mut acc = Tensor::ones((2, 2), DType::F32, &dev)?;
            let before = acc.clone();
            add_into(&mut acc, &x.to_dtype(term)?)?;
            add_into(&mut acc, &x.to_dtype(term)?)?;
            assert_eq!(acc.to_vec2::<f32>()?, [[4.0, -3.0], [1.5, 9.0]], "{term:?}");
            // In place: the tensor the sum started from holds it too.
            assert_eq!(before.to_vec2::<f32>()?, acc.to_vec2::<f32>()?, "{term:?}");
        }
        // A pair no kernel serves (an f32 sum of f64 terms): composed, same values.
        let mut acc = Tensor::ones((2, 2), DType::F32, &dev)?;
        add_into(&mut acc, &x.to_dtype(DType::F64)?)?;
        assert_eq!(acc.to_vec2::<f32>()?, [[2.5, -1.0], [1.25, 5.0]]);
        let err = add_into(&mut acc, &x.reshape(4)?).unwrap_err();
        assert!(format!("{err}").contains("add_into"), "{err}");
        Ok(())
    }
}
