//! The training ops of `composer_model::ops` (custom CPU kernels with a backward) against
//! their differentiable candle compositions: forward values and gradients in f64 with tight
//! tolerances, the f32 kernels against the f64 composition, and bad inputs.
//!
//! The model's training forward with the kernels equals it with the compositions (f64,
//! left-padded batch, every parameter's gradient).
//!
//! Gradients are those of the scalar `Σ out·R` for a fixed random `R`, so every output element
//! feeds the check with its own weight.
//!
//! With `COMPOSER_TEST_DEVICE=cuda` (a `--features cuda` build on a GPU, tools/gpu_check.sh)
//! the kernels run on the GPU in f32 and bf16 against the f64 composition on the CPU: the
//! CUDA kernels against their CPU twins' reference. The varlen attention's checks are in
//! `ops_attention.rs`.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::kernel_checks::{
    assert_close, compare, cpu_f64, flat, kernel_cases, max_diff, randn, rel_err, run, run_on,
};
use composer_model::{ops, token_logprobs, Transformer};

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

#[test]
fn qkv_bias_rope_equals_the_bias_adds_and_rope() {
    // The decode's fused attention inputs from the packed projection [q | k | v], with biases
    // (Qwen2) and without (Llama), GQA.
    let (rows, nh, nkv, d) = (5, 4, 2, 10);
    let heads = ops::QkvHeads {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: d,
    };
    let width = (nh + 2 * nkv) * d;
    let qkv = randn(&[rows, width], 11, 1.5);
    let bias = randn(&[width], 14, 0.5);
    let angles = randn(&[rows, d / 2], 17, 3.0);
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let device = common::test_device();
    for with_bias in [true, false] {
        let biased = if with_bias {
            qkv.broadcast_add(&bias).unwrap()
        } else {
            qkv.clone()
        };
        let part = |from: usize, h: usize| {
            biased
                .narrow(1, from * d, h * d)
                .unwrap()
                .reshape((rows, h, d))
                .unwrap()
        };
        let q_ref = ops::rope_composed(&part(0, nh), &cos, &sin).unwrap();
        let k_ref = ops::rope_composed(&part(nh, nkv), &cos, &sin).unwrap();
        let v_ref = part(nh + nkv, nkv);
        for (dtype, tol) in kernel_cases(1e-13, 1e-5) {
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&device).unwrap();
            let b = on(&bias);
            let (qo, kvo) = ops::qkv_bias_rope(
                &on(&qkv),
                with_bias.then_some(&b),
                &on(&cos),
                &on(&sin),
                heads,
            )
            .unwrap();
            assert_close("fused q", &cpu_f64(&qo), &q_ref, dtype, tol);
            assert_eq!(kvo.dims(), [2, rows, nkv, d]);
            assert_close(
                "fused k",
                &cpu_f64(&kvo.get(0).unwrap()),
                &k_ref,
                dtype,
                tol,
            );
            assert_close(
                "fused v",
                &cpu_f64(&kvo.get(1).unwrap()),
                &v_ref,
                dtype,
                tol,
            );
        }
    }
    let narrow = randn(&[rows, width - d], 12, 1.0);
    let e = format!(
        "{:#}",
        ops::qkv_bias_rope(&narrow, None, &cos, &sin, heads).unwrap_err()
    );
    assert!(e.contains("qkv has shape [5, 70], expected [5, 80]"), "{e}");
    let e = format!(
        "{:#}",
        ops::qkv_bias_rope(&qkv, Some(&cos), &cos, &sin, heads).unwrap_err()
    );
    assert!(
        e.contains("the bias has shape [5, 5], expected [80]"),
        "{e}"
    );
}

