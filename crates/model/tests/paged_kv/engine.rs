//! The engine over the paged pool: a request's samples holding its prompt's blocks once, the
//! block budget, the block size as a knob, continuations, long rows against the scorer, the
//! decode layer with its norms inside the products.

use super::*;

fn params(max_new_tokens: usize, engine: EngineConfig) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        max_new_tokens,
        stop_token_ids: Some(vec![]),
        engine,
        ..Default::default()
    }
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

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((j * 37 + salt * 11) % 380) as u32)
        .collect()
}

#[test]
fn the_samples_of_a_request_hold_its_prompt_blocks_once() {
    let model = Transformer::load(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    // 37 prompt tokens: 2 full blocks of 16 and 5 tokens in a third; 4 samples of 8 tokens
    // feed 7 more, all within that third block.
    let reqs = vec![GenerationRequest {
        prompt_ids: prompt(37, 1),
        num_samples: 4,
        seed: 5,
    }];
    let (out, stats) = generate_with_stats(&model, &reqs, &params(8, Default::default())).unwrap();
    // Unshared reference: each sample feeds its own prompt through its own dense cache.
    let unshared = generate_deterministic(&model, &reqs, &params(8, Default::default())).unwrap();
    assert_same(&unshared, &out, "shared prompt blocks");
    assert_eq!(stats.prefill_tokens, 37);
    // Admission: the prompt's 3 blocks, each table pointing at all three.
    assert_eq!(
        (stats.steps[0].kv_blocks, stats.steps[0].kv_block_refs),
        (3, 12)
    );
    // First token: three samples copy the partly filled block, the fourth takes it. The two
    // full blocks stay shared: 2 + 4 blocks held where unshared rows would hold 12.
    assert_eq!(stats.kv_block_copies, 3);
    assert_eq!(stats.peak_kv_blocks(), 6, "{:?}", stats.steps);
    assert_eq!(stats.peak_kv_block_refs(), 12);
    assert_eq!(stats.peak_kv_slots(), 6 * 16);
    assert_eq!(stats.kv_block_size, 16);
}

/// Whether this process runs the decode layer with its norms and residual adds inside the
/// skinny products (`COMPOSER_DECODE_GEMM=1`, read once per process).
fn decode_gemm_switched_on() -> bool {
    std::env::var("COMPOSER_DECODE_GEMM").is_ok_and(|v| v == "1")
}

/// The tests below that compare the engine's decode with dense caches, the deterministic
/// sampler and the scorer, run again in a child process with `COMPOSER_DECODE_GEMM=1`: the
/// decode layer then runs its two norms and residual adds inside the products that read them
/// (on CUDA in bf16 the skinny kernel, elsewhere the same functions' separate ops — rms_norm,
/// the product, the add), and the last test checks that it did.
#[test]
fn the_decode_tests_pass_with_norms_in_the_products() {
    if decode_gemm_switched_on() {
        return; // the whole binary runs with the switch on: the tests below are that run
    }
    let tests = [
        "engine::the_samples_of_a_request_hold_its_prompt_blocks_once",
        "engine::outputs_do_not_depend_on_the_block_size",
        "engine::paged_decode_over_long_rows_matches_the_scorer",
        "engine::the_decode_layer_folds_its_norms_only_when_switched_on",
    ];
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env("COMPOSER_DECODE_GEMM", "1")
        .args(["--exact", "--test-threads", "1"])
        .args(tests)
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "with COMPOSER_DECODE_GEMM=1:\n{log}");
    let passed = format!("{} passed", tests.len());
    assert!(log.contains(&passed), "expected {passed}:\n{log}");
}

/// With `COMPOSER_DECODE_GEMM=1` every decode step (at most 64 rows) runs its layers with
/// the norms inside the products (on CUDA in bf16 at widths the kernel serves: gate/up's
/// multiples of 128); without it none does.
#[test]
fn the_decode_layer_folds_its_norms_only_when_switched_on() {
    let device = common::test_device();
    let dtype = if device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let mut cfg = ModelConfig::tiny_qwen2(384);
    cfg.intermediate_size = 128;
    let model = Transformer::random_init(&cfg, 5, &device)
        .unwrap()
        .0
        .to_dtype(dtype)
        .unwrap();
    let reqs = vec![GenerationRequest {
        prompt_ids: prompt(20, 4),
        num_samples: 3,
        seed: 8,
    }];
    let (_, stats) = generate_with_stats(&model, &reqs, &params(6, Default::default())).unwrap();
    assert!(stats.decode_forwards > 0);
    let want = if decode_gemm_switched_on() {
        stats.decode_forwards
    } else {
        0
    };
    assert_eq!(stats.decode_forwards_norms_in_products, want);
}

