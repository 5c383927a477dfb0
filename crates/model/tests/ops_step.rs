//! The training step's kernels beyond the decoder. The LM head's fused softmax kernels
//! (`ops::head_row_stats`, `ops::head_logits_grad`: the CPU kernels, and with
//! `COMPOSER_TEST_DEVICE=cuda` the CUDA kernels in f32 and bf16) against their candle
//! compositions in f64 on the CPU: rows wider than a CUDA block, temperatures ≠ 1, repeated ids
//! in a row (their weights add), no ids at all, a dominant logit (the max shift), half-precision
//! logits on the CPU; and bad input named in the error. The optimizer's in-place AdamW update
//! (`ops::adamw_update`, on the test device) against the same update in f64 on the CPU, over
//! several steps and both of torch's lerp branches; its bad input. (Parity with torch's own
//! AdamW: `crates/train/tests/optim.rs`.)

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

/// AdamW in f64 from the formulas, for `steps` updates of `p` by `grads[t]` at `lrs[t]`:
/// (p, m, v) after the last.
fn adamw_f64(
    p: &[f64],
    grads: &[Vec<f64>],
    lrs: &[f64],
    [b1, b2]: [f64; 2],
    eps: f64,
    wd: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut p, mut m, mut v) = (p.to_vec(), vec![0.0; p.len()], vec![0.0; p.len()]);
    for (t, (g, lr)) in grads.iter().zip(lrs).enumerate() {
        let t = t as i32 + 1;
        for i in 0..p.len() {
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            p[i] *= 1.0 - lr * wd;
            let denom = (v[i] / (1.0 - b2.powi(t))).sqrt() + eps;
            p[i] -= lr * (m[i] / (1.0 - b1.powi(t))) / denom;
        }
    }
    (p, m, v)
}

#[test]
fn adamw_update_matches_the_formulas_over_several_steps() {
    let device = test_device();
    // 1,000 elements (more than one CUDA block), gradients over five decades; β1 = 0.9 and 0.3
    // (torch's lerp branches for weights below and above ½).
    let n = 1000;
    let vals = |seed: u64, scale: f64| -> Vec<f64> {
        let t = randn(&[n], seed, 1.0).to_dtype(DType::F32).unwrap();
        let t: Vec<f32> = t.to_vec1().unwrap();
        t.iter()
            .enumerate()
            .map(|(i, &x)| x as f64 * scale * 10f64.powi(i as i32 % 5 - 3))
            .collect()
    };
    let dtypes: Vec<DType> = if device.is_cpu() {
        vec![DType::F32, DType::F64]
    } else {
        vec![DType::F32]
    };
    for betas in [[0.9, 0.999], [0.3, 0.95]] {
        for &dtype in &dtypes {
            let p0 = vals(1, 1.0);
            let grads: Vec<Vec<f64>> = (0..4).map(|t| vals(10 + t, 1.0)).collect();
            let lrs = [1e-3, 1e-2, 3e-2, 1e-4];
            let (eps, wd) = (1e-6, 0.05);
            let on = |x: &[f64], shape: &[usize]| {
                Tensor::from_vec(x.to_vec(), shape, &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .to_device(&device)
                    .unwrap()
            };
            // The values as the dtype holds them, so both sides start from the same numbers.
            let held = |x: &[f64]| -> Vec<f64> {
                on(x, &[x.len()])
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            let p0 = held(&p0);
            let grads: Vec<Vec<f64>> = grads.iter().map(|g| held(g)).collect();
            let param = on(&p0, &[20, 50]);
            let moments = Tensor::zeros((2, 20, 50), dtype, &device).unwrap();
            for (t, (g, &lr)) in grads.iter().zip(&lrs).enumerate() {
                let h = ops::AdamWStep {
                    lr,
                    betas,
                    eps,
                    weight_decay: wd,
                    step: t as u64 + 1,
                };
                ops::adamw_update(&param, &moments, &on(g, &[20, 50]), &h).unwrap();
            }
            let (p, m, v) = adamw_f64(&p0, &grads, &lrs, betas, eps, wd);
            let got = |t: &Tensor| -> Vec<f64> {
                t.to_dtype(DType::F64)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            for (what, ours, want) in [
                ("parameter", got(&param), p),
                ("m", got(&moments.get(0).unwrap()), m),
                ("v", got(&moments.get(1).unwrap()), v),
            ] {
                // Relative, with a floor at 1% of the largest value: an element near zero
                // carries the rounding of the larger values it was updated from.
                let floor = 1e-2 * want.iter().fold(0f64, |m, x| m.max(x.abs()));
                for (i, (a, b)) in ours.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= tol * b.abs().max(floor),
                        "{dtype:?} β {betas:?} {what}[{i}]: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn adamw_update_bad_inputs_are_errors_naming_the_tensor() {
    let p = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap();
    let mv = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
    let g = Tensor::ones((3, 4), DType::F32, &Device::Cpu).unwrap();
    let h = ops::AdamWStep {
        lr: 1e-3,
        betas: [0.9, 0.999],
        eps: 1e-8,
        weight_decay: 0.0,
        step: 1,
    };
    let err = |r: anyhow::Result<()>| format!("{:#}", r.unwrap_err());
    let e = err(ops::adamw_update(&p, &mv.get(0).unwrap(), &g, &h));
    assert!(e.contains("moments [3, 4] (expected [2, 3, 4])"), "{e}");
    let e = err(ops::adamw_update(&p, &mv, &g.t().unwrap(), &h));
    assert!(e.contains("gradient [4, 3]"), "{e}");
    let e = err(ops::adamw_update(
        &p,
        &mv,
        &g.to_dtype(DType::F64).unwrap(),
        &h,
    ));
    assert!(e.contains("gradient F64"), "{e}");
    let bf = p.to_dtype(DType::BF16).unwrap();
    let e = err(ops::adamw_update(
        &bf,
        &mv.to_dtype(DType::BF16).unwrap(),
        &g.to_dtype(DType::BF16).unwrap(),
        &h,
    ));
    assert!(e.contains("parameter BF16"), "{e}");
    let e = err(ops::adamw_update(
        &p.t().unwrap(),
        &Tensor::zeros((2, 4, 3), DType::F32, &Device::Cpu).unwrap(),
        &g.t().unwrap(),
        &h,
    ));
    assert!(e.contains("must be contiguous"), "{e}");
    let e = err(ops::adamw_update(
        &p,
        &mv,
        &g,
        &ops::AdamWStep { step: 0, ..h },
    ));
    assert!(e.contains("step 0"), "{e}");
    // Nothing was written by the refused calls.
    assert_eq!(p.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    assert_eq!(mv.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
}
