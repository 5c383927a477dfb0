//! The rollout engine's decode step: the paged decode attention (the test device's kernel and
//! the gathering composition) against a dense reference, a request's samples holding its
//! prompt's blocks once, the block budget, the block size as a knob, and the inverse-CDF
//! sampler (the device's) against the CPU sampler.

mod common;

use candle_core::{DType, Device, Tensor};
use common::fixture;
use composer_model::ops::{paged_decode_attention, paged_decode_attention_composed, PagedLayout};
use composer_model::sampling::{sample_inverse_cdf, SampleFilter};
use composer_model::{
    generate_deterministic, generate_with_stats, generate_with_store, EngineConfig,
    GenerationRequest, ModelConfig, PrefixStore, Sample, SamplingParams, Transformer,
};

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

/// Dense attention of one query per row over its `len` keys, in f64 by hand: row `b` reads
/// token `j` from `slot(b, j)` of `[slots, hkv, d]` pools.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (hq, hkv, d): (usize, usize, usize),
    lens: &[usize],
    slot: &dyn Fn(usize, usize) -> usize,
    scale: f64,
) -> Vec<f64> {
    let mut out = vec![0.0; lens.len() * hq * d];
    for (b, &len) in lens.iter().enumerate() {
        for h in 0..hq {
            let g = h / (hq / hkv);
            let qh = &q[(b * hq + h) * d..][..d];
            let kv = |pool: &[f64], j: usize| pool[(slot(b, j) * hkv + g) * d..][..d].to_vec();
            let scores: Vec<f64> = (0..len)
                .map(|j| qh.iter().zip(kv(k, j)).map(|(a, b)| a * b).sum::<f64>() * scale)
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (j, w) in e.iter().enumerate() {
                for (o, x) in out[(b * hq + h) * d..][..d].iter_mut().zip(kv(v, j)) {
                    *o += w / sum * x;
                }
            }
        }
    }
    out
}