/// On `$COMPOSER_TEST_DEVICE` (default `cpu`): the paged decode (the device's kernel) samples
/// what dense per-sample caches sample, whatever the block size and batch limit.
#[test]
fn outputs_do_not_depend_on_the_block_size() {
    let dev = common::test_device();
    let model = Transformer::load(&fixture("qwen2-tiny"), &dev, DType::F32).unwrap();
    let reqs: Vec<GenerationRequest> = [(9, 3), (2, 2), (21, 4), (16, 1)]
        .iter()
        .enumerate()
        .map(|(i, &(len, n))| GenerationRequest {
            prompt_ids: prompt(len, i),
            num_samples: n,
            seed: 30 + i as u64,
        })
        .collect();
    let unshared = generate_deterministic(&model, &reqs, &params(12, Default::default())).unwrap();
    for kv_block_size in [1, 3, 16, 64] {
        for max_running in [0, 3] {
            let engine = EngineConfig {
                kv_block_size,
                max_running,
                ..Default::default()
            };
            let (out, stats) = generate_with_stats(&model, &reqs, &params(12, engine)).unwrap();
            let what = format!("block size {kv_block_size}, max_running {max_running}");
            assert_same(&unshared, &out, &what);
            assert_eq!(stats.kv_block_size, kv_block_size, "{what}");
        }
    }
}