#[test]
fn swiglu_packed_equals_swiglu_of_the_halves() {
    // The decode's SwiGLU from one product with gate's and up's weights stacked.
    let (rows, inter) = (3, 13);
    let gate_up = randn(&[rows, 1, 2 * inter], 21, 2.0);
    let device = common::test_device();
    let reference = ops::swiglu_composed(
        &gate_up.narrow(2, 0, inter).unwrap(),
        &gate_up.narrow(2, inter, inter).unwrap(),
    )
    .unwrap();
    for (dtype, tol) in kernel_cases(1e-13, 1e-5) {
        let on = gate_up.to_dtype(dtype).unwrap().to_device(&device).unwrap();
        let got = ops::swiglu_packed(&on).unwrap();
        assert_eq!(got.dims(), [rows, 1, inter]);
        assert_close("swiglu_packed", &cpu_f64(&got), &reference, dtype, tol);
    }
    let e = format!(
        "{:#}",
        ops::swiglu_packed(&randn(&[2, 7], 1, 1.0)).unwrap_err()
    );
    assert!(e.contains("not [gate | up] (odd or none)"), "{e}");
    let scalar = Tensor::new(1f64, &Device::Cpu).unwrap();
    let e = format!("{:#}", ops::swiglu_packed(&scalar).unwrap_err());
    assert!(e.contains("shape []"), "{e}");
}

#[test]
fn decode_product_matches_the_product() {
    // The decode step's projections (on CUDA in bf16 the skinny kernel, `in` split over blocks
    // for the narrow ones; elsewhere `linear`) and the SwiGLU epilogue on a stacked
    // [gate | up] weight, against f64 products of the same rounded inputs: Qwen2.5-0.5B's
    // shapes at 1–64 rows, a width past a block's 128 weight rows, `in` ending mid-stage. Each
    // runs twice on the same counters: a counter the kernel left non-zero would leave the
    // second product without its last block's sum.
    let device = common::test_device();
    let counters = ops::SplitCounters::new(&device, 9728).unwrap();
    let shapes = [
        (1, 1152, 896),
        (17, 896, 4864),
        (64, 1152, 896),
        (64, 9728, 896),
        (64, 896, 4864),
        (5, 200, 136),
    ];
    for (i, &(rows, out, k)) in shapes.iter().enumerate() {
        let x = randn(&[rows, k], 40 + i as u64, 1.0);
        let w = randn(&[out, k], 50 + i as u64, 0.1);
        for (dtype, tol) in kernel_cases(1e-12, 1e-4) {
            let rounded = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F64).unwrap();
            let want = rounded(&x).matmul(&rounded(&w).t().unwrap()).unwrap();
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&device).unwrap();
            let (xd, wd) = (on(&x), on(&w));
            for epilogue in [ops::DecodeEpilogue::Product, ops::DecodeEpilogue::Swiglu] {
                let want = match epilogue {
                    ops::DecodeEpilogue::Product => want.clone(),
                    // g and u rounded as the product the unfused SwiGLU reads.
                    ops::DecodeEpilogue::Swiglu => {
                        ops::swiglu_packed(&rounded(&want.to_dtype(dtype).unwrap())).unwrap()
                    }
                };
                for launch in 0..2 {
                    let got = ops::decode_product(&xd, &wd, epilogue, None, None, Some(&counters))
                        .unwrap();
                    let what = format!("decode product {rows}×{out}×{k} {epilogue:?} #{launch}");
                    assert_close(&what, &cpu_f64(&got), &want, dtype, tol);
                }
            }
        }
    }
}

