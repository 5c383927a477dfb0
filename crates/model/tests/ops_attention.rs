//! Causal variable-length GQA attention (`ops::causal_attention_varlen`: the CPU kernel, and
//! with `COMPOSER_TEST_DEVICE=cuda` the CUDA kernels in f32 and bf16) against the f64
//! composition on the CPU: segments across tile edges and of one token, GQA ratios 1-4,
//! head_dim 7-128 (Qwen's 64 and 128), forward and the gradients of `Σ out·R`; one long row
//! (16,384 tokens on CUDA); segment isolation; and the model's padding-free forward with the
//! kernels against it with the compositions.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::kernel_checks::{compare, flat, max_diff, randn, rel_err, BF16_REL_TOL};
use composer_model::{ops, Transformer};

/// [`compare`] of the kernel and the composition on random `q`, `k`, `v` packed by `cu`.
fn check_attention(cu: &[usize], hq: usize, hkv: usize, d: usize, seed: u64) {
    let n = *cu.last().unwrap();
    let q = randn(&[n, hq, d], seed, 1.5);
    let k = randn(&[n, hkv, d], seed + 1, 1.5);
    let v = randn(&[n, hkv, d], seed + 2, 1.0);
    let scale = 1.0 / (d as f64).sqrt();
    let cu_k = cu.to_vec();
    let cu_c = cu.to_vec();
    compare(
        &format!("attention cu={cu:?} hq={hq} hkv={hkv}"),
        &[q, k, v],
        &|t| ops::causal_attention_varlen(&t[0], &t[1], &t[2], &cu_k, scale).unwrap(),
        &|t| ops::causal_attention_varlen_composed(&t[0], &t[1], &t[2], &cu_c, scale).unwrap(),
        1e-11,
        1e-4,
    );
}

#[test]
fn attention_one_sequence_longer_than_a_tile() {
    // 150 = two full 64-row tiles and a partial one; GQA ratio 2.
    check_attention(&[0, 150], 4, 2, 16, 10);
}

#[test]
fn attention_varlen_segments_with_gqa_ratios() {
    // Several segments (one empty, singletons, odd lengths across tile edges).
    let cu = [0, 5, 5, 6, 75, 76, 207];
    check_attention(&cu, 6, 2, 8, 20); // ratio 3
    check_attention(&cu, 4, 1, 12, 30); // ratio 4 (multi-query)
    check_attention(&cu, 3, 3, 7, 40); // ratio 1, odd head_dim
}

#[test]
fn attention_at_qwen_head_dims_with_single_token_segments() {
    // Qwen's head_dim 64 and 128 (the CUDA kernels' tile classes), GQA ratios 2 and 1,
    // segments of one token between longer ones that cross tile edges.
    let cu = [0, 1, 2, 40, 41, 97, 98, 160];
    check_attention(&cu, 4, 2, 64, 60);
    check_attention(&cu, 2, 2, 64, 70);
    check_attention(&cu, 4, 2, 128, 80);
    check_attention(&cu, 2, 2, 128, 90);
    // Only single-token segments: each output is its value row, every ∂q and ∂k is zero.
    check_attention(&[0, 1, 2, 3, 4, 5], 2, 1, 128, 100);
}

/// `out` rows `rows` of one causal segment `[0, n)` computed naively in f64 on the CPU.
fn naive_attention_rows(q: &Tensor, k: &Tensor, v: &Tensor, rows: &[usize], scale: f64) -> Tensor {
    let (_, hq, d) = q.dims3().unwrap();
    let hkv = k.dim(1).unwrap();
    let (q, k, v) = (flat(q), flat(k), flat(v));
    let mut out = Vec::new();
    for &i in rows {
        for h in 0..hq {
            let g = h / (hq / hkv);
            let qi = &q[(i * hq + h) * d..(i * hq + h + 1) * d];
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    let kj = &k[(j * hkv + g) * d..(j * hkv + g + 1) * d];
                    qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = p.iter().sum();
            for c in 0..d {
                out.push(
                    (0..=i)
                        .map(|j| p[j] * v[(j * hkv + g) * d + c])
                        .sum::<f64>()
                        / z,
                );
            }
        }
    }
    Tensor::from_vec(out, (rows.len(), hq, d), &Device::Cpu).unwrap()
}

