//! The fused, chunked LM head against the unfused composition (logits = h·Wᵀ / T, then
//! log-softmax, gather, entropy, top-K) in f64 on the CPU: values, selected ids, and the
//! gradients w.r.t. the hidden states and the LM-head weight — directly on small random
//! tensors with several chunks, and through whole fixture models (tied and untied heads),
//! where every parameter must get the same gradient as through the unfused path. The head is
//! composer-model's; it is tested here, next to the trainer that runs it.

mod common;

use candle_core::{DType, Device, Tensor, Var, D};
use common::hf_fixture as fixture;

const FIXTURES: [&str; 3] = ["llama-tiny", "qwen2-tiny", "qwen3-tiny"];
use composer_model::{
    head_logprobs, log_softmax, token_entropy, topk_logprobs, HeadOptions, Transformer,
};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

fn randn(shape: (usize, usize), seed: u64) -> Tensor {
    // A small LCG keeps the test independent of candle's RNG.
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let data: Vec<f64> = (0..shape.0 * shape.1)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// Fixed loss weights for each output, so every output's gradient path is exercised.
fn weights(shape: (usize, usize), seed: u64) -> Tensor {
    randn(shape, seed)
}

#[test]
fn fused_head_matches_the_unfused_composition_in_values_and_gradients() {
    let (n, h, v, k_ids, top_k, temperature) = (7, 5, 11, 3, 4, 0.7);
    let dev = Device::Cpu;
    for chunk_elements in [v, 2 * v + 3, 1 << 20] {
        let hid = Var::from_tensor(&randn((n, h), 1)).unwrap();
        let w = Var::from_tensor(&randn((v, h), 2)).unwrap();
        // Repeated ids in a row, and ids that are also in the row's top-K.
        let mut ids: Vec<u32> = (0..n * k_ids)
            .map(|i| ((i * 7 + i / 5) % v) as u32)
            .collect();
        ids[1] = ids[0];
        let ids = Tensor::from_vec(ids, (n, k_ids), &dev).unwrap();
        let (wa, we, wt) = (
            weights((n, k_ids), 3),
            weights((n, 1), 4).squeeze(1).unwrap(),
            weights((n, top_k), 5),
        );

        let opts = HeadOptions {
            temperature,
            top_k,
            chunk_elements,
        };
        let fused = head_logprobs(hid.as_tensor(), w.as_tensor(), &ids, &opts).unwrap();
        let f_topk = fused.topk_logprobs.clone().unwrap();
        let fused_loss = ((&fused.at_ids * &wa).unwrap().sum_all().unwrap()
            + (&fused.entropy * &we).unwrap().sum_all().unwrap()
            + (&f_topk * &wt).unwrap().sum_all().unwrap())
        .unwrap();

        let logits =
            (hid.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap() / temperature).unwrap();
        let ls = log_softmax(&logits).unwrap();
        let at = ls.gather(&ids, D::Minus1).unwrap();
        let ent = token_entropy(&logits).unwrap();
        let (ref_ids, ref_topk) = topk_logprobs(&logits, top_k).unwrap();
        let ref_loss = ((&at * &wa).unwrap().sum_all().unwrap()
            + (&ent * &we).unwrap().sum_all().unwrap()
            + (&ref_topk * &wt).unwrap().sum_all().unwrap())
        .unwrap();

        assert_eq!(fused.at_ids.dtype(), DType::F64);
        assert!(max_abs_diff(&fused.at_ids, &at) < 1e-12);
        assert!(max_abs_diff(&fused.entropy, &ent) < 1e-12);
        assert_eq!(
            fused.topk_ids.as_ref().unwrap().to_vec2::<u32>().unwrap(),
            ref_ids.to_vec2::<u32>().unwrap(),
            "chunk_elements {chunk_elements}: top-K ids"
        );
        assert!(max_abs_diff(&f_topk, &ref_topk) < 1e-12);

        let gf = fused_loss.backward().unwrap();
        let gr = ref_loss.backward().unwrap();
        for (name, var) in [("hidden", &hid), ("weight", &w)] {
            let a = gf.get(var.as_tensor()).unwrap();
            let b = gr.get(var.as_tensor()).unwrap();
            let scale = b.abs().unwrap().max_keepdim(0).unwrap().max(1).unwrap();
            let scale = scale.squeeze(0).unwrap().to_scalar::<f64>().unwrap();
            assert!(
                scale > 1e-3,
                "{name}: reference gradient is trivially small"
            );
            let d = max_abs_diff(a, b);
            assert!(
                d < 1e-10 * scale.max(1.0),
                "chunk_elements {chunk_elements}: gradient w.r.t. {name} differs by {d:e}"
            );
        }
    }
}

#[test]
fn fused_head_handles_zero_rows_and_no_ids() {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&randn((9, 4), 7)).unwrap();
    let hid = Var::from_tensor(&randn((0, 4), 8)).unwrap();
    let ids = Tensor::zeros((0, 2), DType::U32, &dev).unwrap();
    let out = head_logprobs(
        hid.as_tensor(),
        w.as_tensor(),
        &ids,
        &HeadOptions::default(),
    )
    .unwrap();
    assert_eq!(out.at_ids.dims(), &[0, 2]);
    assert_eq!(out.entropy.dims(), &[0]);

    // Entropy alone (K = 0) still trains the head.
    let hid = Var::from_tensor(&randn((3, 4), 9)).unwrap();
    let ids = Tensor::zeros((3, 0), DType::U32, &dev).unwrap();
    let out = head_logprobs(
        hid.as_tensor(),
        w.as_tensor(),
        &ids,
        &HeadOptions::default(),
    )
    .unwrap();
    let logits = hid.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
    let ent = token_entropy(&logits).unwrap();
    assert!(max_abs_diff(&out.entropy, &ent) < 1e-12);
    let gf = out.entropy.sum_all().unwrap().backward().unwrap();
    let gr = ent.sum_all().unwrap().backward().unwrap();
    assert!(
        max_abs_diff(
            gf.get(w.as_tensor()).unwrap(),
            gr.get(w.as_tensor()).unwrap()
        ) < 1e-12
    );
}

