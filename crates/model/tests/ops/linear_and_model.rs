//! The linear op (trainable, with a bias, frozen) and the model's training forward and
//! gradients with the kernels against the compositions.

use crate::common;
use crate::common::kernel_checks::{compare, flat, max_diff, randn, rel_err};
use candle_core::{DType, Tensor, Var};
use composer_model::{ops, token_logprobs, Transformer};

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