/// One long causal row (16,384 tokens, Qwen3-0.6B's 16 query / 8 key-value heads of 128, in
/// bf16, on CUDA; 2,048 tokens in f32 on the CPU): the composition would hold
/// `[heads, T, T]` scores (4.3·10⁹ elements on CUDA, which fails), the kernel none. Checked:
/// output rows against a naive f64 attention, and two identities of the backward over the
/// whole row — per key/value head and column, `Σⱼ ∂vⱼ = Σᵢ ∂oᵢ` over the group's query heads
/// (each softmax row sums to 1) and `Σⱼ ∂kⱼ = 0` (each `∂S` row sums to 0).
#[test]
fn attention_over_one_long_row() {
    let device = common::test_device();
    let (n, hq, hkv, d, dtype) = if device.is_cpu() {
        (2048, 4, 2, 64, DType::F32)
    } else {
        (16_384, 16, 8, 128, DType::BF16)
    };
    let scale = 1.0 / (d as f64).sqrt();
    let q = randn(&[n, hq, d], 110, 1.5).to_dtype(dtype).unwrap();
    let k = randn(&[n, hkv, d], 111, 1.5).to_dtype(dtype).unwrap();
    let v = randn(&[n, hkv, d], 112, 1.0).to_dtype(dtype).unwrap();
    let dout = randn(&[n, hq, d], 113, 1.0).to_dtype(dtype).unwrap();
    let vars: Vec<Var> = [&q, &k, &v]
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(&device).unwrap()).unwrap())
        .collect();
    let out = ops::causal_attention_varlen(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
        &[0, n],
        scale,
    )
    .unwrap();
    let grads = (&out * dout.to_device(&device).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grad = |i: usize| {
        grads
            .get(vars[i].as_tensor())
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
    };
    let (dk, dv) = (grad(1), grad(2));
    let rows = [0, 1, 63, 64, 1000, n / 2 + 17, n - 1];
    let idx = Tensor::new(&rows.map(|r| r as u32), &Device::Cpu).unwrap();
    let got = out
        .to_device(&Device::Cpu)
        .unwrap()
        .index_select(&idx, 0)
        .unwrap();
    let want = naive_attention_rows(&q, &k, &v, &rows, scale);
    let e = rel_err(&got, &want);
    let tol = if dtype == DType::BF16 {
        BF16_REL_TOL
    } else {
        1e-5
    };
    assert!(e <= tol, "long-row output rows: relative error {e:e}");
    // Σⱼ ∂vⱼ against Σᵢ ∂oᵢ summed over each group's query heads.
    let sum_dv = dv.sum(0).unwrap();
    let sum_do = dout
        .to_dtype(DType::F64)
        .unwrap()
        .sum(0)
        .unwrap()
        .reshape((hkv, hq / hkv, d))
        .unwrap()
        .sum(1)
        .unwrap();
    let e = rel_err(&sum_dv, &sum_do);
    assert!(e <= tol, "Σ ∂v vs Σ ∂o: relative error {e:e}");
    // Σⱼ ∂kⱼ = 0, against the size of the column it sums.
    let sum_dk = flat(&dk.sum(0).unwrap());
    let norm_dk = flat(&dk.sqr().unwrap().sum(0).unwrap().sqrt().unwrap());
    for (s, m) in sum_dk.iter().zip(&norm_dk) {
        assert!(
            *m > 0.0 && s.abs() <= 5.0 * tol * m,
            "Σ ∂k = {s:e} (column norm {m:e})"
        );
    }
    let dq = flat(&grad(0));
    assert!(dq.iter().all(|x| x.is_finite()), "∂q is not finite");
}

