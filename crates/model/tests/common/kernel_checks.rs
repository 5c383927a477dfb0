//! Checks shared by the ops tests (`ops/`, `ops_attention.rs`): deterministic random
//! tensors, error measures, and running an op and its gradients on the test device against the
//! f64 composition on the CPU.

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};

pub fn randn(shape: &[usize], seed: u64, scale: f64) -> Tensor {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let data: Vec<f64> = (0..n)
        .map(|_| (rng.random::<f64>() * 2.0 - 1.0) * scale)
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// `t` on the CPU in f64 (a device result, for comparing with an f64 reference).
pub fn cpu_f64(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
}

pub fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    flat(a)
        .iter()
        .zip(flat(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// ‖a − b‖ / ‖b‖ over all elements.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (flat(a), flat(b));
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// bf16 results are compared by relative norm (bf16 keeps 8 bits of mantissa; the inputs
/// themselves are rounded), everything else by the largest absolute difference.
pub const BF16_REL_TOL: f64 = 2e-2;

pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, dtype: DType, tol: f64) {
    if dtype == DType::BF16 {
        // An all-zero reference (∂q, ∂k when every segment is one token) has no scale to be
        // relative to: the largest difference instead.
        let e = if flat(want).iter().all(|x| *x == 0.0) {
            max_diff(got, want)
        } else {
            rel_err(got, want)
        };
        assert!(e <= BF16_REL_TOL, "{what} {dtype:?}: relative error {e:e}");
    } else {
        let d = max_diff(got, want);
        assert!(d <= tol, "{what} {dtype:?}: differs by {d:e}");
    }
}

/// The dtypes (with the tolerance to use) the kernels are checked in on the test device: f64
/// and f32 on the CPU, f32 and bf16 on CUDA.
pub fn kernel_cases(tol: f64, tol32: f64) -> Vec<(DType, f64)> {
    if super::test_device().is_cpu() {
        vec![(DType::F64, tol), (DType::F32, tol32)]
    } else {
        vec![(DType::F32, tol32.max(1e-4)), (DType::BF16, BF16_REL_TOL)]
    }
}

/// Output and the gradients of `Σ out·R` w.r.t. each input, for `f` applied to fresh
/// variables holding `inputs` (cast to `dtype`) on the CPU.
pub fn run(
    inputs: &[Tensor],
    dtype: DType,
    f: &dyn Fn(&[Tensor]) -> Tensor,
) -> (Tensor, Vec<Tensor>) {
    run_on(&Device::Cpu, inputs, dtype, f)
}

/// [`run`] on `device`; output and gradients come back on the CPU.
pub fn run_on(
    device: &Device,
    inputs: &[Tensor],
    dtype: DType,
    f: &dyn Fn(&[Tensor]) -> Tensor,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap().to_device(device).unwrap()).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts);
    let r = randn(out.dims(), 999, 1.0)
        .to_dtype(dtype)
        .unwrap()
        .to_device(device)
        .unwrap();
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = vars
        .iter()
        .map(|v| {
            grads
                .get(v.as_tensor())
                .expect("an input without gradient")
                .to_device(&Device::Cpu)
                .unwrap()
        })
        .collect();
    (out.to_device(&Device::Cpu).unwrap(), g)
}

/// The kernel in f64 equals the composition to `tol`; the kernel in f32 equals the f64
/// composition to `tol32`.
pub fn compare(
    name: &str,
    inputs: &[Tensor],
    kernel: &dyn Fn(&[Tensor]) -> Tensor,
    composed: &dyn Fn(&[Tensor]) -> Tensor,
    tol: f64,
    tol32: f64,
) {
    let (out_ref, grads_ref) = run(inputs, DType::F64, composed);
    let device = super::test_device();
    for (dtype, tol) in kernel_cases(tol, tol32) {
        let (out, grads) = run_on(&device, inputs, dtype, kernel);
        assert_eq!(out.dtype(), dtype, "{name}: output dtype");
        assert_close(&format!("{name} forward"), &out, &out_ref, dtype, tol);
        for (i, (g, gr)) in grads.iter().zip(&grads_ref).enumerate() {
            assert_close(&format!("{name} gradient of input {i}"), g, gr, dtype, tol);
        }
    }
}