#[test]
fn decode_product_folds_the_norm_and_the_residual() {
    // The decode layer's norms and residual adds inside its products (on CUDA in bf16 the
    // skinny kernel: x·norm_w rounded per stage, the rows' sums of squares split like the
    // product, the rounded product plus the residual; elsewhere rms_norm, linear, an add)
    // against rms_norm, the product and the add in f64 on the same rounded inputs: o and down
    // with the residual, gate/up with the norm and SwiGLU, and both on one product at a width
    // past a block's weight rows with `in` ending mid-stage. Twice on the same counters.
    let device = common::test_device();
    let counters = ops::SplitCounters::new(&device, 9728).unwrap();
    let (plain, swiglu) = (ops::DecodeEpilogue::Product, ops::DecodeEpilogue::Swiglu);
    // rows, out, in, epilogue, norm, residual.
    let cases = [
        (64, 896, 896, plain, false, true),
        (64, 9728, 896, swiglu, true, false),
        (17, 896, 4864, plain, false, true),
        (5, 200, 136, plain, true, true),
        (3, 256, 64, swiglu, true, false),
    ];
    for (i, &(rows, out, k, epilogue, with_norm, with_residual)) in cases.iter().enumerate() {
        let seed = 140 + 10 * i as u64;
        let x = randn(&[rows, k], seed, 3.0).affine(1.0, 0.5).unwrap();
        let w = randn(&[out, k], seed + 1, 0.1);
        let norm_w = randn(&[k], seed + 2, 0.3).affine(1.0, 1.0).unwrap();
        let residual = randn(&[rows, out], seed + 3, 4.0);
        for (dtype, tol) in kernel_cases(1e-12, 1e-4) {
            let rounded = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F64).unwrap();
            let x_in = if with_norm {
                ops::rms_norm(&rounded(&x), &rounded(&norm_w), 1e-6).unwrap()
            } else {
                rounded(&x)
            };
            let y = x_in.matmul(&rounded(&w).t().unwrap()).unwrap();
            let want = match epilogue {
                ops::DecodeEpilogue::Product => y,
                ops::DecodeEpilogue::Swiglu => {
                    ops::swiglu_packed(&rounded(&y.to_dtype(dtype).unwrap())).unwrap()
                }
            };
            let want = if with_residual {
                (rounded(&want.to_dtype(dtype).unwrap()) + rounded(&residual)).unwrap()
            } else {
                want
            };
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&device).unwrap();
            let (xd, wd, norm_wd, rd) = (on(&x), on(&w), on(&norm_w), on(&residual));
            let norm = with_norm.then_some(ops::InputNorm {
                weight: &norm_wd,
                eps: 1e-6,
            });
            let res = with_residual.then_some(&rd);
            for launch in 0..2 {
                let got =
                    ops::decode_product(&xd, &wd, epilogue, norm, res, Some(&counters)).unwrap();
                let what = format!(
                    "decode product {rows}×{out}×{k} {epilogue:?} norm {with_norm} residual {with_residual} #{launch}"
                );
                assert_close(&what, &cpu_f64(&got), &want, dtype, tol);
            }
        }
    }
}

#[test]
fn decode_qkv_into_cache_matches_the_three_ops() {
    // The decode step's attention inputs in one op (on CUDA in bf16 the skinny kernel with
    // bias, RoPE and the cache write as its epilogue; elsewhere the product, qkv_bias_rope and
    // write_kv_slots) against those three ops in f64: q, and the whole pool — the rows' slots
    // hold their keys and values, every other slot its old value. Qwen2.5-0.5B's heads at
    // batch 64, and 320 columns (a block's last 128 half used) at head_dim 64 and 128.
    let device = common::test_device();
    let counters = ops::SplitCounters::new(&device, 1152).unwrap();
    let cases = [
        (64, 14, 2, 64, 896),
        (5, 3, 1, 64, 136),
        (3, 1, 2, 128, 200),
    ];
    for (i, &(rows, nh, nkv, d, k)) in cases.iter().enumerate() {
        let heads = ops::QkvHeads {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
        };
        let width = heads.packed_width();
        let seed = 60 + 10 * i as u64;
        let x = randn(&[rows, k], seed, 1.0);
        let w = randn(&[width, k], seed + 1, 0.1);
        let bias = randn(&[width], seed + 2, 0.5);
        let angles = randn(&[rows, d / 2], seed + 3, 3.0);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        // Distinct slots spread over a pool of 301 (prime: r·7 + 3 never repeats).
        let slot_count = 301;
        let slots: Vec<u32> = (0..rows as u32).map(|r| (r * 7 + 3) % 301).collect();
        let sentinel = |dtype: DType, dev: &Device| {
            Tensor::full(5f32, (2, slot_count, nkv, d), dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        // Every case without a norm in front and with one (x far from unit rms).
        let norm_w = randn(&[k], seed + 4, 0.3).affine(1.0, 1.0).unwrap();
        for ((dtype, tol), with_norm) in kernel_cases(1e-12, 1e-4)
            .into_iter()
            .flat_map(|c| [(c, false), (c, true)])
        {
            let rounded = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F64).unwrap();
            let x = if with_norm {
                x.affine(3.0, 0.5).unwrap()
            } else {
                x.clone()
            };
            let x_in = if with_norm {
                ops::rms_norm(&rounded(&x), &rounded(&norm_w), 1e-6).unwrap()
            } else {
                rounded(&x)
            };
            let qkv = x_in.matmul(&rounded(&w).t().unwrap()).unwrap();
            let (r_bias, r_cos, r_sin) = (rounded(&bias), rounded(&cos), rounded(&sin));
            let (q_ref, kv_ref) =
                ops::qkv_bias_rope(&qkv, Some(&r_bias), &r_cos, &r_sin, heads).unwrap();
            let pool_ref = sentinel(DType::F64, &Device::Cpu);
            let cpu_slots = ops::KvSlots::new(slots.clone(), &Device::Cpu).unwrap();
            ops::write_kv_slots(&pool_ref, &kv_ref, &cpu_slots).unwrap();
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&device).unwrap();
            let dev_slots = ops::KvSlots::new(slots.clone(), &device).unwrap();
            let norm_wd = on(&norm_w);
            let norm = with_norm.then_some(ops::InputNorm {
                weight: &norm_wd,
                eps: 1e-6,
            });
            for launch in 0..2 {
                let pool = sentinel(dtype, &device);
                let q = ops::decode_qkv_into_cache(
                    &on(&x),
                    norm,
                    &on(&w),
                    Some(&on(&bias)),
                    &on(&cos),
                    &on(&sin),
                    heads,
                    &pool,
                    &dev_slots,
                    Some(&counters),
                )
                .unwrap();
                let what = format!("decode q/k/v case {i} norm {with_norm} #{launch}");
                assert_close(&format!("{what} q"), &cpu_f64(&q), &q_ref, dtype, tol);
                assert_close(
                    &format!("{what} pool"),
                    &cpu_f64(&pool),
                    &pool_ref,
                    dtype,
                    tol,
                );
            }
        }
    }
    // A slot outside the pool: an error naming it, before anything is written.
    let heads = ops::QkvHeads {
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 64,
    };
    let dtype = if device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let t = |shape: &[usize]| {
        randn(shape, 9, 1.0)
            .to_dtype(dtype)
            .unwrap()
            .to_device(&device)
            .unwrap()
    };
    let pool = Tensor::zeros((2, 4, 1, 64), dtype, &device).unwrap();
    let bad = ops::KvSlots::new(vec![1, 4], &device).unwrap();
    let e = ops::decode_qkv_into_cache(
        &t(&[2, 64]),
        None,
        &t(&[256, 64]),
        None,
        &t(&[2, 32]),
        &t(&[2, 32]),
        heads,
        &pool,
        &bad,
        Some(&counters),
    )
    .unwrap_err();
    assert!(
        format!("{e:#}").contains("slot 4 is outside the pool's 4"),
        "{e:#}"
    );
    let untouched = pool
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    assert_eq!(untouched.to_scalar::<f64>().unwrap(), 0.0);
}

