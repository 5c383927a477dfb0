//! AdamW against torch.optim.AdamW's own steps (fixtures/adamw_torch.json, from
//! tools/ref_adamw_torch.py) and a hand-computed pair; lr schedule; checkpointed state; bad input.

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use composer_train::optim::{clip_grads, grad_norm, lr_at, AdamW, AdamWParams};

#[test]
fn adamw_matches_hand_computed_torch_steps() {
    // torch.optim.AdamW(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), p=1, g=0.5:
    // step 1: p = 1·(1 − 0.1·0.01) = 0.999; m = 0.05, v = 0.00025; m̂ = 0.5, v̂ = 0.25;
    //         p = 0.999 − 0.1·0.5/(0.5 + 1e-8) = 0.899 (to 1e-8).
    // step 2: p = 0.899·0.999 = 0.898101; m = 0.095, v = 0.00049975; m̂ = 0.5, v̂ = 0.25;
    //         p = 0.898101 − 0.1 = 0.798101.
    let var = Var::from_tensor(&Tensor::new(&[1.0f32], &Device::Cpu).unwrap()).unwrap();
    let mut opt = AdamW::new(
        vec![("p".into(), var.clone())],
        AdamWParams {
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
        },
    )
    .unwrap();
    let g = HashMap::from([(
        "p".to_string(),
        Tensor::new(&[0.5f32], &Device::Cpu).unwrap(),
    )]);
    opt.step(&g, 0.1).unwrap();
    let p: Vec<f32> = var.as_tensor().to_vec1().unwrap();
    assert!((p[0] - 0.899).abs() < 1e-6, "{p:?}");
    opt.step(&g, 0.1).unwrap();
    let p: Vec<f32> = var.as_tensor().to_vec1().unwrap();
    assert!((p[0] - 0.798101).abs() < 1e-6, "{p:?}");
    // State round-trips.
    let st = opt.state_tensors().unwrap();
    let mut fresh = AdamW::new(vec![("p".into(), var.clone())], opt.params).unwrap();
    fresh.load_state(&st, opt.step).unwrap();
    assert_eq!(fresh.step, 2);
    let m: Vec<f32> = fresh.moments["p"].get(0).unwrap().to_vec1().unwrap();
    assert!((m[0] - 0.095).abs() < 1e-7);
}

