//! f64 finite-difference checks of the training forward's gradients.
//!
//! Each fixture is loaded as f64 trainable variables; the scalar loss is the mean negative
//! next-token log-prob of a fixed sequence through [`Transformer::forward_train`] and
//! [`token_logprobs`] (the path the trainer differentiates). For a few scalar entries of a
//! few parameters, candle's backward gradient is compared with the central difference
//! `(L(w + ε) − L(w − ε)) / 2ε`, ε = 1e-6. Reference: the central difference itself, no
//! external values; in f64 its truncation error is O(ε²) and its rounding error about
//! 1e-16·|L|/ε ≈ 1e-9, so agreement to ~1e-6 relative shows the backward is the derivative
//! of the forward (a fused op without backward would give 0, a wrong one a mismatch).

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use common::fixture;
use composer_model::{token_logprobs, Transformer};

const SEQ: [u32; 8] = [5, 17, 99, 3, 250, 42, 7, 300];
const EPS: f64 = 1e-6;

/// Mean negative log-likelihood of `SEQ[1..]` given its prefixes, in f64.
fn loss(model: &Transformer) -> Tensor {
    let ids = Tensor::new(&[SEQ], model.device()).unwrap();
    let logits = model
        .forward_train(&ids.narrow(1, 0, SEQ.len() - 1).unwrap(), None)
        .unwrap();
    assert_eq!(logits.dtype(), DType::F64, "an f64 model gives f64 logits");
    let targets = ids.narrow(1, 1, SEQ.len() - 1).unwrap();
    let lp = token_logprobs(&logits, &targets).unwrap();
    assert_eq!(lp.dtype(), DType::F64, "log-probs of f64 logits stay f64");
    lp.mean_all().unwrap().neg().unwrap()
}

fn scalar(t: &Tensor) -> f64 {
    t.to_scalar::<f64>().unwrap()
}

/// Sets flat entry `idx` of `var` to `value` (in place: the model shares the storage).
fn set_entry(var: &Var, idx: usize, value: f64) {
    let mut data: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    data[idx] = value;
    let t = Tensor::from_vec(data, var.shape(), var.device()).unwrap();
    var.set(&t).unwrap();
}

fn var(varmap: &VarMap, name: &str) -> Var {
    varmap
        .data()
        .lock()
        .unwrap()
        .get(name)
        .unwrap_or_else(|| panic!("no variable {name}"))
        .clone()
}

/// Compares backward and central-difference gradients at `(name, flat index)` entries.
fn check(fixture_name: &str, entries: &[(&str, usize)]) {
    let (model, varmap) =
        Transformer::load_trainable(&fixture(fixture_name), &Device::Cpu, DType::F64).unwrap();
    assert_eq!(model.dtype(), DType::F64);
    let grads = loss(&model).backward().unwrap();
    for &(name, idx) in entries {
        let v = var(&varmap, name);
        let analytic: Vec<f64> = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("{fixture_name}: no gradient for {name}"))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let analytic = analytic[idx];
        let w: f64 = v
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()[idx];
        set_entry(&v, idx, w + EPS);
        let plus = scalar(&loss(&model));
        set_entry(&v, idx, w - EPS);
        let minus = scalar(&loss(&model));
        set_entry(&v, idx, w);
        let numeric = (plus - minus) / (2.0 * EPS);
        let scale = analytic.abs().max(numeric.abs());
        assert!(
            scale > 1e-7,
            "{fixture_name} {name}[{idx}]: gradient {analytic} too small to check"
        );
        let rel = (analytic - numeric).abs() / scale;
        assert!(
            rel <= 1e-6,
            "{fixture_name} {name}[{idx}]: backward {analytic:e} vs central difference {numeric:e} (rel {rel:e})"
        );
    }
}

/// hidden_size of the fixtures (64): a row-major `[rows, 64]` entry is `row * 64 + col`.
const H: usize = 64;

#[test]
fn llama_gradients_match_central_differences() {
    check(
        "llama-tiny",
        &[
            // Embedding row of a token in the input (token 99, column 7).
            ("model.embed_tokens.weight", 99 * H + 7),
            ("model.layers.0.self_attn.q_proj.weight", 3 * H + 11),
            ("model.layers.1.self_attn.k_proj.weight", 5 * H + 2),
            ("model.layers.0.self_attn.v_proj.weight", 9 * H + 40),
            ("model.layers.1.input_layernorm.weight", 13),
            ("model.norm.weight", 21),
            // Untied LM head: the row of a target token (42).
            ("lm_head.weight", 42 * H + 5),
        ],
    );
}

#[test]
fn qwen2_gradients_match_central_differences() {
    check(
        "qwen2-tiny",
        &[
            // Tied: the embedding gets gradient both as input row and as LM-head row.
            ("model.embed_tokens.weight", 42 * H + 5),
            ("model.layers.0.self_attn.q_proj.bias", 6),
            ("model.layers.1.self_attn.v_proj.weight", 4 * H + 33),
            ("model.layers.0.post_attention_layernorm.weight", 30),
        ],
    );
}

#[test]
fn qwen3_gradients_match_central_differences() {
    check(
        "qwen3-tiny",
        &[
            ("model.embed_tokens.weight", 17 * H + 60),
            ("model.layers.0.self_attn.q_norm.weight", 3),
            ("model.layers.1.self_attn.k_norm.weight", 9),
            ("model.layers.0.self_attn.k_proj.weight", 7 * H + 1),
        ],
    );
}
