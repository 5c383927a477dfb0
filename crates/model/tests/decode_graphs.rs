//! The rollout engine's fixed-shape decode (`EngineConfig::cuda_graphs`) on
//! `$COMPOSER_TEST_DEVICE` (default `cpu`): padded rows, the scratch block and the input buffer
//! change nothing that is sampled; on CUDA the steps are captured as graphs and replayed, also
//! after the block pool grew.

mod common;

use candle_core::{DType, Device};
use composer_model::{
    generate_with_stats, EngineConfig, EngineStats, GenerationRequest, ModelConfig, Sample,
    SamplingParams, Transformer,
};

fn params(max_new_tokens: usize, engine: EngineConfig) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        max_new_tokens,
        // Near-uniform next tokens over 16 ids: completions stop at id 3 after ~16 tokens on
        // average, so rows leave the batch at different steps and the padded size changes.
        stop_token_ids: Some(vec![3]),
        engine,
        ..Default::default()
    }
}

/// 7 requests (prompts of 3-9 tokens), 1-2 samples each: 10 rows, never a power of two
/// until the batch drains.
fn requests() -> Vec<GenerationRequest> {
    (0..7)
        .map(|i| GenerationRequest {
            prompt_ids: (0..3 + i).map(|j| ((i * 5 + j * 3) % 16) as u32).collect(),
            num_samples: 1 + i % 2,
            seed: 40 + i as u64,
        })
        .collect()
}

fn model(dev: &Device) -> Transformer {
    let mut cfg = ModelConfig::tiny_qwen2(16);
    cfg.initializer_range = 0.3;
    Transformer::random_init(&cfg, 23, dev).unwrap().0
}

fn assert_same(a: &[Vec<Sample>], b: &[Vec<Sample>], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (r, (xa, xb)) in a.iter().zip(b).enumerate() {
        for (s, (sa, sb)) in xa.iter().zip(xb).enumerate() {
            assert_eq!(sa.completion_ids, sb.completion_ids, "{what}: {r}/{s}");
            assert_eq!(sa.finish_reason, sb.finish_reason, "{what}: {r}/{s}");
            for (x, y) in sa.sampler_logprobs.iter().zip(&sb.sampler_logprobs) {
                assert!((x - y).abs() <= tol, "{what}: {r}/{s}: {x} vs {y}");
            }
        }
    }
}

/// Every decode step went through the fixed shapes; on CUDA at least one capture and more
/// replays than captures, on the CPU none.
fn assert_graph_stats(stats: &EngineStats, dev: &Device, what: &str) {
    let g = stats.graphs;
    assert_eq!(g.padded_steps, stats.decode_forwards, "{what}: {g:?}");
    if dev.is_cpu() {
        assert_eq!((g.captures, g.replays), (0, 0), "{what}: {g:?}");
    } else {
        assert!(g.captures >= 1 && g.replays > g.captures, "{what}: {g:?}");
        assert_eq!(g.captures + g.replays, g.padded_steps, "{what}: {g:?}");
    }
}

#[test]
fn fixed_shape_decode_samples_what_the_dynamic_decode_samples() {
    let dev = common::test_device();
    let model = model(&dev);
    let reqs = requests();
    // Blocks of 4 and no budget: the pool grows while rows decode (graphs captured again).
    for engine in [
        EngineConfig {
            kv_block_size: 4,
            ..Default::default()
        },
        EngineConfig {
            kv_block_size: 16,
            max_running: 5,
            kv_token_budget: 160,
            ..Default::default()
        },
    ] {
        let (dynamic, dyn_stats) = generate_with_stats(&model, &reqs, &params(40, engine)).unwrap();
        let graphs = EngineConfig {
            cuda_graphs: true,
            ..engine
        };
        let (fixed, stats) = generate_with_stats(&model, &reqs, &params(40, graphs)).unwrap();
        let what = format!("{engine:?}");
        // On CUDA the attention's key chunks follow the run's longest row, not the step's.
        let tol = if dev.is_cpu() { 1e-5 } else { 1e-4 };
        assert_same(&dynamic, &fixed, tol, &what);
        assert_graph_stats(&stats, &dev, &what);
        assert_eq!(stats.steps, dyn_stats.steps, "{what}: the same schedule");
        let lengths: Vec<usize> = fixed
            .iter()
            .flatten()
            .map(|s| s.completion_ids.len())
            .collect();
        assert!(
            lengths.iter().any(|&l| l < 40) && lengths.iter().any(|&l| l > 5),
            "{what}: rows should leave at different steps: {lengths:?}"
        );
    }
}

/// bf16 on CUDA: the replayed steps' log-probs are what the teacher-forced scorer gives the
/// sampled tokens (a stale input or a wrong slot would move them far).
#[test]
fn replayed_bf16_steps_match_the_scorer() {
    let dev = common::test_device();
    if dev.is_cpu() {
        return;
    }
    let model = model(&dev).to_dtype(DType::BF16).unwrap();
    let reqs = requests();
    let engine = EngineConfig {
        kv_block_size: 4,
        cuda_graphs: true,
        ..Default::default()
    };
    let (out, stats) = generate_with_stats(&model, &reqs, &params(40, engine)).unwrap();
    assert_graph_stats(&stats, &dev, "bf16");
    for (r, samples) in reqs.iter().zip(&out) {
        for s in samples {
            let tail = common::scored_completion(&model, &r.prompt_ids, s);
            assert_eq!(tail.len(), s.sampler_logprobs.len());
            for (a, b) in tail.iter().zip(&s.sampler_logprobs) {
                assert!((a - b).abs() <= 0.1, "scored {a} vs sampled {b}");
            }
        }
    }
}

/// A model whose decode step cannot take fixed shapes (candle's ops, whose shapes follow each
/// step's rows, instead of the training kernels) is refused before any work, naming the key.
#[test]
fn cuda_graphs_on_a_model_without_fixed_shapes_is_refused() {
    let mut model = model(&Device::Cpu);
    model.training_kernels = false;
    let engine = EngineConfig {
        cuda_graphs: true,
        ..Default::default()
    };
    let e = generate_with_stats(&model, &requests(), &params(4, engine)).unwrap_err();
    assert!(e.to_string().contains("cuda_graphs = false"), "{e}");
}