#[test]
fn rope_matches_the_composition() {
    let (n, h, d) = (11, 3, 10);
    let x = randn(&[n, h, d], 3, 1.0);
    let angles = randn(&[n, d / 2], 4, 3.0);
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let (c64, s64) = (cos.clone(), sin.clone());
    let (out_ref, g_ref) = run(std::slice::from_ref(&x), DType::F64, &|t| {
        ops::rope_composed(&t[0], &c64, &s64).unwrap()
    });
    let device = common::test_device();
    for (dtype, tol) in kernel_cases(1e-13, 1e-5) {
        let table = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&device).unwrap();
        let (c, s) = (table(&cos), table(&sin));
        let (out, g) = run_on(&device, std::slice::from_ref(&x), dtype, &|t| {
            ops::rope(&t[0], &c, &s).unwrap()
        });
        assert_close("rope forward", &out, &out_ref, dtype, tol);
        assert_close("rope gradient", &g[0], &g_ref[0], dtype, tol);
    }
}

#[test]
fn rope_to_heads_is_rope_then_the_transpose() {
    // [B, T, H, D] in, attention's [B, H, T, D] out; the backward maps back.
    let (b, t, h, d) = (2, 5, 3, 8);
    let x = randn(&[b, t, h, d], 21, 1.0);
    let angles = randn(&[b * t, d / 2], 22, 3.0);
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let composed = |x: &Tensor, c: &Tensor, s: &Tensor| {
        ops::rope_composed(&x.reshape((b * t, h, d)).unwrap(), c, s)
            .unwrap()
            .reshape((b, t, h, d))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let (out_ref, g_ref) = run(std::slice::from_ref(&x), DType::F64, &|t| {
        composed(&t[0], &cos, &sin)
    });
    let device = common::test_device();
    for (dtype, tol) in kernel_cases(1e-13, 1e-5) {
        let table = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&device).unwrap();
        let (c, s) = (table(&cos), table(&sin));
        let (out, g) = run_on(&device, std::slice::from_ref(&x), dtype, &|t| {
            ops::rope_to_heads(&t[0], &c, &s).unwrap()
        });
        assert_eq!(out.dims(), [b, h, t, d]);
        assert_close("rope_to_heads forward", &out, &out_ref, dtype, tol);
        assert_close("rope_to_heads gradient", &g[0], &g_ref[0], dtype, tol);
    }
    let e = format!(
        "{:#}",
        ops::rope_to_heads(&x, &randn(&[b * t, 3], 1, 1.0), &sin).unwrap_err()
    );
    assert!(e.contains("cos has shape [10, 3], expected [10, 4]"), "{e}");
}

