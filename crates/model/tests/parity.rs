//! Parity with transformers 5.23: each fixture's reference.json holds logits, next-token
//! log-probs and greedy continuations computed by transformers (eager attention, float32,
//! CPU) and a chat prompt rendered by `apply_chat_template`.
//!
//! Runs on `$COMPOSER_TEST_DEVICE` (default `cpu`; `cuda` with a `--features cuda` build),
//! always in f32 with the same tolerances.

mod common;
use candle_core::{DType, Tensor};
use common::*;
use composer_model::*;

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_fixture(name: &str, train_path: bool) {
    let dir = fixture(name);
    let reference = reference(name);
    let device = test_device();
    let policy = Policy::load(&dir, &device, DType::F32).expect("load");
    let model = &policy.model;
    for (ci, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let ids = as_u32s(&case["input_ids"]);
        assert_eq!(
            policy
                .tokenizer
                .encode(case["text"].as_str().unwrap())
                .unwrap(),
            ids,
            "{name} case {ci}: tokenizer ids"
        );
        let input = Tensor::new(ids.as_slice(), &device)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = if train_path {
            model.forward_train(&input, None).unwrap()
        } else {
            model.forward(&input, None).unwrap()
        };
        let ours: Vec<Vec<f32>> = logits.squeeze(0).unwrap().to_vec2().unwrap();
        let refl = case["logits"].as_array().unwrap();
        let mut max_logit = 0f32;
        for (t, row) in refl.iter().enumerate() {
            max_logit = max_logit.max(max_abs_diff(&ours[t], &as_f32s(row)));
        }
        assert!(
            max_logit < 1e-4,
            "{name} case {ci}: max |Δlogit| = {max_logit}"
        );
        let lp = score(model, std::slice::from_ref(&ids)).unwrap();
        let d = max_abs_diff(&lp[0], &as_f32s(&case["next_token_logprobs"]));
        assert!(d <= 1e-4, "{name} case {ci}: max |Δ log-prob| = {d}");
        if !train_path {
            let greedy = generate(
                model,
                &[GenerationRequest {
                    prompt_ids: ids.clone(),
                    num_samples: 1,
                    seed: 0,
                }],
                &SamplingParams {
                    temperature: 0.0,
                    max_new_tokens: 16,
                    stop_token_ids: Some(vec![]),
                    ..Default::default()
                },
            )
            .unwrap();
            assert_eq!(
                greedy[0][0].completion_ids,
                as_u32s(&case["greedy_16"]),
                "{name} case {ci}: greedy_16"
            );
        }
    }
    let ex = &reference["chat_template_example"];
    let messages: Vec<ChatMessage> = serde_json::from_value(ex["messages"].clone()).unwrap();
    let rendered = policy
        .chat_template
        .as_ref()
        .expect("template")
        .render(&messages, true)
        .unwrap();
    assert_eq!(
        rendered,
        ex["rendered"].as_str().unwrap(),
        "{name}: chat template"
    );
}

#[test]
fn parity_inference_path() {
    for name in FIXTURES {
        check_fixture(name, false);
    }
}

#[test]
fn parity_training_path() {
    for name in FIXTURES {
        check_fixture(name, true);
    }
}

#[test]
fn parity_batched_left_padded() {
    // The three cases of a fixture in one left-padded batch give each case's logits.
    let device = test_device();
    for name in FIXTURES {
        let reference = reference(name);
        let model = Transformer::load(&fixture(name), &device, DType::F32).unwrap();
        let cases = reference["cases"].as_array().unwrap();
        let seqs: Vec<Vec<u32>> = cases.iter().map(|c| as_u32s(&c["input_ids"])).collect();
        let t = seqs.iter().map(Vec::len).max().unwrap();
        let mut ids = vec![];
        let mut pads = vec![];
        for s in &seqs {
            pads.push(t - s.len());
            ids.extend(std::iter::repeat_n(0u32, t - s.len()));
            ids.extend_from_slice(s);
        }
        let input = Tensor::from_vec(ids, (seqs.len(), t), &device).unwrap();
        for train in [false, true] {
            let logits = if train {
                model.forward_train(&input, Some(&pads)).unwrap()
            } else {
                model.forward_padded(&input, &pads).unwrap()
            };
            let logits: Vec<Vec<Vec<f32>>> = logits.to_vec3().unwrap();
            for (b, c) in cases.iter().enumerate() {
                let refl = c["logits"].as_array().unwrap();
                for (i, row) in refl.iter().enumerate() {
                    let d = max_abs_diff(&logits[b][pads[b] + i], &as_f32s(row));
                    assert!(d < 1e-4, "{name} row {b} pos {i}: {d}");
                }
            }
        }
    }
}
