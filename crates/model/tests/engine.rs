//! The rollout engine's scheduling: continuous batching, the prompt prefilled once per
//! request, the KV token budget and chunked prefill change when samples run, never what they
//! sample (same tokens, log-probs equal up to rounding), on a transformers-written fixture and
//! on a random model with skewed completion lengths.

mod common;

use candle_core::{DType, Device};
use common::fixture;
use composer_model::{
    generate, generate_deterministic, generate_with_stats, generate_with_store, EngineConfig,
    GenerationRequest, ModelConfig, PrefixStore, Sample, SamplingParams, Transformer,
};

fn params(max_new_tokens: usize, stop: Vec<u32>, engine: EngineConfig) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        max_new_tokens,
        stop_token_ids: Some(stop),
        engine,
        ..Default::default()
    }
}

fn requests() -> Vec<GenerationRequest> {
    vec![
        GenerationRequest {
            prompt_ids: vec![380, 361, 10, 67, 14, 265, 8, 90, 3],
            num_samples: 3,
            seed: 11,
        },
        GenerationRequest {
            prompt_ids: vec![5, 17],
            num_samples: 2,
            seed: 4,
        },
        GenerationRequest {
            prompt_ids: vec![44, 2, 19, 7],
            num_samples: 4,
            seed: 9,
        },
    ]
}