#[test]
fn fused_head_rejects_bad_input_with_clear_errors() {
    let dev = Device::Cpu;
    let hid = randn((2, 4), 1);
    let w = randn((5, 4), 2);
    let err = |ids: &Tensor, h: &Tensor, w: &Tensor, t: f64| {
        let opts = HeadOptions {
            temperature: t,
            ..HeadOptions::default()
        };
        format!("{:#}", head_logprobs(h, w, ids, &opts).unwrap_err())
    };
    let out_of_vocab = Tensor::new(&[[1u32], [5]], &dev).unwrap();
    assert!(err(&out_of_vocab, &hid, &w, 1.0).contains("token id 5 is outside the vocabulary (5)"));
    let ok_ids = Tensor::new(&[[1u32], [2]], &dev).unwrap();
    assert!(err(&ok_ids, &hid, &w, 0.0).contains("temperature must be > 0"));
    assert!(err(&ok_ids, &hid, &randn((5, 3), 3), 1.0).contains("hidden size 4"));
    let wrong_rows = Tensor::new(&[[1u32]], &dev).unwrap();
    assert!(err(&wrong_rows, &hid, &w, 1.0).contains("ids must be u32 [2, K]"));
}

/// Whole models in f64: the next-token loss (log-probs, entropy bonus, top-K term) through
/// the fused head and through `forward_train` + the unfused ops give the same gradient for
/// every parameter, the tied embedding (qwen2-tiny) included.
#[test]
fn fixture_models_get_the_same_gradients_through_the_fused_head() {
    for name in FIXTURES {
        let (model, varmap) =
            Transformer::load_trainable(&fixture(name), &Device::Cpu, DType::F64).unwrap();
        let ids = Tensor::new(&[[5u32, 17, 99, 3, 250, 42, 7, 300]], &Device::Cpu).unwrap();
        let input = ids.narrow(1, 0, 7).unwrap();
        let targets = ids.narrow(1, 1, 7).unwrap().reshape((7, 1)).unwrap();
        let t = 0.8;

        let hidden = model
            .forward_hidden(&input, None, None, true)
            .unwrap()
            .reshape((7, model.cfg.hidden_size))
            .unwrap();
        let opts = HeadOptions {
            temperature: t,
            top_k: 3,
            chunk_elements: 2 * model.cfg.vocab_size,
        };
        let f = model.head_logprobs(&hidden, &targets, &opts).unwrap();
        let fused_loss = (f.at_ids.mean_all().unwrap().neg().unwrap()
            + (f.entropy.mean_all().unwrap() * 0.1).unwrap()
            + (f.topk_logprobs.unwrap().mean_all().unwrap() * 0.05).unwrap())
        .unwrap();

        let logits = (model
            .forward_train(&input, None)
            .unwrap()
            .squeeze(0)
            .unwrap()
            / t)
            .unwrap();
        let ls = log_softmax(&logits).unwrap();
        let (_, top) = topk_logprobs(&logits, 3).unwrap();
        let ref_loss = (ls
            .gather(&targets, 1)
            .unwrap()
            .mean_all()
            .unwrap()
            .neg()
            .unwrap()
            + (token_entropy(&logits).unwrap().mean_all().unwrap() * 0.1).unwrap()
            + (top.mean_all().unwrap() * 0.05).unwrap())
        .unwrap();
        let (a, b) = (
            fused_loss.to_scalar::<f64>().unwrap(),
            ref_loss.to_scalar::<f64>().unwrap(),
        );
        assert!((a - b).abs() < 1e-10, "{name}: loss {a} vs {b}");

        let gf = fused_loss.backward().unwrap();
        let gr = ref_loss.backward().unwrap();
        let vars = varmap.data().lock().unwrap();
        for (key, var) in vars.iter() {
            let x = gf
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no fused gradient for {key}"));
            let y = gr.get(var.as_tensor()).unwrap();
            let scale = y.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            let scale = scale.to_scalar::<f64>().unwrap();
            assert!(scale > 0.0, "{name}: zero reference gradient for {key}");
            let d = max_abs_diff(x, y);
            assert!(
                d <= 1e-9 * scale,
                "{name}: {key} gradient differs by {d:e} (scale {scale:e})"
            );
        }
    }
}
