//! Gradients through every parameter, token-faithful rollouts, padding invariance, the save →
//! load round trip and bad input — all on the real transformers-written fixtures.

#[path = "../common/mod.rs"]
mod common;

mod bad_checkpoints;

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
        ..Default::default()
    }
}

#[test]
fn every_trainable_tensor_gets_a_nonzero_gradient() {
    // The padded forward and the padding-free packed one, each with and without per-layer
    // gradient checkpointing (whose weight gradients come from the layer's recomputation).
    for name in FIXTURES {
        for (packed, checkpointing) in [(false, false), (false, true), (true, false), (true, true)]
        {
            let (mut model, varmap) =
                Transformer::load_trainable(&fixture(name), &Device::Cpu, DType::F32)
                    .expect("load");
            model.gradient_checkpointing = checkpointing;
            let what = format!("{name} packed={packed} checkpointing={checkpointing}");
            let seq = [5u32, 17, 99, 3, 250, 42, 7, 300];
            let ids = Tensor::new(&[seq], &Device::Cpu).unwrap();
            let logits = if packed {
                let batch = composer_model::PackedBatch::from_sequences(&[&seq[..4], &seq[4..7]]);
                let h = model.forward_hidden_packed(&batch).unwrap();
                model.logits(&h.unsqueeze(0).unwrap()).unwrap()
            } else {
                model
                    .forward_train(&ids.narrow(1, 0, 7).unwrap(), None)
                    .unwrap()
            };
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
                    .unwrap_or_else(|| panic!("{what}: no gradient for {key}"));
                let norm = g
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(
                    norm > 0.0 && norm.is_finite(),
                    "{what}: zero/non-finite gradient for {key}"
                );
            }
        }
    }
}

/// The token-faithfulness test; runs on `$COMPOSER_TEST_DEVICE` (default `cpu`).
#[test]
fn scoring_reproduces_the_sampler_logprobs() {
    let device = common::test_device();
    let model = Transformer::load(&fixture("qwen2-tiny"), &device, DType::F32).unwrap();
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

#[test]
fn f64_models_score_and_sample_like_f32() {
    // f64 is for gradient checks; scoring and sampling must still work and agree.
    let f32_model = Transformer::load(&fixture("llama-tiny"), &Device::Cpu, DType::F32).unwrap();
    let f64_model = Transformer::load(&fixture("llama-tiny"), &Device::Cpu, DType::F64).unwrap();
    let seq = vec![PROMPT.to_vec()];
    let a = composer_model::score(&f32_model, &seq).unwrap();
    let b = composer_model::score(&f64_model, &seq).unwrap();
    for (x, y) in a[0].iter().zip(&b[0]) {
        assert!((x - y).abs() <= 1e-4, "f32 {x} vs f64 {y}");
    }
    let req = GenerationRequest {
        prompt_ids: PROMPT.to_vec(),
        num_samples: 1,
        seed: 0,
    };
    let greedy = |m: &Transformer| {
        generate(m, std::slice::from_ref(&req), &params(0.0, 8)).unwrap()[0][0]
            .completion_ids
            .clone()
    };
    assert_eq!(greedy(&f32_model), greedy(&f64_model));
}

/// The actors hand device tensors from thread to thread without synchronising (the trainer's
/// published weights to the generator thread, the policy to a multi-turn rollout's sampler
/// thread): a tensor still being computed on one thread must read right on another, and
/// every request for the device must give the same device.
#[test]
fn a_tensor_handed_to_another_thread_reads_its_final_values() {
    let dev = common::test_device();
    assert!(dev.same_device(&common::test_device()));
    // On a GPU: enough queued work (~0.5 TFLOP) that a reader on an unordered stream would
    // see the buffer before it is written.
    let (n, rounds) = if dev.is_cpu() { (64, 3) } else { (2048, 30) };
    let ones = Tensor::ones((n, n), DType::F32, &dev).unwrap();
    let mut y = ones.clone();
    for _ in 0..rounds {
        // Each product of all-ones matrices is n everywhere; divided by n, ones again
        // (exact in f32).
        y = (ones.matmul(&y).unwrap() / n as f64).unwrap();
    }
    let (tx, rx) = std::sync::mpsc::channel::<Tensor>();
    let reader = std::thread::spawn(move || {
        let y = rx.recv().unwrap();
        y.sum_all().unwrap().to_scalar::<f32>().unwrap()
    });
    tx.send(y).unwrap();
    let sum = reader.join().unwrap();
    assert_eq!(sum, (n * n) as f32, "read on another thread");
}

/// A checkpoint whose weights hold NaN makes `generate` fail naming the model directory,
/// instead of printing `null` log-probs with exit status 0.
#[test]
fn generate_refuses_non_finite_log_probs() {
    let tmp = fixture_copy("qwen2-tiny");
    let weights = tmp.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu).unwrap();
    let name = tensors
        .keys()
        .find(|k| k.ends_with("self_attn.q_proj.weight"))
        .unwrap()
        .clone();
    let w = &tensors[&name];
    let nan = (w.ones_like().unwrap() * f64::NAN).unwrap();
    tensors.insert(name, nan);
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let opts = composer_model::GenerateOptions {
        model_dir: tmp.path().to_path_buf(),
        prompt: "hi".into(),
        chat: false,
        max_new_tokens: 3,
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        seed: 1,
        num_samples: 1,
        device: "cpu".into(),
        deterministic: false,
    };
    let e = format!("{:#}", composer_model::generate_cli(&opts).unwrap_err());
    assert!(
        e.contains("non-finite") && e.contains(&tmp.path().display().to_string()),
        "{e}"
    );
}

/// A copy of fixture `name`'s files in a temporary directory, to change one of them.
fn fixture_copy(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
        }
    }
    tmp
}
