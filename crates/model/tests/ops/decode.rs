//! The decode step's fused ops: q/k/v bias and RoPE, the packed SwiGLU, the skinny product
//! with its epilogues, q/k/v straight into the paged cache, the KV slot writes.

use crate::common;
use crate::common::kernel_checks::{assert_close, cpu_f64, kernel_cases, randn};
use candle_core::{DType, Device, Tensor};
use composer_model::ops;

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
