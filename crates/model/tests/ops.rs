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
//! CUDA kernels against their CPU twins' reference (varlen attention included: head_dim 64
//! and 128, GQA ratios 1 and 2, length-1 segments, a 16,384-token row, and the model's
//! packed forward).

mod common;

use candle_core::{DType, Device, Tensor, Var};
use composer_model::{ops, token_logprobs, Transformer};
use rand::{Rng, SeedableRng};

fn randn(shape: &[usize], seed: u64, scale: f64) -> Tensor {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let data: Vec<f64> = (0..n)
        .map(|_| (rng.random::<f64>() * 2.0 - 1.0) * scale)
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    flat(a)
        .iter()
        .zip(flat(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// ‖a − b‖ / ‖b‖ over all elements.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (flat(a), flat(b));
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// bf16 results are compared by relative norm (bf16 keeps 8 bits of mantissa; the inputs
/// themselves are rounded), everything else by the largest absolute difference.
const BF16_REL_TOL: f64 = 2e-2;

fn assert_close(what: &str, got: &Tensor, want: &Tensor, dtype: DType, tol: f64) {
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
fn kernel_cases(tol: f64, tol32: f64) -> Vec<(DType, f64)> {
    if common::test_device().is_cpu() {
        vec![(DType::F64, tol), (DType::F32, tol32)]
    } else {
        vec![(DType::F32, tol32.max(1e-4)), (DType::BF16, BF16_REL_TOL)]
    }
}

/// Output and the gradients of `Σ out·R` w.r.t. each input, for `f` applied to fresh
/// variables holding `inputs` (cast to `dtype`) on the CPU.
fn run(inputs: &[Tensor], dtype: DType, f: &dyn Fn(&[Tensor]) -> Tensor) -> (Tensor, Vec<Tensor>) {
    run_on(&Device::Cpu, inputs, dtype, f)
}

/// [`run`] on `device`; output and gradients come back on the CPU.
fn run_on(
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
fn compare(
    name: &str,
    inputs: &[Tensor],
    kernel: &dyn Fn(&[Tensor]) -> Tensor,
    composed: &dyn Fn(&[Tensor]) -> Tensor,
    tol: f64,
    tol32: f64,
) {
    let (out_ref, grads_ref) = run(inputs, DType::F64, composed);
    let device = common::test_device();
    for (dtype, tol) in kernel_cases(tol, tol32) {
        let (out, grads) = run_on(&device, inputs, dtype, kernel);
        assert_eq!(out.dtype(), dtype, "{name}: output dtype");
        assert_close(&format!("{name} forward"), &out, &out_ref, dtype, tol);
        for (i, (g, gr)) in grads.iter().zip(&grads_ref).enumerate() {
            assert_close(&format!("{name} gradient of input {i}"), g, gr, dtype, tol);
        }
    }
}

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

/// A frozen weight's product gives the plain product's value and input gradient, and no
/// gradient for the weight (candle's matmul forms one); a trainable weight still gets its own.
#[test]
fn frozen_linear_forms_only_the_input_gradient() {
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
    let frozen = ops::frozen_linear(x.as_tensor(), &w).unwrap();
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
    let y = ops::frozen_linear(x.as_tensor(), wv.as_tensor()).unwrap();
    let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(g.get(wv.as_tensor()).is_some());
}