#[test]
fn masked_softmax_matches_the_composition() {
    // Scores [B, heads, T, Tk] with a per-batch causal + padding mask, a shared mask, and
    // none; rows longer than one CUDA block (Tk = 300).
    let (b, h, t, tk) = (2, 3, 5, 300);
    let scores = randn(&[b, h, t, tk], 60, 4.0);
    let mut m = vec![0f64; b * t * tk];
    for bi in 0..b {
        for i in 0..t {
            for j in 0..tk {
                // Row i sees keys ≤ tk − t + i; batch 1 also masks its first 7 keys.
                if j > tk - t + i || (bi == 1 && j < 7) {
                    m[(bi * t + i) * tk + j] = f64::NEG_INFINITY;
                }
            }
        }
    }
    let mask = Tensor::from_vec(m, (b, t, tk), &Device::Cpu).unwrap();
    let shared = mask.narrow(0, 0, 1).unwrap();
    let device = common::test_device();
    for (label, mk) in [
        ("per-batch mask", Some(&mask)),
        ("shared mask", Some(&shared)),
        ("no mask", None),
    ] {
        let mref = mk.cloned();
        let (out_ref, g_ref) = run(std::slice::from_ref(&scores), DType::F64, &|x| {
            ops::masked_softmax_composed(&x[0], mref.as_ref()).unwrap()
        });
        let mdev = mk.map(|m| m.to_dtype(DType::F32).unwrap().to_device(&device).unwrap());
        for (dtype, tol) in kernel_cases(1e-13, 1e-6) {
            let (out, g) = run_on(&device, std::slice::from_ref(&scores), dtype, &|x| {
                ops::masked_softmax(&x[0], mdev.as_ref()).unwrap()
            });
            assert_close(
                &format!("masked_softmax {label} forward"),
                &out,
                &out_ref,
                dtype,
                tol,
            );
            assert_close(
                &format!("masked_softmax {label} gradient"),
                &g[0],
                &g_ref[0],
                dtype,
                tol,
            );
        }
    }
    // Query heads stacked along the row axis ([B, 1, H·T, Tk], the transformer's GQA layout)
    // give the same probabilities.
    let stacked = scores.reshape((b, 1, h * t, tk)).unwrap();
    let want = ops::masked_softmax_composed(&scores, Some(&mask)).unwrap();
    let got = ops::masked_softmax(&stacked, Some(&mask)).unwrap();
    assert!(max_diff(&got.reshape((b, h, t, tk)).unwrap(), &want) <= 1e-13);
    let err = ops::masked_softmax(&scores, Some(&randn(&[3, t, tk], 1, 1.0))).unwrap_err();
    assert!(
        format!("{err:#}").contains("does not fit scores"),
        "{err:#}"
    );
}

#[test]
fn swiglu_matches_the_composition() {
    // Larger than one threading block (4096) so the split rows are covered.
    let gate = randn(&[9, 1001], 5, 6.0);
    let up = randn(&[9, 1001], 6, 2.0);
    compare(
        "swiglu",
        &[gate, up],
        &|t| ops::swiglu(&t[0], &t[1]).unwrap(),
        &|t| ops::swiglu_composed(&t[0], &t[1]).unwrap(),
        1e-12,
        1e-4,
    );
}