/// Values of `x` after a round trip through `dtype` (what a tensor of that dtype holds).
fn rounded(x: &[f64], dtype: DType) -> Vec<f64> {
    Tensor::new(x, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .unwrap()
}

/// The paged decode attention (the kernel of the test device: CPU f32/f64, CUDA f32/bf16)
/// and the gathering composition against [`reference`] on the dtype-rounded inputs, for
/// `(heads, kv_heads, head_dim, block_size)` and row lengths `lens`, the rows' blocks
/// scattered over the pool in no order (row 0's table one block longer than it needs).
fn check_paged_attention((hq, hkv, d, bs): (usize, usize, usize, usize), lens: &[usize]) {
    let dev = common::test_device();
    let lens = lens.to_vec();
    let num_blocks = lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 4;
    let mut free: Vec<u32> = (0..num_blocks as u32).rev().collect();
    free.rotate_left(7);
    let tables: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(b, &l)| {
            let n = l.div_ceil(bs) + usize::from(b == 0);
            (0..n).map(|_| free.pop().unwrap()).collect()
        })
        .collect();
    let slot = |b: usize, j: usize| tables[b][j / bs] as usize * bs + j % bs;
    let slots = num_blocks * bs;
    let (qv, kv, vv) = (
        values(lens.len() * hq * d, 1),
        values(slots * hkv * d, 2),
        values(slots * hkv * d, 3),
    );
    let scale = 1.0 / (d as f64).sqrt();
    // (dtype, kernel tolerance, composition tolerance): outputs are averages of values in
    // [-1, 1); the CUDA composition rounds its bf16 scores and probabilities, the kernel only
    // its output.
    let cases = if dev.is_cpu() {
        vec![(DType::F32, 2e-6, 2e-6), (DType::F64, 1e-12, 1e-12)]
    } else {
        vec![(DType::F32, 1e-4, 1e-4), (DType::BF16, 1e-2, 4e-2)]
    };
    for (dtype, tol_kernel, tol_composed) in cases {
        let (qr, kr, vr) = (
            rounded(&qv, dtype),
            rounded(&kv, dtype),
            rounded(&vv, dtype),
        );
        let want = reference(&qr, &kr, &vr, (hq, hkv, d), &lens, &slot, scale);
        let t = |x: &[f64], shape: (usize, usize, usize)| {
            Tensor::from_vec(x.to_vec(), shape, &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .and_then(|t| t.to_device(&dev))
                .unwrap()
        };
        let q = t(&qr, (lens.len(), hq, d));
        let (k, v) = (t(&kr, (slots, hkv, d)), t(&vr, (slots, hkv, d)));
        let layout = PagedLayout::new(bs, tables.clone(), lens.clone()).unwrap();
        let kernel = paged_decode_attention(&q, &k, &v, &layout, scale).unwrap();
        let composed = paged_decode_attention_composed(&q, &k, &v, &layout, scale).unwrap();
        for (what, got, tol) in [
            ("kernel", kernel, tol_kernel),
            ("composed", composed, tol_composed),
        ] {
            assert_eq!(got.dims(), &[lens.len(), hq, d]);
            assert_eq!(got.dtype(), dtype);
            let got = got
                .to_dtype(DType::F64)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f64>())
                .unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= tol,
                    "{what} {dtype:?} on {dev:?}, ({hq}, {hkv}, {d}, block {bs}) {lens:?} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn paged_decode_attention_equals_dense_attention() {
    // GQA (6 query heads over 2 KV heads), rows of different lengths, none a multiple of the
    // block size but one; then a step large enough for the CPU kernel's threads (16 query
    // heads over 4, 4,100 keys) and for several key chunks of the CUDA kernel.
    check_paged_attention((6, 2, 16, 4), &[1, 5, 8, 11, 13]);
    check_paged_attention((16, 4, 64, 16), &[1700, 1, 1333, 1066]);
    // GQA ratios 1, 2 and 7 at head_dim 64 and 128; blocks of 1, 5, 16 and 32 slots; rows of
    // one token, rows ending exactly on a block boundary, and on or just past a chunk boundary.
    check_paged_attention((4, 4, 64, 1), &[1, 7, 256, 300]);
    check_paged_attention((8, 4, 128, 16), &[1, 16, 48, 513, 200]);
    check_paged_attention((14, 2, 128, 5), &[1, 10, 255, 257, 40]);
    check_paged_attention((7, 1, 64, 32), &[64, 1, 31, 600]);
    // Groups of 16 and 32 query heads at head_dim 256 (the CUDA kernel's largest: several
    // passes over the values, shorter key chunks to fit shared memory), an odd head_dim (80),
    // and one past the CUDA kernel (320: the composition serves it).
    check_paged_attention((16, 1, 256, 16), &[300, 3]);
    check_paged_attention((32, 1, 256, 8), &[200, 1]);
    check_paged_attention((4, 2, 80, 16), &[33, 290]);
    check_paged_attention((2, 1, 320, 4), &[5, 9]);
    // A step with enough rows for the CUDA kernel's full chunks (256 keys, one per row): 128
    // rows of 1 to 256 keys.
    let many: Vec<usize> = (0..128).map(|i| 1 + (i * 37) % 256).collect();
    check_paged_attention((4, 2, 64, 16), &many);
    let dev = Device::Cpu;
    let (hq, hkv, d, bs, scale) = (6, 2, 16, 4, 0.25);
    // A table too short for its row, or a row reading past the pool, is an error.
    let e = PagedLayout::new(bs, vec![vec![0]], vec![5]).unwrap_err();
    assert!(e.to_string().contains("row 0 attends to 5 tokens"), "{e}");
    let q = Tensor::zeros((1, hq, d), DType::F32, &dev).unwrap();
    let pool = Tensor::zeros((8, hkv, d), DType::F32, &dev).unwrap();
    let layout = PagedLayout::new(bs, vec![vec![5]], vec![2]).unwrap();
    let e = paged_decode_attention(&q, &pool, &pool, &layout, scale).unwrap_err();
    assert!(
        e.to_string().contains("reads slot 21 of a pool of 8"),
        "{e}"
    );
}

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
        "the_samples_of_a_request_hold_its_prompt_blocks_once",
        "outputs_do_not_depend_on_the_block_size",
        "paged_decode_over_long_rows_matches_the_scorer",
        "the_decode_layer_folds_its_norms_only_when_switched_on",
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

/// `log softmax(x / t)` of one row, in f64.
fn log_softmax_f64(x: &[f64], t: f64) -> Vec<f64> {
    let m = x.iter().map(|v| v / t).fold(f64::NEG_INFINITY, f64::max);
    let lse = x.iter().map(|v| (v / t - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|v| v / t - lse).collect()
}

/// The f64 inverse CDF over `exp(logp)`: the first id whose cumulative probability exceeds
/// `u · Σp` (with p > 0), and how far `u · Σp` is from the nearest CDF boundary (a draw
/// that close may fall on either side in f32).
fn inverse_cdf_reference(logp: &[f64], u: f64) -> (u32, f64) {
    let p: Vec<f64> = logp.iter().map(|l| l.exp()).collect();
    let target = u * p.iter().sum::<f64>();
    let (mut acc, mut pick, mut margin) = (0.0, None, f64::INFINITY);
    for (i, &pi) in p.iter().enumerate() {
        acc += pi;
        if pi > 0.0 {
            margin = margin.min((acc - target).abs());
            if pick.is_none() && acc > target {
                pick = Some(i);
            }
        }
    }
    let last = p.iter().rposition(|&pi| pi > 0.0).unwrap();
    (pick.unwrap_or(last) as u32, margin)
}

/// The filters' kept set of one row of f64 log-probs, written from their definitions
/// (transformers' order: top-k keeping ties, top-p over the top-k set renormalised keeping
/// ties, min-p against the row's max), with how close the row's values are to deciding
/// otherwise (a value or a cumulative mass that near a boundary may fall either way in f32):
/// the log-probs with dropped tokens at −∞.
fn filtered_reference(logp: &[f64], f: &SampleFilter) -> (Vec<f64>, f64) {
    let max = logp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut desc: Vec<f64> = logp.iter().copied().filter(|l| l.is_finite()).collect();
    desc.sort_by(|a, b| b.total_cmp(a));
    let mut keep = vec![true; logp.len()];
    let mut fragile = f64::INFINITY;
    let near = |cut: f64, fragile: &mut f64| {
        for &l in logp.iter().filter(|l| l.is_finite() && **l != cut) {
            *fragile = fragile.min((l - cut).abs());
        }
    };
    let mut cut_k = f64::NEG_INFINITY;
    if f.top_k > 0 && f.top_k < desc.len() {
        cut_k = desc[f.top_k - 1];
        near(cut_k, &mut fragile);
    }
    if f.top_p < 1.0 {
        let set: Vec<f64> = desc.iter().copied().filter(|&l| l >= cut_k).collect();
        let target = f.top_p * set.iter().map(|l| l.exp()).sum::<f64>();
        let mut acc = 0.0;
        let mut cut_p = max;
        for &l in &set {
            let before = acc;
            acc += l.exp();
            if acc >= target {
                cut_p = l;
                fragile = fragile.min((acc - target).min(target - before).abs() * 1e2);
                break;
            }
        }
        near(cut_p, &mut fragile);
        for (k, &l) in keep.iter_mut().zip(logp) {
            *k &= l >= cut_p;
        }
    }
    if f.min_p > 0.0 {
        let cut_m = max + f.min_p.ln();
        near(cut_m, &mut fragile);
        for (k, &l) in keep.iter_mut().zip(logp) {
            *k &= l >= cut_m;
        }
    }
    let kept = logp
        .iter()
        .zip(&keep)
        .map(|(&l, &k)| {
            if k && l >= cut_k {
                l
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    (kept, fragile)
}

/// On `$COMPOSER_TEST_DEVICE` (default `cpu`): the inverse-CDF sampler (on CUDA the device
/// kernel, f32 and bf16 logits) draws, for the same uniforms, the tokens the CPU sampler and
/// an f64 inverse CDF draw, with their log-probs, at temperatures 1 and 0.7, over vocabularies
/// of 384, 1,000 and 151,936 tokens, with no filter, top-k, top-p, min-p and all three; rows
/// with masked (−∞) tokens, uniforms 0 and next to 1.
#[test]
fn inverse_cdf_sampler_on_the_device_draws_what_the_cpu_draws() {
    let dev = common::test_device();
    let dtypes: &[DType] = if dev.is_cpu() {
        &[DType::F32]
    } else {
        &[DType::F32, DType::BF16]
    };
    let (mut draws, mut compared) = (0, 0);
    let filters = [
        SampleFilter::OFF,
        SampleFilter {
            top_k: 20,
            ..SampleFilter::OFF
        },
        SampleFilter {
            top_p: 0.9,
            ..SampleFilter::OFF
        },
        SampleFilter {
            min_p: 0.05,
            ..SampleFilter::OFF
        },
        SampleFilter {
            top_k: 50,
            top_p: 0.8,
            min_p: 0.02,
        },
    ];
    for (rows, vocab, seed) in [(48, 384, 11), (9, 1000, 12), (3, 151_936, 13)] {
        let mut x: Vec<f64> = values(rows * vocab, seed).iter().map(|v| 6.0 * v).collect();
        // Row 1: only every 7th token possible.
        for (i, v) in x[vocab..2 * vocab].iter_mut().enumerate() {
            if i % 7 != 3 {
                *v = f64::NEG_INFINITY;
            }
        }
        let mut uniforms: Vec<f64> = values(rows, seed + 100)
            .iter()
            .map(|v| (v + 1.0) / 2.0)
            .collect();
        uniforms[0] = 0.0;
        uniforms[rows - 1] = 1.0 - 1e-12;
        for &dtype in dtypes {
            let cpu = Tensor::from_vec(x.clone(), (rows, vocab), &Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap();
            // What the logits hold in `dtype`.
            let held = cpu.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
            let on_dev = cpu.to_device(&dev).unwrap();
            for (t, filter) in [1.0, 0.7].into_iter().flat_map(|t| filters.map(|f| (t, f))) {
                let (tokens, lps) = sample_inverse_cdf(&on_dev, t, &filter, &uniforms).unwrap();
                let cpu_f32 = cpu.to_dtype(DType::F32).unwrap();
                let (cpu_tokens, _) = sample_inverse_cdf(&cpu_f32, t, &filter, &uniforms).unwrap();
                assert_eq!((tokens.len(), lps.len()), (rows, rows));
                for r in 0..rows {
                    let logp = log_softmax_f64(&held[r], t);
                    let (kept, fragile) = filtered_reference(&logp, &filter);
                    let (want, cdf_margin) = inverse_cdf_reference(&kept, uniforms[r]);
                    let margin = cdf_margin.min(fragile);
                    let what = format!(
                        "{dtype:?} V={vocab} T={t} {filter:?} row {r} u={}: device {}, cpu {}, reference {want} (margin {margin:e})",
                        uniforms[r], tokens[r], cpu_tokens[r]
                    );
                    // Within 1e-6 of a CDF boundary f32 rounding may pick the neighbour.
                    draws += 1;
                    if margin > 1e-6 {
                        assert_eq!(tokens[r], want, "{what}");
                        assert_eq!(cpu_tokens[r], want, "{what}");
                        compared += 1;
                    }
                    let tok_lp = logp[tokens[r] as usize];
                    assert!(tok_lp.is_finite(), "{what}: drew a masked token");
                    if fragile > 1e-5 {
                        for (who, tok) in [("device", tokens[r]), ("cpu", cpu_tokens[r])] {
                            assert!(
                                kept[tok as usize].is_finite(),
                                "{what}: the {who} drew a token the filter drops"
                            );
                        }
                    }
                    assert!(
                        (lps[r] as f64 - tok_lp).abs() <= 1e-4,
                        "{what}: log-prob {} vs {tok_lp}",
                        lps[r]
                    );
                }
            }
        }
    }
    // Boundary cases are rare: nearly every draw was compared.
    assert!(
        compared * 10 >= draws * 9,
        "{compared} of {draws} draws compared"
    );
    // Bad input: no temperature, a uniform per row missing, a filter out of range.
    let logits = Tensor::zeros((2, 5), DType::F32, &dev).unwrap();
    let off = SampleFilter::OFF;
    let e = sample_inverse_cdf(&logits, 0.0, &off, &[0.5, 0.5]).unwrap_err();
    assert!(e.to_string().contains("temperature > 0"), "{e}");
    let e = sample_inverse_cdf(&logits, 1.0, &off, &[0.5]).unwrap_err();
    assert!(e.to_string().contains("1 uniforms for 2 rows"), "{e}");
    for bad in [
        SampleFilter { top_p: 0.0, ..off },
        SampleFilter { min_p: 1.5, ..off },
    ] {
        let e = sample_inverse_cdf(&logits, 1.0, &bad, &[0.5, 0.5]).unwrap_err();
        assert!(e.to_string().contains("top_p must be in (0, 1]"), "{e}");
    }
}
