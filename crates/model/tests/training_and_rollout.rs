//! Gradients through every parameter, token-faithful rollouts, padding invariance, the save →
//! load round trip and bad input — all on the real transformers-written fixtures.

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::{fixture, FIXTURES};
use composer_model::{
    generate, score_with_temperature, token_logprobs, GenerationRequest, SamplingParams,
    Transformer,
};

const PROMPT: [u32; 6] = [380, 361, 10, 67, 14, 265];

fn params(temperature: f64, max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p: 1.0,
        top_k: 0,
        max_new_tokens,
        stop_token_ids: Some(vec![]),
    }
}

#[test]
fn every_trainable_tensor_gets_a_nonzero_gradient() {
    for name in FIXTURES {
        let (model, varmap) =
            Transformer::load_trainable(&fixture(name), &Device::Cpu, DType::F32).expect("load");
        let ids = Tensor::new(&[[5u32, 17, 99, 3, 250, 42, 7, 300]], &Device::Cpu).unwrap();
        let logits = model
            .forward_train(&ids.narrow(1, 0, 7).unwrap(), None)
            .unwrap();
        let targets = ids.narrow(1, 1, 7).unwrap();
        let loss = token_logprobs(&logits, &targets)
            .unwrap()
            .mean_all()
            .unwrap()
            .neg()
            .unwrap();
        let grads = loss.backward().unwrap();
        let vars = varmap.data().lock().unwrap();
        assert!(!vars.is_empty());
        for (key, var) in vars.iter() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient for {key}"));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{name}: zero/non-finite gradient for {key}"
            );
        }
    }
}

#[test]
fn scoring_reproduces_the_sampler_logprobs() {
    let model = Transformer::load(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    for temperature in [1.0, 0.7] {
        let req = GenerationRequest {
            prompt_ids: PROMPT.to_vec(),
            num_samples: 3,
            seed: 11,
        };
        let samples = generate(&model, &[req], &params(temperature, 12))
            .unwrap()
            .remove(0);
        for s in samples {
            let mut seq = PROMPT.to_vec();
            seq.extend(&s.completion_ids);
            let scored = score_with_temperature(&model, &[seq], temperature)
                .unwrap()
                .remove(0);
            let tail = &scored[PROMPT.len() - 1..];
            assert_eq!(tail.len(), s.sampler_logprobs.len());
            for (a, b) in tail.iter().zip(&s.sampler_logprobs) {
                assert!(
                    (a - b).abs() <= 1e-5,
                    "T={temperature}: scored {a} vs sampled {b}"
                );
            }
        }
    }
}

#[test]
fn same_seed_same_tokens_and_padding_changes_nothing() {
    let model = Transformer::load(&fixture("llama-tiny"), &Device::Cpu, DType::F32).unwrap();
    let short = GenerationRequest {
        prompt_ids: PROMPT[..3].to_vec(),
        num_samples: 2,
        seed: 5,
    };
    let long = GenerationRequest {
        prompt_ids: PROMPT.to_vec(),
        num_samples: 1,
        seed: 9,
    };
    let alone = generate(&model, std::slice::from_ref(&short), &params(1.0, 10)).unwrap();
    let again = generate(&model, std::slice::from_ref(&short), &params(1.0, 10)).unwrap();
    let batched = generate(&model, &[short, long], &params(1.0, 10)).unwrap();
    for i in 0..2 {
        assert_eq!(alone[0][i].completion_ids, again[0][i].completion_ids);
        assert_eq!(
            alone[0][i].completion_ids, batched[0][i].completion_ids,
            "padding changed tokens"
        );
        for (a, b) in alone[0][i]
            .sampler_logprobs
            .iter()
            .zip(&batched[0][i].sampler_logprobs)
        {
            assert!(
                (a - b).abs() <= 1e-5,
                "padding changed a log-prob: {a} vs {b}"
            );
        }
    }
}

fn logits_of(dir: &Path) -> Vec<f32> {
    let model = Transformer::load(dir, &Device::Cpu, DType::F32).unwrap();
    let ids = Tensor::new(&[PROMPT], &Device::Cpu).unwrap();
    model
        .forward(&ids, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn save_and_load_round_trip_gives_identical_logits() {
    for name in FIXTURES {
        let original = logits_of(&fixture(name));
        let model = Transformer::load(&fixture(name), &Device::Cpu, DType::F32).unwrap();
        let single = tempfile::tempdir().unwrap();
        model.save_pretrained(single.path()).unwrap();
        assert_eq!(
            logits_of(single.path()),
            original,
            "{name}: single-file round trip"
        );
        let sharded = tempfile::tempdir().unwrap();
        model.save_pretrained_sharded(sharded.path(), 2).unwrap();
        assert!(sharded.path().join("model.safetensors.index.json").exists());
        assert_eq!(
            logits_of(sharded.path()),
            original,
            "{name}: sharded round trip"
        );
    }
}

fn load_error(dir: &Path) -> String {
    match Transformer::load(dir, &Device::Cpu, DType::F32) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn bad_checkpoints_are_clear_errors() {
    let missing = load_error(Path::new("/nonexistent/model"));
    assert!(missing.contains("/nonexistent/model"), "{missing}");

    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen2-tiny").join(f), dir.path().join(f)).unwrap();
    }
    let config = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        config.replace("\"qwen2\"", "\"gpt2\""),
    )
    .unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model_type") && err.contains("gpt2"), "{err}");

    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("config.json"), "{err}");

    let mut value: serde_json::Value = serde_json::from_str(&config).unwrap();
    value.as_object_mut().unwrap().remove("hidden_size");
    std::fs::write(dir.path().join("config.json"), value.to_string()).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("hidden_size"), "{err}");

    let mut value: serde_json::Value = serde_json::from_str(&config).unwrap();
    value["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    std::fs::write(dir.path().join("config.json"), value.to_string()).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("yarn") || err.contains("rope"), "{err}");

    let mut value: serde_json::Value = serde_json::from_str(&config).unwrap();
    value["hidden_size"] = serde_json::json!(128);
    std::fs::write(dir.path().join("config.json"), value.to_string()).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("embed_tokens") || err.contains("shape"),
        "{err}"
    );
}