#[test]
fn attention_does_not_cross_segment_boundaries() {
    let (hq, hkv, d) = (4, 2, 8);
    let cu = [0, 9, 30];
    let q = randn(&[30, hq, d], 50, 1.0);
    let k = randn(&[30, hkv, d], 51, 1.0);
    let v = randn(&[30, hkv, d], 52, 1.0);
    let out = ops::causal_attention_varlen(&q, &k, &v, &cu, 0.3).unwrap();
    // Changing the second segment's keys and values leaves the first segment's output as is;
    // the second's changes.
    let k2 = Tensor::cat(
        &[&k.narrow(0, 0, 9).unwrap(), &randn(&[21, hkv, d], 53, 1.0)],
        0,
    )
    .unwrap();
    let v2 = Tensor::cat(
        &[&v.narrow(0, 0, 9).unwrap(), &randn(&[21, hkv, d], 54, 1.0)],
        0,
    )
    .unwrap();
    let out2 = ops::causal_attention_varlen(&q, &k2, &v2, &cu, 0.3).unwrap();
    assert_eq!(
        flat(&out.narrow(0, 0, 9).unwrap()),
        flat(&out2.narrow(0, 0, 9).unwrap())
    );
    assert!(
        max_diff(
            &out.narrow(0, 9, 21).unwrap(),
            &out2.narrow(0, 9, 21).unwrap()
        ) > 1e-3
    );
    // The first token of a segment attends to itself only: its output is its value row
    // (per query head, the value of its key/value head).
    let first = flat(&out.narrow(0, 9, 1).unwrap());
    let v_first = flat(&v.narrow(0, 9, 1).unwrap());
    for h in 0..hq {
        let g = h / (hq / hkv);
        for i in 0..d {
            assert!((first[h * d + i] - v_first[g * d + i]).abs() < 1e-12);
        }
    }
}

/// The padding-free forward (sequences packed into one row, one of them a single token) with
/// the kernels equals it with the compositions, hidden states and every parameter's gradient
/// of `Σ hidden·R`: f64 on the CPU, f32 on CUDA (the varlen attention kernel in the model).
#[test]
fn packed_training_forward_with_kernels_equals_the_composition() {
    let device = common::test_device();
    let (dtype, tol) = if device.is_cpu() {
        (DType::F64, 1e-11)
    } else {
        (DType::F32, 2e-3)
    };
    let seqs: [&[u32]; 4] = [
        &[5, 17, 99, 3, 250, 42, 7, 300, 11],
        &[8],
        &[64, 9, 77, 12, 3],
        &[
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
        ],
    ];
    let batch = composer_model::PackedBatch::from_sequences(&seqs);
    for name in common::FIXTURES {
        let (mut model, varmap) =
            Transformer::load_trainable(&common::fixture(name), &device, dtype).unwrap();
        let run = |model: &Transformer| {
            let hidden = model.forward_hidden_packed(&batch).unwrap();
            let r = randn(hidden.dims(), 120, 1.0)
                .to_dtype(dtype)
                .unwrap()
                .to_device(&device)
                .unwrap();
            let grads = (&hidden * r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let mut g: Vec<(String, Tensor)> = varmap
                .data()
                .lock()
                .unwrap()
                .iter()
                .filter_map(|(k, v)| grads.get(v.as_tensor()).map(|g| (k.clone(), g.clone())))
                .collect();
            g.sort_by(|a, b| a.0.cmp(&b.0));
            (hidden, g)
        };
        model.training_kernels = true;
        let (hidden_k, grads_k) = run(&model);
        model.training_kernels = false;
        let (hidden_c, grads_c) = run(&model);
        let d = max_diff(&hidden_k, &hidden_c);
        assert!(d <= tol, "{name}: packed hidden states differ by {d:e}");
        let keys = |g: &[(String, Tensor)]| g.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
        assert_eq!(
            keys(&grads_k),
            keys(&grads_c),
            "{name}: parameters with a gradient"
        );
        assert!(
            grads_k.len() > 10,
            "{name}: only {} gradients",
            grads_k.len()
        );
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