#[test]
fn bad_inputs_are_clear_errors() {
    let q = randn(&[10, 4, 8], 1, 1.0);
    let k = randn(&[10, 2, 8], 2, 1.0);
    let err = |r: anyhow::Result<Tensor>| format!("{:#}", r.unwrap_err());
    let e = err(ops::causal_attention_varlen(&q, &k, &k, &[0, 4, 9], 1.0));
    assert!(e.contains("end at the token count 10"), "{e}");
    let e = err(ops::causal_attention_varlen(
        &q,
        &k,
        &k,
        &[0, 6, 4, 10],
        1.0,
    ));
    assert!(e.contains("must not decrease"), "{e}");
    let k3 = randn(&[10, 3, 8], 3, 1.0);
    let e = err(ops::causal_attention_varlen(&q, &k3, &k3, &[0, 10], 1.0));
    assert!(e.contains("not a multiple"), "{e}");
    let e = err(ops::causal_attention_varlen(&q, &k, &q, &[0, 10], 1.0));
    assert!(e.contains("disagree"), "{e}");
    let e = err(ops::rms_norm(&q, &randn(&[7], 4, 1.0), 1e-6));
    assert!(e.contains("weight has shape [7], expected [8]"), "{e}");
    let e = err(ops::rope(
        &q,
        &randn(&[10, 3], 5, 1.0),
        &randn(&[10, 4], 6, 1.0),
    ));
    assert!(e.contains("cos has shape [10, 3]"), "{e}");
    let e = err(ops::swiglu(&q, &k));
    assert!(e.contains("must have one shape"), "{e}");
}

/// Logits and every parameter's gradient of the mean next-token NLL of a left-padded batch.
fn model_loss_grads(
    model: &Transformer,
    varmap: &candle_nn::VarMap,
) -> (Tensor, Vec<(String, Tensor)>) {
    let ids = Tensor::new(
        &[
            [5u32, 17, 99, 3, 250, 42, 7, 300, 11],
            [0, 0, 0, 8, 64, 9, 77, 12, 3],
        ],
        model.device(),
    )
    .unwrap();
    let logits = model
        .forward_train(&ids.narrow(1, 0, 8).unwrap(), Some(&[0, 3]))
        .unwrap();
    let lp = token_logprobs(&logits, &ids.narrow(1, 1, 8).unwrap()).unwrap();
    let grads = lp.mean_all().unwrap().neg().unwrap().backward().unwrap();
    let mut out: Vec<(String, Tensor)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), grads.get(v.as_tensor()).expect(k).clone()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    (logits, out)
}

/// On the CPU in f64 the kernels (packed varlen attention) equal the compositions to 1e-11;
/// on CUDA in f32 the CUDA kernels (masked-softmax attention over the padded batch) equal
/// the compositions on the same device to f32 rounding.
#[test]
fn training_forward_with_kernels_equals_the_composition() {
    let device = common::test_device();
    let (dtype, tol) = if device.is_cpu() {
        (DType::F64, 1e-11)
    } else {
        (DType::F32, 2e-3)
    };
    for name in common::FIXTURES {
        let (mut model, varmap) =
            Transformer::load_trainable(&common::fixture(name), &device, dtype).unwrap();
        assert!(model.training_kernels, "kernels are the default");
        let (logits_k, grads_k) = model_loss_grads(&model, &varmap);
        model.training_kernels = false;
        let (logits_c, grads_c) = model_loss_grads(&model, &varmap);
        let d = max_diff(&logits_k, &logits_c);
        assert!(d <= tol, "{name}: logits differ by {d:e}");
        assert_eq!(grads_k.len(), grads_c.len());
        for ((key, gk), (_, gc)) in grads_k.iter().zip(&grads_c) {
            let d = if device.is_cpu() {
                max_diff(gk, gc)
            } else {
                rel_err(gk, gc)
            };
            assert!(d <= tol, "{name}: gradient of {key} differs by {d:e}");
        }
    }
}

/// The training step's gradients are the same bits on every run (no atomics in any backward
/// kernel: the embedding's, RMSNorm's, attention's; f32 and bf16 on CUDA, where the
/// summation order is the kernels' own).
#[test]
fn training_gradients_are_the_same_bits_every_run() {
    let device = common::test_device();
    let dtypes: &[DType] = if device.is_cpu() {
        &[DType::F32]
    } else {
        &[DType::F32, DType::BF16]
    };
    for name in common::FIXTURES {
        for &dtype in dtypes {
            let (model, varmap) =
                Transformer::load_trainable(&common::fixture(name), &device, dtype).unwrap();
            let bits = || {
                let (_, grads) = model_loss_grads(&model, &varmap);
                grads
                    .into_iter()
                    .map(|(k, g)| (k, flat(&g)))
                    .collect::<Vec<_>>()
            };
            let first = bits();
            for ((key, a), (_, b)) in first.iter().zip(bits()) {
                assert!(
                    a == &b,
                    "{name} {dtype:?}: the gradient of {key} changed between runs"
                );
            }
        }
    }
}

