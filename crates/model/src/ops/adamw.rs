//! AdamW's update as two in-place passes over a parameter (torch.optim.AdamW's arithmetic, in
//! its order): the moments from the gradient, then the parameter from the moments. A
//! composition of tensor ops makes ~15 passes and as many fresh buffers per parameter; on a GPU
//! each is a launch, for every parameter tensor of the model at every optimizer step.
//!
//! ```text
//! m ← lerp(m, g, 1−β1)          v ← β2·v + (1−β2)·g·g
//! θ ← θ·(1 − lr·λ)
//! θ ← θ − (lr / (1−β1^t)) · m / (√v / √(1−β2^t) + ε)
//! ```

use super::{contiguous_range, kernels_apply_to};
use anyhow::{bail, Result};
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Tensor};

/// One AdamW step's hyper-parameters (torch.optim.AdamW's names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// β1, β2.
    pub betas: [f64; 2],
    /// ε, added after the square root.
    pub eps: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
    /// The step being taken, from 1 (the bias corrections' exponent).
    pub step: u64,
}

/// The scalars both passes read, computed once on the host in f64 (as torch does in Python)
/// and rounded to the parameters' dtype.
#[derive(Debug, Clone, Copy)]
struct Scalars {
    /// 1 − β1: lerp's weight.
    lerp_weight: f64,
    beta2: f64,
    one_minus_beta2: f64,
    /// 1 − lr·λ.
    decay: f64,
    /// −lr / (1 − β1^t).
    neg_step_size: f64,
    /// √(1 − β2^t).
    bias_correction2_sqrt: f64,
    eps: f64,
}

impl Scalars {
    fn new(h: &AdamWStep) -> Self {
        let [b1, b2] = h.betas;
        let t = h.step.min(i32::MAX as u64) as i32;
        Scalars {
            lerp_weight: 1.0 - b1,
            beta2: b2,
            one_minus_beta2: 1.0 - b2,
            decay: 1.0 - h.lr * h.weight_decay,
            neg_step_size: -h.lr / (1.0 - b1.powi(t)),
            bias_correction2_sqrt: (1.0 - b2.powi(t)).sqrt(),
            eps: h.eps,
        }
    }
}

/// Takes one AdamW step in place: `moments` (`[2, …]` of `param`'s shape: m, then v) from
/// `grad`, then `param` from the moments. f32 or f64 on the CPU, f32 on CUDA; all three
/// tensors of one dtype, on one device, `param` and `moments` contiguous.
pub fn adamw_update(param: &Tensor, moments: &Tensor, grad: &Tensor, h: &AdamWStep) -> Result<()> {
    let dims = param.dims();
    let mut want = vec![2];
    want.extend_from_slice(dims);
    if moments.dims() != want.as_slice() || grad.dims() != dims {
        bail!(
            "adamw: parameter {dims:?}, moments {:?} (expected {want:?}), gradient {:?}",
            moments.dims(),
            grad.dims()
        );
    }
    let dtype = param.dtype();
    let cuda_f32 = param.device().is_cuda() && dtype == DType::F32;
    let kernels = kernels_apply_to(param.device(), dtype) && (param.device().is_cpu() || cuda_f32);
    if !kernels || moments.dtype() != dtype || grad.dtype() != dtype {
        bail!(
            "adamw: parameter {dtype:?} on {:?}, moments {:?}, gradient {:?}: the update runs on f32 (CPU, CUDA) or f64 (CPU) tensors of one dtype",
            param.device(),
            moments.dtype(),
            grad.dtype()
        );
    }
    let devices = [moments.device(), grad.device()];
    if !devices.iter().all(|d| d.same_device(param.device())) {
        bail!(
            "adamw: parameter on {:?}, moments on {:?}, gradient on {:?}",
            param.device(),
            moments.device(),
            grad.device()
        );
    }
    if !param.is_contiguous() || !moments.is_contiguous() {
        bail!(
            "adamw: the parameter and its moments must be contiguous (they are updated in place)"
        );
    }
    if h.step == 0 {
        bail!("adamw: step 0 (steps count from 1: the bias corrections divide by 1 − β^step)");
    }
    let s = Scalars::new(h);
    let n = param.elem_count();
    let pass = |pass| AdamWPass { pass, n, s };
    moments.inplace_op2(&grad.contiguous()?, &pass(Pass::Moments))?;
    param.inplace_op2(moments, &pass(Pass::Param))?;
    Ok(())
}

