//! Padding-free training forward ([`Transformer::forward_hidden_packed`]): sequences packed
//! into one row give the same per-token log-probs and the same gradient for every parameter
//! as the right-padded batch, on the HF fixtures (f64) and a random model (f32 and f64),
//! with the custom kernels and with the differentiable compositions; bad packed inputs are
//! refused.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use composer_model::{token_logprobs, ModelConfig, PackedBatch, Transformer};

/// Sequences of different lengths (the longest sets the padded row length).
const SEQS: [&[u32]; 3] = [
    &[5, 17, 99, 3, 250, 42, 7, 300, 11],
    &[8, 64, 9],
    &[1, 2, 3, 4, 5, 6],
];

/// Per-sequence weights of the loss, so each row's gradient enters with its own scale.
const WEIGHTS: [f64; 3] = [1.0, -0.7, 0.35];

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Next-token log-probs of every sequence (concatenated) and every parameter's gradient of
/// `Σ_s w_s Σ_t logp`, by the right-padded forward.
fn padded(model: &Transformer, varmap: &VarMap) -> (Vec<f64>, Vec<(String, Vec<f64>)>) {
    let l = SEQS.iter().map(|s| s.len() - 1).max().unwrap();
    let mut input = vec![0u32; SEQS.len() * l];
    let mut target = vec![0u32; SEQS.len() * l];
    for (r, s) in SEQS.iter().enumerate() {
        for j in 0..s.len() - 1 {
            input[r * l + j] = s[j];
            target[r * l + j] = s[j + 1];
        }
    }
    let dev = model.device();
    let input = Tensor::from_vec(input, (SEQS.len(), l), dev).unwrap();
    let target = Tensor::from_vec(target, (SEQS.len(), l), dev).unwrap();
    let h = model.forward_hidden(&input, None, None, true).unwrap();
    let lp = token_logprobs(&model.logits(&h).unwrap(), &target).unwrap();
    let mut parts = Vec::new();
    for (r, s) in SEQS.iter().enumerate() {
        parts.push(lp.get(r).unwrap().narrow(0, 0, s.len() - 1).unwrap());
    }
    finish(&parts, varmap)
}

/// The same by the packed forward.
fn packed(model: &Transformer, varmap: &VarMap) -> (Vec<f64>, Vec<(String, Vec<f64>)>) {
    let inputs: Vec<&[u32]> = SEQS.iter().map(|s| &s[..s.len() - 1]).collect();
    let batch = PackedBatch::from_sequences(&inputs);
    let targets: Vec<u32> = SEQS.iter().flat_map(|s| s[1..].to_vec()).collect();
    let n = targets.len();
    let target = Tensor::from_vec(targets, (1, n), model.device()).unwrap();
    let h = model.forward_hidden_packed(&batch).unwrap();
    let lp = token_logprobs(&model.logits(&h.unsqueeze(0).unwrap()).unwrap(), &target)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let parts: Vec<Tensor> = batch
        .cu_seqlens
        .windows(2)
        .map(|w| lp.narrow(0, w[0], w[1] - w[0]).unwrap())
        .collect();
    finish(&parts, varmap)
}

fn finish(parts: &[Tensor], varmap: &VarMap) -> (Vec<f64>, Vec<(String, Vec<f64>)>) {
    let mut loss: Option<Tensor> = None;
    for (p, w) in parts.iter().zip(WEIGHTS) {
        let term = (p.sum_all().unwrap() * w).unwrap();
        loss = Some(match loss {
            Some(l) => (l + term).unwrap(),
            None => term,
        });
    }
    let grads = loss.unwrap().backward().unwrap();
    let mut out: Vec<(String, Vec<f64>)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let g = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{k} got no gradient"));
            (k.clone(), flat(g))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    let values = parts.iter().flat_map(flat).collect();
    (values, out)
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Packed equals padded: log-probs and every parameter's gradient within `tol` (relative to
/// the gradient's largest entry), with the kernels and with the compositions.
fn assert_packed_equals_padded(what: &str, model: &mut Transformer, varmap: &VarMap, tol: f64) {
    for kernels in [true, false] {
        model.training_kernels = kernels;
        let (lp_a, g_a) = padded(model, varmap);
        let (lp_b, g_b) = packed(model, varmap);
        let d = max_abs_diff(&lp_a, &lp_b);
        assert!(
            d <= tol,
            "{what} kernels={kernels}: log-probs differ by {d:e}"
        );
        assert_eq!(g_a.len(), g_b.len());
        for ((name, a), (_, b)) in g_a.iter().zip(&g_b) {
            let scale = a.iter().fold(1.0f64, |m, x| m.max(x.abs()));
            let d = max_abs_diff(a, b) / scale;
            assert!(
                d <= tol,
                "{what} kernels={kernels}: gradient of {name} differs by {d:e}"
            );
        }
    }
}

#[test]
fn packed_forward_equals_padded_on_the_hf_fixtures() {
    for name in common::FIXTURES {
        let (mut model, varmap) =
            Transformer::load_trainable(&common::fixture(name), &Device::Cpu, DType::F64).unwrap();
        assert_packed_equals_padded(name, &mut model, &varmap, 1e-10);
    }
}

fn tiny_config() -> ModelConfig {
    let cfg = ModelConfig::from_dir(&common::fixture("qwen2-tiny")).unwrap();
    ModelConfig {
        num_hidden_layers: 3,
        ..cfg
    }
}

#[test]
fn packed_forward_equals_padded_on_a_random_model() {
    let cfg = tiny_config();
    let (mut model, varmap) = Transformer::random_init(&cfg, 7, &Device::Cpu).unwrap();
    assert_packed_equals_padded("random f32", &mut model, &varmap, 2e-5);
}

#[test]
fn bad_packed_batches_are_refused() {
    let (model, _) =
        Transformer::load_trainable(&common::fixture("llama-tiny"), &Device::Cpu, DType::F32)
            .unwrap();
    let err = |b: PackedBatch| format!("{:#}", model.forward_hidden_packed(&b).unwrap_err());
    let good = PackedBatch::from_sequences(&[vec![1u32, 2, 3], vec![4, 5]]);
    assert_eq!(good.positions, vec![0, 1, 2, 0, 1]);
    assert_eq!(good.cu_seqlens, vec![0, 3, 5]);
    model.forward_hidden_packed(&good).unwrap();

    let e = err(PackedBatch::from_sequences::<Vec<u32>>(&[]));
    assert!(e.contains("no tokens"), "{e}");
    let e = err(PackedBatch {
        positions: vec![0, 1],
        ..good.clone()
    });
    assert!(e.contains("5 ids but 2 positions"), "{e}");
    let e = err(PackedBatch {
        cu_seqlens: vec![0, 3, 4],
        ..good.clone()
    });
    assert!(
        e.contains("cu_seqlens must start at 0 and end at the token count 5"),
        "{e}"
    );
    let max = model.cfg.max_position_embeddings as u32;
    let e = err(PackedBatch {
        positions: vec![0, 1, max, 0, 1],
        ..good.clone()
    });
    assert!(e.contains("exceeds max_position_embeddings"), "{e}");
}