/// A trainable weight: one node for `[B, T, in]` inputs, whose value and gradients (∂x, and ∂w
/// formed directly as `[out, in]`) equal candle's reshape-transpose-matmul composition.
#[test]
fn linear_with_a_trainable_weight_matches_the_composition() {
    let x = randn(&[3, 4, 12], 73, 1.0);
    let w = randn(&[5, 12], 74, 1.0);
    compare(
        "linear",
        &[x, w],
        &|t| ops::linear(&t[0], &t[1], None).unwrap(),
        &|t| {
            t[0].reshape((12, 12))
                .unwrap()
                .matmul(&t[1].t().unwrap())
                .unwrap()
                .reshape((3, 4, 5))
                .unwrap()
        },
        1e-12,
        1e-5,
    );
    let e = format!(
        "{:#}",
        ops::linear(&randn(&[2, 7], 1, 1.0), &randn(&[5, 12], 2, 1.0), None).unwrap_err()
    );
    assert!(e.contains("do not fit"), "{e}");
}

#[test]
fn linear_with_a_bias_matches_the_product_plus_the_broadcast_bias() {
    // Bias widths 5 (the element-wise path) and 16 (16-byte vectors on CUDA).
    for (n, seed) in [(5usize, 80u64), (16, 90)] {
        let x = randn(&[3, 4, 12], seed, 1.0);
        let w = randn(&[n, 12], seed + 1, 1.0);
        let b = randn(&[n], seed + 2, 1.0);
        compare(
            "linear with a bias",
            &[x, w, b],
            &|t| ops::linear(&t[0], &t[1], Some(&t[2])).unwrap(),
            &|t| {
                t[0].reshape((12, 12))
                    .unwrap()
                    .matmul(&t[1].t().unwrap())
                    .unwrap()
                    .broadcast_add(&t[2])
                    .unwrap()
                    .reshape((3, 4, n))
                    .unwrap()
            },
            1e-12,
            1e-5,
        );
    }
    // A frozen weight and bias (LoRA's base): the same values, only x gets a gradient; a
    // trainable bias on a frozen weight still gets its own.
    let device = common::test_device();
    let on = |t: Tensor| t.to_dtype(DType::F32).unwrap().to_device(&device).unwrap();
    let x = Var::from_tensor(&on(randn(&[7, 12], 95, 1.0))).unwrap();
    let w = on(randn(&[16, 12], 96, 1.0));
    let b = on(randn(&[16], 97, 1.0));
    let plain = x
        .as_tensor()
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap();
    let frozen = ops::linear(x.as_tensor(), &w, Some(&b)).unwrap();
    assert!(max_diff(&frozen, &plain) <= 1e-4);
    let g = frozen.sum_all().unwrap().backward().unwrap();
    assert!(g.get(x.as_tensor()).is_some() && g.get(&w).is_none() && g.get(&b).is_none());
    let bv = Var::from_tensor(&b).unwrap();
    let y = ops::linear(x.as_tensor(), &w, Some(bv.as_tensor())).unwrap();
    assert!(max_diff(&y, &plain) <= 1e-4);
    let g = y.sum_all().unwrap().backward().unwrap();
    let db = g
        .get(bv.as_tensor())
        .expect("the trainable bias's gradient");
    assert!(max_diff(db, &Tensor::full(7f32, 16, &device).unwrap()) <= 1e-5);
    // A bias of the wrong width is named.
    let e = format!(
        "{:#}",
        ops::linear(x.as_tensor(), &w, Some(&on(randn(&[15], 1, 1.0)))).unwrap_err()
    );
    assert!(e.contains("bias [15]"), "{e}");
}

