//! RoPE, the masked softmax and SwiGLU against their compositions, and bad inputs.

use crate::common;
use crate::common::kernel_checks::{
    assert_close, compare, kernel_cases, max_diff, randn, run, run_on,
};
use candle_core::{DType, Device, Tensor};
use composer_model::ops;

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
