//! The rollout engine's paged KV cache: the paged decode attention (CPU kernel and the
//! gathering composition other devices use) against a dense reference, a request's samples
//! holding its prompt's blocks once, the block budget, and the block size as a knob.

mod common;

use candle_core::{DType, Device, Tensor};
use common::fixture;
use composer_model::ops::{paged_decode_attention, paged_decode_attention_composed, PagedLayout};
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

/// The CPU kernel and the gathering composition against [`reference`], in f32 and f64, for
/// `(heads, kv_heads, head_dim, block_size)` and row lengths `lens`, the rows' blocks
/// scattered over the pool in no order.
fn check_paged_attention((hq, hkv, d, bs): (usize, usize, usize, usize), lens: &[usize]) {
    let dev = Device::Cpu;
    let lens = lens.to_vec();
    let num_blocks = lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 3;
    let mut free: Vec<u32> = (0..num_blocks as u32).rev().collect();
    free.rotate_left(7);
    let tables: Vec<Vec<u32>> = lens
        .iter()
        .map(|&l| (0..l.div_ceil(bs)).map(|_| free.pop().unwrap()).collect())
        .collect();
    let slot = |b: usize, j: usize| tables[b][j / bs] as usize * bs + j % bs;
    let slots = num_blocks * bs;
    let (qv, kv, vv) = (
        values(lens.len() * hq * d, 1),
        values(slots * hkv * d, 2),
        values(slots * hkv * d, 3),
    );
    let scale = 1.0 / (d as f64).sqrt();
    let want = reference(&qv, &kv, &vv, (hq, hkv, d), &lens, &slot, scale);
    for dtype in [DType::F32, DType::F64] {
        let t = |x: &[f64], shape: (usize, usize, usize)| {
            Tensor::from_vec(x.to_vec(), shape, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let q = t(&qv, (lens.len(), hq, d));
        let (k, v) = (t(&kv, (slots, hkv, d)), t(&vv, (slots, hkv, d)));
        let layout = PagedLayout::new(bs, tables.clone(), lens.clone()).unwrap();
        let kernel = paged_decode_attention(&q, &k, &v, &layout, scale).unwrap();
        let composed = paged_decode_attention_composed(&q, &k, &v, &layout, scale).unwrap();
        let tol = if dtype == DType::F32 { 2e-6 } else { 1e-12 };
        for (what, got) in [("kernel", kernel), ("composed", composed)] {
            assert_eq!(got.dims(), &[lens.len(), hq, d]);
            let got = got
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= tol,
                    "{what} {dtype:?} {lens:?} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn paged_decode_attention_equals_dense_attention() {
    // GQA (6 query heads over 2 KV heads), rows of different lengths, none a multiple of the
    // block size but one; then a step large enough for the kernel's threads (16 query heads
    // over 4, 4,100 keys).
    check_paged_attention((6, 2, 16, 4), &[1, 5, 8, 11, 13]);
    check_paged_attention((16, 4, 64, 16), &[1700, 1, 1333, 1066]);
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

#[test]
fn outputs_do_not_depend_on_the_block_size() {
    let model = Transformer::load(&fixture("qwen2-tiny"), &Device::Cpu, DType::F32).unwrap();
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
