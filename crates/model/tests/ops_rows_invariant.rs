//! Deterministic mode's batch-invariant ops on `$COMPOSER_TEST_DEVICE` (the CPU in CI; on CUDA,
//! from tools/gpu_check.sh, their kernels in `rows_invariant_kernels.cuh`): the product
//! `ops::linear_rows_invariant` and the causal attention of new queries
//! `ops::attend_one_rows_invariant` give each row the same bits in any batch — alone, among 40
//! rows, at another position — and each query the same bits in a prefill as decoded alone; and
//! their values are the CPU twin's (f64 reference on the CPU).

mod common;

use candle_core::{DType, Device, Tensor};
use common::kernel_checks::{flat, max_diff};
use common::test_device;
use composer_model::ops;

/// Every element's f64 bits (f32 and bf16 widen exactly).
fn bits(t: &Tensor) -> Vec<u64> {
    flat(t).into_iter().map(f64::to_bits).collect()
}

#[test]
fn linear_rows_invariant_gives_a_row_the_same_bits_in_any_batch() {
    let dev = test_device();
    for dtype in [DType::F32, DType::BF16] {
        // A Qwen-like width, an odd one, and out past a block's weight rows.
        for (k, n) in [(896, 40), (37, 9), (64, 300)] {
            let x = Tensor::randn(0f32, 1.0, (40, k), &Device::Cpu).unwrap();
            let w = Tensor::randn(0f32, 0.2, (n, k), &Device::Cpu).unwrap();
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
            let (xd, wd) = (on(&x), on(&w));
            let all = ops::linear_rows_invariant(&xd, &wd).unwrap();
            let all_bits = bits(&all);
            for (start, m) in [(0, 1), (0, 17), (39, 1), (5, 3)] {
                let part =
                    ops::linear_rows_invariant(&xd.narrow(0, start, m).unwrap(), &wd).unwrap();
                assert_eq!(
                    bits(&part),
                    all_bits[start * n..(start + m) * n],
                    "{dtype:?} k {k} n {n}: rows {start}..{}",
                    start + m
                );
            }
            // The CPU twin (the same rounding of the inputs; sums in another order).
            let twin = ops::linear_rows_invariant(
                &x.to_dtype(dtype).unwrap(),
                &w.to_dtype(dtype).unwrap(),
            )
            .unwrap();
            let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-4 };
            let err = max_diff(&all, &twin);
            assert!(err <= tol, "{dtype:?} k {k} n {n}: {err}");
        }
    }
}

#[test]
fn attend_one_rows_invariant_gives_a_row_the_same_bits_in_any_batch() {
    let dev = test_device();
    for dtype in [DType::F32, DType::BF16] {
        // Qwen2.5-0.5B's heads (14 over 2, head_dim 64), 128-wide heads over a long cache, and
        // prefills: queries a row `t` (the last `t` of the `len` positions).
        for (t, hq, hkv, d, len) in [
            (1, 14, 2, 64, 37),
            (1, 4, 4, 128, 300),
            (1, 2, 1, 80, 1),
            (5, 14, 2, 64, 40),
            (7, 2, 1, 80, 7),
        ] {
            let rows = 6;
            let cap = len + 16;
            let cpu = |shape: &[usize], scale: f32| {
                Tensor::randn(0f32, scale, shape, &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let q = cpu(&[rows, t, hq, d], 1.0);
            let kb = cpu(&[rows, hkv, cap, d], 1.0);
            let vb = cpu(&[rows, hkv, cap, d], 1.0);
            let on = |t: &Tensor| t.to_device(&dev).unwrap();
            let (qd, kd, vd) = (on(&q), on(&kb), on(&vb));
            // The cache's buffers narrowed to the keys written, as the KV cache hands them out.
            let keys = |t: &Tensor| t.narrow(2, 0, len).unwrap();
            let all = ops::attend_one_rows_invariant(&qd, &keys(&kd), &keys(&vd)).unwrap();
            let all_bits = bits(&all);
            let per_row = t * hq * d;
            for (start, m) in [(0, 1), (5, 1), (2, 3)] {
                let sub = |t: &Tensor| t.narrow(0, start, m).unwrap();
                let part =
                    ops::attend_one_rows_invariant(&sub(&qd), &keys(&sub(&kd)), &keys(&sub(&vd)))
                        .unwrap();
                assert_eq!(
                    bits(&part),
                    all_bits[start * per_row..(start + m) * per_row],
                    "{dtype:?} {hq}/{hkv} heads of {d}, {len} keys: rows {start}..{}",
                    start + m
                );
            }
            // Each query of row 4 decoded alone (one query over its own keys): the same bits.
            let per_query = hq * d;
            for i in 0..t {
                let upto = |x: &Tensor| {
                    x.narrow(0, 4, 1)
                        .unwrap()
                        .narrow(2, 0, len - t + i + 1)
                        .unwrap()
                };
                let qi = qd.narrow(0, 4, 1).unwrap().narrow(1, i, 1).unwrap();
                let one = ops::attend_one_rows_invariant(&qi, &upto(&kd), &upto(&vd)).unwrap();
                let at = 4 * per_row + i * per_query;
                assert_eq!(
                    bits(&one),
                    all_bits[at..at + per_query],
                    "{dtype:?} {hq}/{hkv} heads of {d}, {len} keys: query {i} of {t}"
                );
            }
            let twin = ops::attend_one_rows_invariant(&q, &keys(&kb), &keys(&vb)).unwrap();
            let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-5 };
            let err = max_diff(&all, &twin);
            assert!(err <= tol, "{dtype:?} {hq}/{hkv} heads of {d}: {err}");
        }
    }
}
