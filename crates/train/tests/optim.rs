//! AdamW against hand-computed torch.optim.AdamW steps; lr schedule; checkpointed state.

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
    let st = opt.state_tensors();
    let mut fresh = AdamW::new(vec![("p".into(), var.clone())], opt.params).unwrap();
    fresh.load_state(&st, opt.step).unwrap();
    assert_eq!(fresh.step, 2);
    let m: Vec<f32> = fresh.m["p"].to_vec1().unwrap();
    assert!((m[0] - 0.095).abs() < 1e-7);
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
