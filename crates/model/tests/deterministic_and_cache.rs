//! Deterministic mode: the sampler's log-probs equal the scorer's recomputed log-probs
//! bitwise (max |Δ| == 0, f32 and bf16) on the transformers-written fixtures and on a
//! built-in random model, whatever else is in the batch (the sampler's rows and the scorer's
//! sequences batched differently), and they are the model's log-probs (the ordinary scorer's,
//! to rounding). On `$COMPOSER_TEST_DEVICE` (the CPU in CI; `tools/gpu_check.sh` runs them on
//! CUDA, where the batch-invariant kernels serve). And the in-place, block-grown KV cache: the
//! same logits whether it grows block by block or was reserved up front.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixture, test_device, FIXTURES};
use composer_model::{
    generate, generate_deterministic, score_deterministic, score_with_temperature,
    GenerationRequest, KvCache, ModelConfig, SamplingParams, Transformer,
};

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

fn requests() -> Vec<GenerationRequest> {
    vec![
        GenerationRequest {
            prompt_ids: vec![380, 361, 10, 67, 14, 265],
            num_samples: 3,
            seed: 11,
        },
        GenerationRequest {
            prompt_ids: vec![5, 17],
            num_samples: 2,
            seed: 4,
        },
    ]
}

/// Samples deterministically and rescores every completion; returns max |sampler − scorer|
/// (and checks the lengths and that something was sampled).
fn max_sampler_scorer_gap(
    model: &Transformer,
    temperature: f64,
    reqs: &[GenerationRequest],
) -> f32 {
    let out = generate_deterministic(model, reqs, &params(temperature, 24)).unwrap();
    let score_t = if temperature == 0.0 { 1.0 } else { temperature };
    let mut gap = 0f32;
    let mut tokens = 0;
    for (r, samples) in reqs.iter().zip(&out) {
        assert_eq!(samples.len(), r.num_samples);
        let seqs: Vec<Vec<u32>> = samples
            .iter()
            .map(|s| [r.prompt_ids.as_slice(), &s.completion_ids].concat())
            .collect();
        let scored = score_deterministic(model, &seqs, score_t).unwrap();
        // The ordinary (batched, prefilled) scorer: the same log-probs but for rounding.
        let ordinary = score_with_temperature(model, &seqs, score_t).unwrap();
        let tol = if model.dtype() == DType::BF16 {
            0.1
        } else {
            1e-4
        };
        for ((s, lp), plain) in samples.iter().zip(&scored).zip(&ordinary) {
            let completion = &lp[r.prompt_ids.len() - 1..];
            assert_eq!(completion.len(), s.sampler_logprobs.len());
            for (a, b) in completion.iter().zip(&s.sampler_logprobs) {
                gap = gap.max((a - b).abs());
            }
            for (a, b) in lp.iter().zip(plain) {
                assert!((a - b).abs() <= tol, "deterministic {a} vs ordinary {b}");
            }
            tokens += completion.len();
        }
    }
    assert!(tokens > 0);
    gap
}

#[test]
fn deterministic_sampler_logprobs_equal_the_scorer_bitwise() {
    for name in FIXTURES {
        let model = Transformer::load(&fixture(name), &test_device(), DType::F32).unwrap();
        for t in [0.0, 0.7, 1.0] {
            assert_eq!(
                max_sampler_scorer_gap(&model, t, &requests()),
                0.0,
                "{name} T={t}"
            );
        }
    }
    // bf16 (the GPU's dtype): bitwise too.
    let model = Transformer::load(&fixture("qwen2-tiny"), &test_device(), DType::BF16).unwrap();
    assert_eq!(
        max_sampler_scorer_gap(&model, 1.0, &requests()),
        0.0,
        "bf16"
    );
    let (builtin, _) =
        Transformer::random_init(&ModelConfig::tiny_qwen2(512), 3, &test_device()).unwrap();
    for t in [0.0, 1.0] {
        assert_eq!(
            max_sampler_scorer_gap(&builtin, t, &requests()),
            0.0,
            "built-in T={t}"
        );
    }
}

#[test]
fn deterministic_samples_do_not_depend_on_the_rest_of_the_batch() {
    let model = Transformer::load(&fixture("qwen2-tiny"), &test_device(), DType::F32).unwrap();
    let reqs = requests();
    let together = generate_deterministic(&model, &reqs, &params(0.9, 16)).unwrap();
    for (i, r) in reqs.iter().enumerate() {
        let alone =
            generate_deterministic(&model, std::slice::from_ref(r), &params(0.9, 16)).unwrap();
        assert_eq!(alone[0], together[i], "request {i}");
    }
    // Bad input is refused as by the batched sampler.
    let bad = GenerationRequest {
        prompt_ids: vec![1, 384],
        num_samples: 1,
        seed: 0,
    };
    let e = generate_deterministic(&model, &[bad], &params(1.0, 4)).unwrap_err();
    assert!(e.to_string().contains("384"), "{e}");
    let e = score_deterministic(&model, &[vec![1, 2]], 0.0).unwrap_err();
    assert!(e.to_string().contains("temperature"), "{e}");
}

