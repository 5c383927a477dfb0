//! The training ops of `composer_model::ops` (custom CPU kernels with a backward) against
//! their differentiable candle compositions: forward values and gradients in f64 with tight
//! tolerances, the f32 kernels against the f64 composition, and bad inputs.
//!
//! The model's training forward with the kernels equals it with the compositions (f64,
//! left-padded batch, every parameter's gradient).
//!
//! Gradients are those of the scalar `Σ out·R` for a fixed random `R`, so every output element
//! feeds the check with its own weight.

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

/// Output and the gradients of `Σ out·R` w.r.t. each input, for `f` applied to fresh
/// variables holding `inputs` (cast to `dtype`).
fn run(inputs: &[Tensor], dtype: DType, f: &dyn Fn(&[Tensor]) -> Tensor) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts);
    let r = randn(out.dims(), 999, 1.0).to_dtype(dtype).unwrap();
    let grads = (&out * r).unwrap().sum_all().unwrap().backward().unwrap();
    let g = vars
        .iter()
        .map(|v| {
            grads
                .get(v.as_tensor())
                .expect("an input without gradient")
                .clone()
        })
        .collect();
    (out, g)
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
    for (dtype, tol) in [(DType::F64, tol), (DType::F32, tol32)] {
        let (out, grads) = run(inputs, dtype, kernel);
        assert_eq!(out.dtype(), dtype, "{name}: output dtype");
        let d = max_diff(&out, &out_ref);
        assert!(d <= tol, "{name} {dtype:?}: forward differs by {d:e}");
        for (i, (g, gr)) in grads.iter().zip(&grads_ref).enumerate() {
            let d = max_diff(g, gr);
            assert!(
                d <= tol,
                "{name} {dtype:?}: gradient of input {i} differs by {d:e}"
            );
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
    for dtype in [DType::F64, DType::F32] {
        let (c, s) = (cos.to_dtype(dtype).unwrap(), sin.to_dtype(dtype).unwrap());
        let (c64, s64) = (cos.clone(), sin.clone());
        let (out_ref, g_ref) = run(std::slice::from_ref(&x), DType::F64, &|t| {
            ops::rope_composed(&t[0], &c64, &s64).unwrap()
        });
        let (out, g) = run(std::slice::from_ref(&x), dtype, &|t| {
            ops::rope(&t[0], &c, &s).unwrap()
        });
        let tol = if dtype == DType::F64 { 1e-13 } else { 1e-5 };
        assert!(max_diff(&out, &out_ref) <= tol, "rope {dtype:?} forward");
        assert!(max_diff(&g[0], &g_ref[0]) <= tol, "rope {dtype:?} gradient");
    }
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
        &Device::Cpu,
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

#[test]
fn training_forward_with_kernels_equals_the_composition() {
    for name in common::FIXTURES {
        let (mut model, varmap) =
            Transformer::load_trainable(&common::fixture(name), &Device::Cpu, DType::F64).unwrap();
        assert!(model.training_kernels, "kernels are the default");
        let (logits_k, grads_k) = model_loss_grads(&model, &varmap);
        model.training_kernels = false;
        let (logits_c, grads_c) = model_loss_grads(&model, &varmap);
        let d = max_diff(&logits_k, &logits_c);
        assert!(d <= 1e-11, "{name}: logits differ by {d:e}");
        assert_eq!(grads_k.len(), grads_c.len());
        for ((key, gk), (_, gc)) in grads_k.iter().zip(&grads_c) {
            let d = max_diff(gk, gc);
            assert!(d <= 1e-11, "{name}: gradient of {key} differs by {d:e}");
        }
    }
}