#[test]
fn prompt_longer_than_the_positions_is_an_error() {
    let model = Transformer::load(&fixture("qwen3-tiny"), &Device::Cpu, DType::F32).unwrap();
    let req = GenerationRequest {
        prompt_ids: vec![5; 300],
        num_samples: 1,
        seed: 0,
    };
    let Err(err) = generate(&model, &[req], &params(1.0, 4)) else {
        panic!("must fail")
    };
    assert!(format!("{err:#}").contains("256"), "{err:#}");
}

#[test]
fn unsupported_tensor_dtype_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("qwen2-tiny").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let data: Vec<u8> = (0..8 * 4i64).flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![8, 4], &data).unwrap();
    safetensors::serialize_to_file(
        [("model.embed_tokens.weight", view)],
        None,
        &dir.path().join("model.safetensors"),
    )
    .unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("model.embed_tokens.weight") && err.contains("I64"),
        "{err}"
    );
}

#[test]
fn bf16_checkpoints_load_and_stay_close_to_f32() {
    let model = Transformer::load(&fixture("qwen3-tiny"), &Device::Cpu, DType::F32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model
        .to_dtype(DType::BF16)
        .unwrap()
        .save_pretrained(dir.path())
        .unwrap();
    let reloaded = Transformer::load(dir.path(), &Device::Cpu, DType::F32).unwrap();
    let ids = Tensor::new(&[PROMPT], &Device::Cpu).unwrap();
    let a: Vec<f32> = model
        .forward(&ids, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let b: Vec<f32> = reloaded
        .forward(&ids, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    // bf16 keeps 8 mantissa bits: weights round by ≤ 2^-9 relative, logits by a few 1e-2 here.
    assert!(worst < 0.1, "bf16 round trip moved a logit by {worst}");
}
