//! The LM head's fused softmax kernels (`ops::head_row_stats`, `ops::head_logits_grad`: the CPU
//! kernels, and with `COMPOSER_TEST_DEVICE=cuda` the CUDA kernels in f32 and bf16) against
//! their candle compositions in f64 on the CPU: rows wider than a CUDA block, temperatures
//! ≠ 1, repeated ids in a row (their weights add), no ids at all, a dominant logit (the
//! max shift), half-precision logits on the CPU; and bad input named in the error.

mod common;

use candle_core::{DType, Device, Tensor};
use common::kernel_checks::{assert_close, kernel_cases, randn};
use common::test_device;
use composer_model::ops;

/// `[rows, w]` u32 ids in `0..v`, each row holding one id twice when `w ≥ 2`.
fn ids(rows: usize, w: usize, v: usize, seed: u64) -> Tensor {
    let mut out = Vec::with_capacity(rows * w);
    for r in 0..rows {
        for k in 0..w {
            let k = if k == w - 1 && w >= 2 { 0 } else { k };
            out.push(((seed as usize * 7919 + r * 104_729 + k * 15_485_863) % v) as u32);
        }
    }
    Tensor::from_vec(out, (rows, w), &Device::Cpu).unwrap()
}

/// Stats and ∂z of the kernels on the test device against the f64 compositions on the same
/// (dtype-rounded) logits.
fn check(rows: usize, v: usize, w: usize, temperature: f64, spike: bool, seed: u64) {
    let mut z = randn(&[rows, v], seed, 6.0);
    if spike {
        // One logit far above the rest: exp without the max shift would overflow.
        let mut data: Vec<f64> = z.flatten_all().unwrap().to_vec1().unwrap();
        data[v / 3] = 900.0;
        z = Tensor::from_vec(data, (rows, v), &Device::Cpu).unwrap();
    }
    let ids = ids(rows, w, v, seed);
    let grad = randn(&[rows, w + 1], seed + 1, 1.0);
    let device = test_device();
    let what = format!("rows {rows} v {v} w {w} T {temperature} spike {spike}");
    for (dtype, tol) in kernel_cases(1e-12, 2e-5) {
        // The reference sees exactly the logits the kernel sees.
        let z_in = z.to_dtype(dtype).unwrap();
        let z_ref = z_in.to_dtype(DType::F64).unwrap();
        let stats_ref = ops::head_row_stats_composed(&z_ref, temperature).unwrap();
        let stats = ops::head_row_stats(&z_in.to_device(&device).unwrap(), temperature).unwrap();
        let work = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        assert_eq!(stats.dtype(), work, "{what}: stats dtype");
        // Stats are f32 math even for bf16 logits: held to the f32 tolerance.
        let stats_tol = if dtype == DType::F64 { tol } else { 2e-4 };
        assert_close(
            &format!("{what} stats"),
            &stats.to_device(&Device::Cpu).unwrap(),
            &stats_ref,
            DType::F32,
            stats_tol,
        );

        let dz_ref =
            ops::head_logits_grad_composed(&z_ref, &stats_ref, &ids, &grad, temperature).unwrap();
        let dz = ops::head_logits_grad(
            &z_in.to_device(&device).unwrap(),
            &stats,
            &ids.to_device(&device).unwrap(),
            &grad.to_dtype(work).unwrap().to_device(&device).unwrap(),
            temperature,
        )
        .unwrap();
        assert_eq!(dz.dtype(), dtype, "{what}: ∂z keeps the logits' dtype");
        assert_close(
            &format!("{what} ∂z"),
            &dz.to_device(&Device::Cpu).unwrap(),
            &dz_ref,
            dtype,
            tol,
        );
    }
}

#[test]
fn head_kernels_match_the_compositions() {
    check(5, 1000, 3, 1.0, false, 1);
    // Wider than a CUDA block's stride, temperature ≠ 1, one id per row.
    check(3, 3001, 1, 0.7, false, 2);
    // No ids: only the entropy's gradient.
    check(4, 777, 0, 1.3, false, 3);
    // A dominant logit, and many ids (a teacher's top-K) with a repeat.
    check(2, 2048, 9, 1.0, true, 4);
}

#[test]
fn half_precision_logits_are_widened_on_the_cpu() {
    let z = randn(&[3, 500], 5, 4.0).to_dtype(DType::BF16).unwrap();
    let ids = ids(3, 2, 500, 5);
    let grad = randn(&[3, 3], 6, 1.0).to_dtype(DType::F32).unwrap();
    let stats = ops::head_row_stats(&z, 0.9).unwrap();
    assert_eq!(stats.dtype(), DType::F32);
    let z32 = z.to_dtype(DType::F32).unwrap();
    let want = ops::head_row_stats(&z32, 0.9).unwrap();
    assert_close("bf16 stats", &stats, &want, DType::F32, 0.0);
    let dz = ops::head_logits_grad(&z, &stats, &ids, &grad, 0.9).unwrap();
    assert_eq!(dz.dtype(), DType::BF16);
    let want = ops::head_logits_grad(&z32, &stats, &ids, &grad, 0.9)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    assert_close("bf16 ∂z", &dz, &want, DType::F32, 0.0);
}

#[test]
fn head_kernels_reject_bad_input_by_name() {
    let z = randn(&[2, 10], 7, 1.0).to_dtype(DType::F32).unwrap();
    let stats = ops::head_row_stats(&z, 1.0).unwrap();
    let grad = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
    let err = |r: anyhow::Result<Tensor>| format!("{:#}", r.unwrap_err());

    let bad_id = Tensor::from_vec(vec![3u32, 10], (2, 1), &Device::Cpu).unwrap();
    let e = err(ops::head_logits_grad(&z, &stats, &bad_id, &grad, 1.0));
    assert!(e.contains("token id 10") && e.contains("(10)"), "{e}");

    let ok_ids = Tensor::from_vec(vec![3u32, 4], (2, 1), &Device::Cpu).unwrap();
    let short = Tensor::zeros((2, 1), DType::F32, &Device::Cpu).unwrap();
    let e = err(ops::head_logits_grad(&z, &stats, &ok_ids, &short, 1.0));
    assert!(e.contains("grad [2, W + 1]"), "{e}");
    let e = err(ops::head_logits_grad(&z, &stats, &ok_ids, &grad, 0.0));
    assert!(e.contains("temperature must be > 0"), "{e}");
    let e = err(ops::head_row_stats(&z, f64::NAN));
    assert!(e.contains("temperature must be > 0"), "{e}");
    let e = err(ops::head_row_stats(&z.flatten_all().unwrap(), 1.0));
    assert!(e.contains("[rows, vocab]"), "{e}");
    let empty = Tensor::zeros((2, 0), DType::F32, &Device::Cpu).unwrap();
    let e = err(ops::head_row_stats(&empty, 1.0));
    assert!(e.contains("vocabulary is empty"), "{e}");
}