/// The scorer batches sequences of any lengths in any order: each sequence's log-probs are,
/// to the bit, those it gets scored alone and those its sampler drew with (f32 and bf16).
#[test]
fn deterministic_scores_do_not_depend_on_how_sequences_are_batched() {
    for dtype in [DType::F32, DType::BF16] {
        let model = Transformer::load(&fixture("qwen2-tiny"), &test_device(), dtype).unwrap();
        let reqs = requests();
        let out = generate_deterministic(&model, &reqs, &params(0.8, 20)).unwrap();
        let mut seqs = Vec::new();
        let mut drawn = Vec::new();
        for (r, samples) in reqs.iter().zip(&out) {
            for s in samples {
                seqs.push([r.prompt_ids.as_slice(), &s.completion_ids].concat());
                drawn.push((r.prompt_ids.len(), s.sampler_logprobs.clone()));
            }
        }
        // Reversed, with a one-token and an empty sequence among them (nothing to score).
        let mut mixed: Vec<Vec<u32>> = seqs.iter().rev().cloned().collect();
        mixed.insert(1, vec![7]);
        mixed.push(Vec::new());
        let mut scored = score_deterministic(&model, &mixed, 0.8).unwrap();
        assert!(scored[1].is_empty() && scored.last().unwrap().is_empty());
        scored.remove(1);
        scored.pop();
        scored.reverse();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (i, (seq, (prompt_len, sampler))) in seqs.iter().zip(&drawn).enumerate() {
            assert_eq!(
                bits(&scored[i][prompt_len - 1..]),
                bits(sampler),
                "{dtype:?} sequence {i}: scorer vs sampler"
            );
            let alone = score_deterministic(&model, std::slice::from_ref(seq), 0.8).unwrap();
            assert_eq!(bits(&alone[0]), bits(&scored[i]), "{dtype:?} sequence {i}");
        }
    }
}

/// Feeds `prompt` then `steps` greedy tokens through `cache`; returns every step's logits.
fn decode_logits(
    model: &Transformer,
    mut cache: KvCache,
    prompt: &[u32],
    steps: usize,
) -> Vec<Vec<f32>> {
    let dev = Device::Cpu;
    let mut out = Vec::new();
    let input = Tensor::new(prompt, &dev).unwrap().unsqueeze(0).unwrap();
    let mut logits = model.forward(&input, Some(&mut cache)).unwrap();
    for _ in 0..steps {
        let last = logits
            .narrow(1, logits.dim(1).unwrap() - 1, 1)
            .unwrap()
            .flatten_all()
            .unwrap();
        let row = last.to_vec1::<f32>().unwrap();
        let next = last.argmax(0).unwrap().to_scalar::<u32>().unwrap();
        out.push(row);
        let input = Tensor::new(&[[next]], &dev).unwrap();
        logits = model.forward(&input, Some(&mut cache)).unwrap();
    }
    out
}

#[test]
fn kv_cache_grown_in_blocks_equals_a_reserved_one_bitwise() {
    for name in FIXTURES {
        let model = Transformer::load(&fixture(name), &Device::Cpu, DType::F32).unwrap();
        let layers = model.cfg.num_hidden_layers;
        let prompt = [380u32, 361, 10, 67, 14, 265];
        // 150 steps cross two block boundaries (64-slot blocks).
        let grown = decode_logits(&model, KvCache::new(layers, vec![0]), &prompt, 150);
        let mut reserved = KvCache::new(layers, vec![0]);
        reserved.reserve(prompt.len() + 150);
        let pre = decode_logits(&model, reserved, &prompt, 150);
        assert_eq!(grown, pre, "{name}");
    }
}

#[test]
fn kv_cache_capacity_grows_by_blocks_and_clones_do_not_share_buffers() {
    let model = Transformer::load(&fixture("llama-tiny"), &Device::Cpu, DType::F32).unwrap();
    let dev = Device::Cpu;
    let mut cache = KvCache::new(model.cfg.num_hidden_layers, vec![0, 2]);
    let input = Tensor::new(&[[1u32, 2, 3], [0, 0, 4]], &dev).unwrap();
    model.forward(&input, Some(&mut cache)).unwrap();
    assert_eq!(
        (cache.len(), cache.capacity()),
        (3, composer_model::kv_cache::KV_BLOCK)
    );
    // A clone continued with one token must not change what the original computes next.
    let mut copy = cache.clone();
    let step = Tensor::new(&[[7u32], [8]], &dev).unwrap();
    let from_copy = model.forward(&step, Some(&mut copy)).unwrap();
    let other = Tensor::new(&[[9u32], [10]], &dev).unwrap();
    model.forward(&other, Some(&mut copy)).unwrap();
    let from_original = model.forward(&step, Some(&mut cache)).unwrap();
    let a = from_copy.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = from_original
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(a, b);
    // The batched sampler still runs through the in-place cache past a block boundary.
    let out = generate(&model, &requests(), &params(0.8, 80)).unwrap();
    assert!(out.iter().flatten().all(|s| s.completion_ids.len() == 80));
}