#[test]
fn a_full_pool_delays_admission_and_every_sample_completes() {
    let model = Transformer::load(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    // Three requests of 20-token prompts, 3 samples each, 10 new tokens (29 slots, 2 blocks
    // of 16): a request holds 1 shared block + 3 own blocks (+ 1 while its prompt is held for
    // a sample still waiting), so 10 blocks run two requests at a time.
    let reqs: Vec<GenerationRequest> = (0..3)
        .map(|i| GenerationRequest {
            prompt_ids: prompt(20, i),
            num_samples: 3,
            seed: 70 + i as u64,
        })
        .collect();
    let (all, _) = generate_with_stats(&model, &reqs, &params(10, Default::default())).unwrap();
    let engine = EngineConfig {
        kv_token_budget: 10 * 16,
        ..Default::default()
    };
    let (out, stats) = generate_with_stats(&model, &reqs, &params(10, engine)).unwrap();
    assert_same(&all, &out, "budget of 10 blocks");
    assert!(
        stats.steps.iter().any(|s| s.waiting > 0),
        "{:?}",
        stats.steps
    );
    assert!(stats.peak_kv_blocks() <= 10, "{:?}", stats.steps);
    assert_eq!(stats.peak_running(), 6, "{:?}", stats.steps);
    assert_eq!(stats.generated_tokens, 9 * 10);
    // The pool never allocated past the budget.
    assert!(stats.kv_pool_blocks <= 10, "{}", stats.kv_pool_blocks);
    // Any block size and any budget that holds one sample: the same samples, never more
    // slots held than the budget (a running sample never waits for a block).
    for kv_block_size in [1, 5, 16] {
        for kv_token_budget in [48, 64, 100, 160] {
            let engine = EngineConfig {
                kv_token_budget,
                kv_block_size,
                ..Default::default()
            };
            let (out, stats) = generate_with_stats(&model, &reqs, &params(10, engine)).unwrap();
            let what = format!("block size {kv_block_size}, budget {kv_token_budget}");
            assert_same(&all, &out, &what);
            assert!(stats.peak_kv_slots() <= kv_token_budget, "{what}");
            assert!(
                stats.kv_pool_blocks * kv_block_size <= kv_token_budget,
                "{what}"
            );
        }
    }
}

#[test]
fn a_zero_block_size_is_refused_naming_the_key() {
    let model = Transformer::random_init(&ModelConfig::tiny_qwen2(16), 1, &Device::Cpu)
        .unwrap()
        .0;
    let reqs = vec![GenerationRequest {
        prompt_ids: vec![1, 2, 3],
        num_samples: 2,
        seed: 0,
    }];
    let engine = EngineConfig {
        kv_block_size: 0,
        ..Default::default()
    };
    let e = generate_with_stats(&model, &reqs, &params(4, engine)).unwrap_err();
    assert!(e.to_string().contains("kv_block_size"), "{e}");
}

#[test]
fn a_continuation_reads_its_stored_row_back_from_any_blocks() {
    let model = Transformer::load(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
    let first = vec![GenerationRequest {
        prompt_ids: prompt(11, 4),
        num_samples: 2,
        seed: 8,
    }];
    for kv_block_size in [1, 3, 16] {
        let p = params(
            7,
            EngineConfig {
                kv_block_size,
                ..Default::default()
            },
        );
        let mut store = PrefixStore::new(1000);
        let (turn1, _) = generate_with_store(&model, &first, &p, Some(&mut store)).unwrap();
        // Each sample's row: its prompt and 6 of its 7 tokens, gathered from its blocks.
        assert_eq!((store.len(), store.tokens()), (2, 2 * (11 + 6)));
        let second = vec![GenerationRequest {
            prompt_ids: [
                &first[0].prompt_ids[..],
                &turn1[0][1].completion_ids,
                &[5, 6],
            ]
            .concat(),
            num_samples: 3,
            seed: 9,
        }];
        let (continued, stats) =
            generate_with_store(&model, &second, &p, Some(&mut store)).unwrap();
        assert_eq!(stats.prefill_tokens, 1 + 2, "block size {kv_block_size}");
        let (fresh, _) = generate_with_stats(&model, &second, &p).unwrap();
        assert_same(&fresh, &continued, &format!("block size {kv_block_size}"));
    }
}

/// On `$COMPOSER_TEST_DEVICE` (default `cpu`): rows decoding past several key chunks of the
/// CUDA kernel (prompts of 250-520 tokens), with 7 query heads per KV head of dim 64, sample
/// log-probs the teacher-forced scorer reproduces, in f32 and (on CUDA) bf16.
#[test]
fn paged_decode_over_long_rows_matches_the_scorer() {
    let dev = common::test_device();
    let mut cfg = ModelConfig::tiny_qwen2(384);
    cfg.max_position_embeddings = 1024;
    cfg.num_attention_heads = 7;
    cfg.num_key_value_heads = 1;
    cfg.head_dim = 64;
    // Widths the skinny decode kernel serves (with COMPOSER_DECODE_GEMM=1: gate/up 2 × 128).
    cfg.intermediate_size = 128;
    // Larger weights than the default init: attention that is far from uniform, so a key
    // read from the wrong slot moves the log-probs.
    cfg.initializer_range = 0.3;
    let (model, _) = Transformer::random_init(&cfg, 17, &dev).unwrap();
    let reqs: Vec<GenerationRequest> = [(250, 2), (520, 1), (9, 2)]
        .iter()
        .enumerate()
        .map(|(i, &(len, n))| GenerationRequest {
            prompt_ids: prompt(len, i + 3),
            num_samples: n,
            seed: 90 + i as u64,
        })
        .collect();
    // f32: the sampler's log-probs are the scorer's to 1e-4. bf16 (CUDA only): the scorer's
    // prefill kernels and the decode round activations differently, so both are measured
    // against the f32 scorer on the same (bf16-rounded) weights, and the decode may not be
    // much further from it than the bf16 scorer is; a key read from the wrong slot moves the
    // log-probs by about their spread (> 1).
    let mut dtypes = vec![DType::F32];
    if !dev.is_cpu() {
        dtypes.push(DType::BF16);
    }
    for dtype in dtypes {
        let model = model.to_dtype(dtype).unwrap();
        let reference = model.to_dtype(DType::F32).unwrap();
        let engine = EngineConfig {
            kv_block_size: 16,
            ..Default::default()
        };
        let out = generate_with_stats(&model, &reqs, &params(10, engine))
            .unwrap()
            .0;
        let mut spread = (f32::INFINITY, f32::NEG_INFINITY);
        let (mut decode_err, mut score_err) = (Vec::new(), Vec::new());
        for (r, samples) in reqs.iter().zip(&out) {
            for s in samples {
                let scored = common::scored_completion(&model, &r.prompt_ids, s);
                let exact = common::scored_completion(&reference, &r.prompt_ids, s);
                assert_eq!(scored.len(), s.sampler_logprobs.len());
                for ((a, b), e) in scored.iter().zip(&s.sampler_logprobs).zip(&exact) {
                    if dtype == DType::F32 {
                        assert!(
                            (a - b).abs() <= 1e-4,
                            "F32, prompt of {}: scored {a} vs sampled {b}",
                            r.prompt_ids.len()
                        );
                    }
                    decode_err.push((b - e).abs());
                    score_err.push((a - e).abs());
                    spread = (spread.0.min(*b), spread.1.max(*b));
                }
            }
        }
        let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
        let max = |v: &[f32]| v.iter().cloned().fold(0.0, f32::max);
        let (decode, score) = (
            (mean(&decode_err), max(&decode_err)),
            (mean(&score_err), max(&score_err)),
        );
        assert!(
            decode.0 <= 2.0 * score.0 + 0.02 && decode.1 <= 2.0 * score.1 + 0.1,
            "{dtype:?}: |sampled − f32 scorer| mean {} max {} vs |scored − f32 scorer| mean {} max {}",
            decode.0,
            decode.1,
            score.0,
            score.1
        );
        // Far from the uniform log-prob (−ln 384 ≈ −5.95) everywhere: the attention matters.
        assert!(spread.1 - spread.0 > 1.0, "{dtype:?}: log-probs {spread:?}");
    }
}