#[test]
fn adamw_refuses_params_that_write_nan_weights() {
    let var = Var::from_tensor(&Tensor::new(&[1.0f32], &Device::Cpu).unwrap()).unwrap();
    for (eps, betas, wd, what) in [
        (0.0, [0.9, 0.999], 0.0, "eps"),
        (f64::NAN, [0.9, 0.999], 0.0, "eps"),
        (1e-8, [1.0, 0.999], 0.0, "betas"),
        (1e-8, [0.9, 0.999], -1.0, "weight_decay"),
    ] {
        let params = AdamWParams {
            betas,
            eps,
            weight_decay: wd,
        };
        let e = match AdamW::new(vec![("p".into(), var.clone())], params) {
            Ok(_) => panic!("{params:?} accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(what), "{e}");
    }
}

#[test]
fn clipping_and_schedule() {
    let mut g = HashMap::from([
        (
            "a".to_string(),
            Tensor::new(&[3.0f32], &Device::Cpu).unwrap(),
        ),
        (
            "b".to_string(),
            Tensor::new(&[4.0f32], &Device::Cpu).unwrap(),
        ),
    ]);
    let n = grad_norm(&["a".into(), "b".into()], &g).unwrap();
    assert!((n - 5.0).abs() < 1e-6);
    clip_grads(&mut g, n, 1.0).unwrap();
    let a: Vec<f32> = g["a"].to_vec1().unwrap();
    assert!((a[0] - 0.6).abs() < 1e-5);
    // 0 = off; negative or NaN is an error, not a silent skip.
    clip_grads(&mut g, 100.0, 0.0).unwrap();
    assert_eq!(g["a"].to_vec1::<f32>().unwrap(), a);
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let e = clip_grads(&mut g, 100.0, bad).unwrap_err().to_string();
        assert!(e.contains("max_grad_norm"), "{e}");
    }
    assert_eq!(lr_at(1.0, 0, 4, 100, false), 0.25);
    assert_eq!(lr_at(1.0, 50, 4, 100, false), 1.0);
    assert!((lr_at(1.0, 4, 4, 104, true) - 1.0).abs() < 1e-12);
    assert!(lr_at(1.0, 104, 4, 104, true).abs() < 1e-12);
}

#[test]
fn char_tokenizer_round_trips_through_tokenizer_json() {
    let tok = composer_train::tokenizer::build_char_tokenizer(["12+34=", "46"]).unwrap();
    let ids = composer_train::tokenizer::encode(&tok, "12+34=<|endoftext|>").unwrap();
    assert_eq!(ids.len(), 7);
    assert_eq!(ids[6], 0);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tokenizer.json");
    tok.save(&p, false).unwrap();
    let back = tokenizers::Tokenizer::from_file(&p).unwrap();
    assert_eq!(
        composer_train::tokenizer::encode(&back, "12+34=").unwrap(),
        ids[..6].to_vec()
    );
    assert_eq!(composer_train::tokenizer::decode(&back, &ids), "12+34=");
}

/// The fixture's values of `key` as f32 (torch's float32 values, written as doubles).
fn f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn adamw_matches_torch_adamw_step_by_step() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/adamw_torch.json"
    );
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let dev = Device::Cpu;
    for (ci, case) in fixture["cases"].as_array().unwrap().iter().enumerate() {
        let betas = f32s(&case["betas"]);
        let params = AdamWParams {
            betas: [
                case["betas"][0].as_f64().unwrap(),
                case["betas"][1].as_f64().unwrap(),
            ],
            eps: case["eps"].as_f64().unwrap(),
            weight_decay: case["weight_decay"].as_f64().unwrap(),
        };
        assert_eq!(betas.len(), 2);
        let shape = |k: &str| -> Vec<usize> {
            case["shapes"][k]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect()
        };
        let names = ["a", "b"];
        let vars: Vec<(String, Var)> = names
            .iter()
            .map(|&k| {
                let t = Tensor::from_vec(f32s(&case["init"][k]), shape(k), &dev).unwrap();
                (k.to_string(), Var::from_tensor(&t).unwrap())
            })
            .collect();
        let mut opt = AdamW::new(vars.clone(), params).unwrap();
        for (step, lr) in case["lrs"].as_array().unwrap().iter().enumerate() {
            let grads: HashMap<String, Tensor> = names
                .iter()
                .map(|&k| {
                    let g = f32s(&case["grads"][step][k]);
                    (k.to_string(), Tensor::from_vec(g, shape(k), &dev).unwrap())
                })
                .collect();
            opt.step(&grads, lr.as_f64().unwrap()).unwrap();
            for (k, var) in &vars {
                let ours: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                let theirs = f32s(&case["steps"][step][k.as_str()]);
                for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                    assert!(
                        (a - b).abs() <= 2.0 * f32::EPSILON * b.abs().max(1e-3),
                        "case {ci} step {step} {k}[{i}]: ours {a} vs torch {b}"
                    );
                }
            }
        }
        for (k, _) in &vars {
            let moments = &opt.moments[k.as_str()];
            for (half, key) in ["m", "v"].iter().enumerate() {
                let ours: Vec<f32> = moments
                    .get(half)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let theirs = f32s(&case["state"][k.as_str()][*key]);
                // torch's vectorised lerp may fuse a multiply-add: a few ulps apart.
                for (a, b) in ours.iter().zip(&theirs) {
                    assert!(
                        (a - b).abs() <= 8.0 * f32::EPSILON * b.abs(),
                        "case {ci} {key}.{k}: ours {a} vs torch {b}"
                    );
                }
            }
        }
    }
}