/// The element type's side of the two passes (the CPU twins of `adamw_moments` and
/// `adamw_params` in kernels.cu).
trait Elem:
    Copy
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    const ONE: Self;
    fn of(x: f64) -> Self;
    fn sqrt(self) -> Self;
}
impl Elem for f32 {
    const ONE: Self = 1.0;
    fn of(x: f64) -> Self {
        x as f32
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}
impl Elem for f64 {
    const ONE: Self = 1.0;
    fn of(x: f64) -> Self {
        x
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// `mv` = [m…, v…]: m ← lerp(m, g, w) (torch's lerp: `m + w·(g − m)` for w < ½, else
/// `g − (g − m)·(1 − w)`), v ← v·β2 + ((1 − β2)·g)·g.
fn moments_pass<T: Elem>(mv: &mut [T], g: &[T], s: &Scalars) {
    let n = g.len();
    let (m, v) = mv.split_at_mut(n);
    let w = T::of(s.lerp_weight);
    let (b2, omb2) = (T::of(s.beta2), T::of(s.one_minus_beta2));
    let small = s.lerp_weight < 0.5;
    for ((m, v), &g) in m.iter_mut().zip(v.iter_mut()).zip(g) {
        *m = if small {
            *m + w * (g - *m)
        } else {
            g - (g - *m) * (T::ONE - w)
        };
        *v = *v * b2 + omb2 * g * g;
    }
}

/// θ ← θ·decay, then θ + (−step size)·(m / (√v / √bc2 + ε)).
fn param_pass<T: Elem>(p: &mut [T], mv: &[T], s: &Scalars) {
    let (m, v) = mv.split_at(p.len());
    let (decay, step) = (T::of(s.decay), T::of(s.neg_step_size));
    let (bc2, eps) = (T::of(s.bias_correction2_sqrt), T::of(s.eps));
    for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
        let decayed = *p * decay;
        *p = decayed + step * (m / (v.sqrt() / bc2 + eps));
    }
}

/// Which of the two passes an [`AdamWPass`] runs: the moments (`[2, n]`, updated) from the
/// gradient (`[n]`), or the parameter (`[n]`, updated) from the moments.
#[derive(Clone, Copy)]
enum Pass {
    Moments,
    Param,
}

/// One pass over a parameter of `n` elements, in place on the first tensor.
struct AdamWPass {
    pass: Pass,
    n: usize,
    s: Scalars,
}

impl AdamWPass {
    /// Elements of the updated tensor and of the one read.
    fn lens(&self) -> (usize, usize) {
        match self.pass {
            Pass::Moments => (2 * self.n, self.n),
            Pass::Param => (self.n, 2 * self.n),
        }
    }

    fn run<T: Elem>(&self, dst: &mut [T], src: &[T]) {
        match self.pass {
            Pass::Moments => moments_pass(dst, src, &self.s),
            Pass::Param => param_pass(dst, src, &self.s),
        }
    }
}

impl InplaceOp2 for AdamWPass {
    fn name(&self) -> &'static str {
        match self.pass {
            Pass::Moments => "adamw-moments",
            Pass::Param => "adamw-param",
        }
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        ld: &Layout,
        src: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        let (a, b) = contiguous_range(ld, "adamw", "updated tensor")?;
        let (c, d) = contiguous_range(ls, "adamw", "tensor read")?;
        if (b - a, d - c) != self.lens() {
            candle_core::bail!(
                "{}: {} and {} elements for a parameter of {}",
                self.name(),
                b - a,
                d - c,
                self.n
            )
        }
        match (dst, src) {
            (CpuStorage::F32(dst), CpuStorage::F32(src)) => self.run(&mut dst[a..b], &src[c..d]),
            (CpuStorage::F64(dst), CpuStorage::F64(src)) => self.run(&mut dst[a..b], &src[c..d]),
            _ => candle_core::bail!("{}: f32 or f64 tensors of one dtype", self.name()),
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
        let s = &self.s;
        let (kernel, scalars) = match self.pass {
            Pass::Moments => (
                "adamw_moments",
                vec![s.lerp_weight, s.beta2, s.one_minus_beta2],
            ),
            Pass::Param => (
                "adamw_params",
                vec![s.decay, s.neg_step_size, s.bias_correction2_sqrt, s.eps],
            ),
        };
        super::cuda::adamw_pass(kernel, (dst, ld), (src, ls), self.n, &scalars)
    }
}
