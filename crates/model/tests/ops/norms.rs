//! RMSNorm (alone and fused with the residual add) and the embedding: values, gradients,
//! the same bits on every run.

use crate::common;
use crate::common::kernel_checks::{
    assert_close, compare, cpu_f64, flat, kernel_cases, randn, run_on,
};
use candle_core::{DType, Device, Tensor, Var};
use composer_model::ops;

#[test]
fn rms_norm_matches_the_composition() {
    // Odd sizes; weights away from 1 so ∂w matters.
    let x = randn(&[3, 5, 37], 1, 2.0);
    let w = (randn(&[37], 2, 0.5) + 1.0).unwrap();
    compare(
        "rms_norm",
        &[x, w],
        &|t| ops::rms_norm(&t[0], &t[1], 1e-6).unwrap(),
        &|t| ops::rms_norm_composed(&t[0], &t[1], 1e-6).unwrap(),
        1e-12,
        1e-5,
    );
}

#[test]
fn embedding_gradient_is_the_index_select_gradient() {
    // 100 tokens over 13 rows: id 4 at 70 of them (pieces of the grouped backward, merged),
    // rows 0 and 12 at none (their gradient stays zero).
    let ids: Vec<u32> = (0..100u32)
        .map(|i| if i % 10 < 7 { 4 } else { 1 + (i * 7) % 11 })
        .collect();
    let w = randn(&[13, 37], 3, 1.0);
    let device = common::test_device();
    let ids_on = Tensor::new(ids.as_slice(), &device).unwrap();
    let ids_cpu = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    compare(
        "embedding",
        std::slice::from_ref(&w),
        &|t| ops::embedding(&t[0], &ids_on, true).unwrap(),
        &|t| t[0].index_select(&ids_cpu, 0).unwrap(),
        1e-12,
        1e-5,
    );
    compare(
        "embedding_of_ids",
        std::slice::from_ref(&w),
        &|t| ops::embedding_of_ids(&t[0], &ids, true).unwrap(),
        &|t| t[0].index_select(&ids_cpu, 0).unwrap(),
        1e-12,
        1e-5,
    );
    // No atomics: the same gradient bits every run (on CUDA too).
    for (dtype, _) in kernel_cases(0.0, 0.0) {
        let grads = || {
            let (_, g) = run_on(&device, std::slice::from_ref(&w), dtype, &|t| {
                ops::embedding(&t[0], &ids_on, true).unwrap()
            });
            flat(&g[0])
        };
        let first = grads();
        assert!(first.iter().any(|&x| x != 0.0));
        assert_eq!(
            first,
            grads(),
            "{dtype:?}: the embedding gradient changed between runs"
        );
    }
    // An id outside the vocabulary is named before any work.
    let bad = Tensor::new(&[3u32, 13], &device).unwrap();
    let w32 = w.to_dtype(DType::F32).unwrap().to_device(&device).unwrap();
    let v = Var::from_tensor(&w32).unwrap();
    let e = format!(
        "{:#}",
        ops::embedding(v.as_tensor(), &bad, true).unwrap_err()
    );
    assert!(e.contains("token id 13 at position 1"), "{e}");
}

#[test]
fn rms_norm_gradients_are_the_same_bits_every_run() {
    // Enough rows for several blocks of the CUDA backward's per-block sums of ∂w.
    let x = randn(&[3000, 64], 11, 2.0);
    let w = (randn(&[64], 12, 0.5) + 1.0).unwrap();
    let device = common::test_device();
    for (dtype, _) in kernel_cases(0.0, 0.0) {
        let grads = || {
            let (_, g) = run_on(&device, &[x.clone(), w.clone()], dtype, &|t| {
                ops::rms_norm(&t[0], &t[1], 1e-6).unwrap()
            });
            g.iter().map(flat).collect::<Vec<_>>()
        };
        assert_eq!(
            grads(),
            grads(),
            "{dtype:?}: rms_norm's gradients changed between runs"
        );
    }
}

#[test]
fn add_rms_norm_equals_the_add_and_the_norm_and_refuses_a_backward() {
    // The decode's fused residual add + RMSNorm: both results against the f64 composition.
    let x = randn(&[4, 1, 37], 7, 2.0);
    let delta = randn(&[4, 1, 37], 8, 1.5);
    let w = (randn(&[37], 9, 0.5) + 1.0).unwrap();
    let sum_ref = (&x + &delta).unwrap();
    let normed_ref = ops::rms_norm_composed(&sum_ref, &w, 1e-6).unwrap();
    let device = common::test_device();
    for (dtype, tol) in kernel_cases(1e-13, 1e-5) {
        let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&device).unwrap();
        let (sum, normed) = ops::add_rms_norm(&on(&x), &on(&delta), &on(&w), 1e-6).unwrap();
        assert_eq!(sum.dims(), x.dims());
        assert_eq!(normed.dims(), x.dims());
        assert_close("add_rms_norm sum", &cpu_f64(&sum), &sum_ref, dtype, tol);
        assert_close(
            "add_rms_norm normed",
            &cpu_f64(&normed),
            &normed_ref,
            dtype,
            tol,
        );
    }
    // Inference only: a gradient through it is an error, never silently missing.
    let v = Var::from_tensor(&x.to_dtype(DType::F32).unwrap()).unwrap();
    let (_, normed) = ops::add_rms_norm(
        v.as_tensor(),
        &delta.to_dtype(DType::F32).unwrap(),
        &w.to_dtype(DType::F32).unwrap(),
        1e-6,
    )
    .unwrap();
    assert!(normed.sum_all().unwrap().backward().is_err());
    let e = format!(
        "{:#}",
        ops::add_rms_norm(&x, &randn(&[4, 37], 1, 1.0), &w, 1e-6).unwrap_err()
    );
    assert!(
        e.contains("x has shape [4, 1, 37] but delta [4, 37]"),
        "{e}"
    );
}