/// Same tokens and finish reasons; log-probs within rounding.
fn assert_same(a: &[Vec<Sample>], b: &[Vec<Sample>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (r, (xa, xb)) in a.iter().zip(b).enumerate() {
        assert_eq!(xa.len(), xb.len(), "{what}: request {r}");
        for (s, (sa, sb)) in xa.iter().zip(xb).enumerate() {
            assert_eq!(sa.completion_ids, sb.completion_ids, "{what}: {r}/{s}");
            assert_eq!(sa.finish_reason, sb.finish_reason, "{what}: {r}/{s}");
            for (x, y) in sa.sampler_logprobs.iter().zip(&sb.sampler_logprobs) {
                assert!((x - y).abs() <= 1e-5, "{what}: {r}/{s}: {x} vs {y}");
            }
        }
    }
}

/// A random Qwen2 over 16 tokens: near-uniform next-token distributions, so with token 3 as
/// the stop id completion lengths are geometric (mean ~16) and skewed.
fn skewed_model() -> Transformer {
    Transformer::random_init(&ModelConfig::tiny_qwen2(16), 7, &Device::Cpu)
        .unwrap()
        .0
}

fn skewed_requests(n: usize) -> Vec<GenerationRequest> {
    (0..n)
        .map(|i| GenerationRequest {
            prompt_ids: (0..3 + i % 4).map(|j| ((i * 5 + j) % 16) as u32).collect(),
            num_samples: 1,
            seed: 100 + i as u64,
        })
        .collect()
}

#[test]
fn continuous_batching_samples_what_one_static_batch_samples() {
    let model = Transformer::load(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    let reqs = requests();
    let (static_out, static_stats) =
        generate_with_stats(&model, &reqs, &params(20, vec![], EngineConfig::default())).unwrap();
    // Everything in one batch: 9 rows from the first step.
    assert_eq!(static_stats.steps[0].running, 9);
    for engine in [
        EngineConfig {
            max_running: 3,
            ..Default::default()
        },
        EngineConfig {
            max_running: 4,
            kv_token_budget: 100,
            prefill_chunk: 2,
            ..Default::default()
        },
        EngineConfig {
            prefill_chunk: 4,
            ..Default::default()
        },
    ] {
        let (out, stats) = generate_with_stats(&model, &reqs, &params(20, vec![], engine)).unwrap();
        assert_same(&static_out, &out, &format!("{engine:?}"));
        if engine.max_running > 0 {
            assert!(stats.peak_running() <= engine.max_running, "{stats:?}");
        }
        if engine.kv_token_budget > 0 {
            assert!(stats.peak_kv_slots() <= engine.kv_token_budget, "{stats:?}");
        }
        assert_eq!(stats.generated_tokens, 9 * 20);
        if engine
            == (EngineConfig {
                prefill_chunk: 4,
                ..Default::default()
            })
        {
            // One admission of all three prompts (longest 9 tokens): 3 chunked forwards.
            assert_eq!(stats.prefill_forwards, 3, "{stats:?}");
        }
    }
    assert_eq!(static_stats.prefill_forwards, 1);
    // The public entry point is the same engine.
    let via_generate = generate(&model, &reqs, &params(20, vec![], EngineConfig::default()));
    assert_eq!(via_generate.unwrap(), static_out);
}

#[test]
fn each_prompt_is_prefilled_once_for_all_its_samples() {
    let model = Transformer::load(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    let reqs = requests();
    let prompt_tokens: usize = reqs.iter().map(|r| r.prompt_ids.len()).sum();
    // Unshared reference: every sample feeds its own prompt through its own cache.
    let unshared = generate_deterministic(&model, &reqs, &params(12, vec![], Default::default()));
    let unshared = unshared.unwrap();
    // max_running 2 < 3 and 4 samples per prompt: a prompt's samples are admitted at
    // different steps and still share one prefill.
    for max_running in [0, 2, 5] {
        let engine = EngineConfig {
            max_running,
            ..Default::default()
        };
        let (out, stats) = generate_with_stats(&model, &reqs, &params(12, vec![], engine)).unwrap();
        assert_same(&unshared, &out, &format!("max_running {max_running}"));
        assert_eq!(
            stats.prefill_tokens, prompt_tokens,
            "max_running {max_running}"
        );
    }
}

#[test]
fn a_long_completion_does_not_hold_the_batch() {
    let model = skewed_model();
    let reqs = skewed_requests(12);
    let p = |engine| params(48, vec![3], engine);
    let (all, _) = generate_with_stats(&model, &reqs, &p(EngineConfig::default())).unwrap();
    let lens: Vec<usize> = all.iter().map(|s| s[0].completion_ids.len()).collect();
    let (min, max) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
    assert!(
        *max >= 4 * min,
        "lengths not skewed enough to test: {lens:?}"
    );

    let engine = EngineConfig {
        max_running: 3,
        ..Default::default()
    };
    let (out, stats) = generate_with_stats(&model, &reqs, &p(engine)).unwrap();
    assert_same(&all, &out, "max_running 3");
    // While anything waits, every slot of the batch is busy: a finished sample's row is
    // refilled on the next step.
    for (k, s) in stats.steps.iter().enumerate() {
        assert!(s.running <= 3, "step {k}: {s:?}");
        if s.waiting > 0 {
            assert_eq!(
                s.running, 3,
                "step {k}: a slot stayed idle while samples waited"
            );
        }
    }
    // A static batch of 3 runs each group to its longest completion; the continuous batch
    // needs fewer steps for the same tokens.
    let static_steps: usize = lens.chunks(3).map(|c| *c.iter().max().unwrap()).sum();
    assert!(
        stats.steps.len() < static_steps,
        "{} steps vs {static_steps} for static batches of 3",
        stats.steps.len()
    );
}

#[test]
fn admission_waits_for_the_kv_budget_and_never_exceeds_it() {
    let model = skewed_model();
    let reqs = skewed_requests(8);
    let p = |engine| params(40, vec![3], engine);
    let (all, _) = generate_with_stats(&model, &reqs, &p(EngineConfig::default())).unwrap();
    // A sample needs at most 6 + 39 = 45 slots, 3 blocks of 16: 100 slots (6 blocks) hold
    // two rows, never three.
    let engine = EngineConfig {
        kv_token_budget: 100,
        ..Default::default()
    };
    let (out, stats) = generate_with_stats(&model, &reqs, &p(engine)).unwrap();
    assert_same(&all, &out, "budget 100");
    assert!(stats.peak_kv_slots() <= 100, "{:?}", stats.steps);
    assert!(stats.peak_running() <= 2, "{:?}", stats.steps);
    assert!(stats.steps.iter().any(|s| s.waiting > 0));

    // A budget below one sample's need is refused before any work, naming the request.
    let tight = EngineConfig {
        kv_token_budget: 30,
        ..Default::default()
    };
    let err = generate_with_stats(&model, &reqs, &p(tight)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("request 0") && msg.contains("kv_token_budget is 30"),
        "{msg}"
    );
}

#[test]
fn a_continuation_prefills_only_its_new_tokens() {
    let model = Transformer::load(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    let p = params(6, vec![], EngineConfig::default());
    let first = vec![
        GenerationRequest {
            prompt_ids: vec![380, 361, 10, 67],
            num_samples: 1,
            seed: 1,
        },
        GenerationRequest {
            prompt_ids: vec![5, 17, 44],
            num_samples: 1,
            seed: 2,
        },
    ];
    let mut store = PrefixStore::new(1000);
    let (turn1, _) = generate_with_store(&model, &first, &p, Some(&mut store)).unwrap();
    // Each sample fed its prompt and 5 of its 6 tokens.
    assert_eq!((store.len(), store.tokens()), (2, 4 + 5 + 3 + 5));
    // The next turn of episode 0: its context, completion and a 3-token observation; plus
    // an unrelated prompt.
    let obs = [7u32, 8, 9];
    let second = vec![
        GenerationRequest {
            prompt_ids: [&first[0].prompt_ids[..], &turn1[0][0].completion_ids, &obs].concat(),
            num_samples: 2,
            seed: 3,
        },
        GenerationRequest {
            prompt_ids: vec![100, 101],
            num_samples: 1,
            seed: 4,
        },
    ];
    let (continued, stats) = generate_with_store(&model, &second, &p, Some(&mut store)).unwrap();
    // Fed: the last token of turn 1 and the observation, and the unrelated prompt.
    assert_eq!(stats.prefill_tokens, 1 + obs.len() + 2);
    let (fresh, fresh_stats) = generate_with_stats(&model, &second, &p).unwrap();
    assert_eq!(fresh_stats.prefill_tokens, second[0].prompt_ids.len() + 2);
    assert_same(&fresh, &continued, "continued from the store");
    // The continued row was taken out; the three new samples are in.
    assert_eq!(store.len(), 1 + 3);
    // The token bound evicts the oldest rows.
    let mut small = PrefixStore::new(10);
    generate_with_store(&model, &first, &p, Some(&mut small)).unwrap();
    assert_eq!((small.len(), small.tokens()), (1, 8));
}