/// A frozen weight's product gives the plain product's value and input gradient, and no
/// gradient for the weight (candle's matmul forms one); a trainable weight still gets its own.
#[test]
fn linear_with_a_frozen_weight_forms_only_the_input_gradient() {
    let device = common::test_device();
    let dtype = if device.is_cpu() {
        DType::F64
    } else {
        DType::F32
    };
    let x = Var::from_tensor(
        &randn(&[7, 12], 70, 1.0)
            .to_dtype(dtype)
            .unwrap()
            .to_device(&device)
            .unwrap(),
    )
    .unwrap();
    let w = randn(&[5, 12], 71, 1.0)
        .to_dtype(dtype)
        .unwrap()
        .to_device(&device)
        .unwrap();
    let r = randn(&[7, 5], 72, 1.0)
        .to_dtype(dtype)
        .unwrap()
        .to_device(&device)
        .unwrap();
    let frozen = ops::linear(x.as_tensor(), &w, None).unwrap();
    let wt = w.t().unwrap();
    let plain = x.as_tensor().matmul(&wt).unwrap();
    let tol = if device.is_cpu() { 1e-12 } else { 1e-4 };
    assert!(max_diff(&frozen, &plain) <= tol);
    let gf = (&frozen * &r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let gp = (&plain * &r)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(
        max_diff(
            gf.get(x.as_tensor()).unwrap(),
            gp.get(x.as_tensor()).unwrap()
        ) <= tol
    );
    assert!(gf.get(&w).is_none(), "the frozen weight got a gradient");
    assert!(
        gp.get(&wt).is_some(),
        "candle's own matmul forms the weight's gradient"
    );
    // A trainable weight takes the plain path and gets its gradient.
    let wv = Var::from_tensor(&w).unwrap();
    let y = ops::linear(x.as_tensor(), wv.as_tensor(), None).unwrap();
    let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(g.get(wv.as_tensor()).is_some());
}

#[test]
fn write_kv_slots_writes_each_row_into_its_slot_of_both_pools() {
    // A pool of 6 slots × 2 kv heads × 3 dims, keys then values; rows 0..3 go to slots 4, 1, 5.
    let (slots, hkv, d) = (6, 2, 3);
    let host = [4u32, 1, 5];
    let rows = host.len();
    let device = common::test_device();
    let dtypes: Vec<DType> = kernel_cases(0.0, 0.0).into_iter().map(|c| c.0).collect();
    for dtype in dtypes {
        let pool_init = randn(&[2, slots, hkv, d], 31, 1.0);
        let kv = randn(&[2, rows, hkv, d], 32, 1.0);
        let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&device).unwrap();
        let pool = on(&pool_init);
        let index = ops::KvSlots::new(host.to_vec(), &device).unwrap();
        ops::write_kv_slots(&pool, &on(&kv), &index).unwrap();
        // Every value as the pool's dtype holds it, in f64.
        let values = |t: &Tensor| -> Vec<f64> {
            let t = t.to_dtype(dtype).unwrap().to_dtype(DType::F64).unwrap();
            t.flatten_all().unwrap().to_vec1().unwrap()
        };
        let (got, init, src) = (values(&pool), values(&pool_init), values(&kv));
        let width = hkv * d;
        for part in 0..2 {
            for s in 0..slots {
                let at = (part * slots + s) * width;
                let want = match host.iter().position(|&h| h as usize == s) {
                    Some(r) => &src[(part * rows + r) * width..][..width],
                    None => &init[at..at + width],
                };
                assert_eq!(&got[at..at + width], want, "{dtype:?} part {part} slot {s}");
            }
        }
    }
    let pool = randn(&[2, slots, hkv, d], 31, 1.0);
    let kv = randn(&[2, rows, hkv, d], 32, 1.0);
    let index = ops::KvSlots::new(host.to_vec(), &Device::Cpu).unwrap();
    let err = |r: anyhow::Result<()>| format!("{:#}", r.unwrap_err());
    let outside = ops::KvSlots::new(vec![4, 1, 6], &Device::Cpu).unwrap();
    let e = err(ops::write_kv_slots(&pool, &kv, &outside));
    assert!(e.contains("slot 6 is outside the pool's 6"), "{e}");
    let e = err(ops::write_kv_slots(&pool, &kv.get(0).unwrap(), &index));
    assert!(
        e.contains("pool [2, 6, 2, 3] and keys/values [3, 2, 3] disagree"),
        "{e}"
    );
    let e = err(ops::write_kv_slots(
        &pool,
        &kv.to_dtype(DType::F32).unwrap(),
        &index,
    ));
    assert!(e.contains("keys/values are F32"), "{e}");
}
