//! Unit tests of the estimator: the hand-computed example of PLAN.md, layouts, memory, CLI.

use super::*;
use crate::estimate::*;

/// A 20-step synthetic run: walls rollout 6, reward 1.5, train 2, sync 0.5 of a 10 s step,
/// 4000 trained tokens per step (written as the trainer's running total).
fn synthetic_run(dir: &std::path::Path) {
    let mut w = composer_telemetry::MetricsWriter::create(&dir.join("metrics.jsonl")).unwrap();
    for step in 1..=20u64 {
        w.write(&serde_json::json!({
            "kind": "train", "step": step, "policy_version": step,
            "completions/mean_length": 300.0 + 5.0 * step as f64,
            "completions/lengths": [100 + step, 300, 500, 900 + 10 * step],
            "time/rollout_s": 6.0, "time/reward_s": 1.5, "time/train_s": 2.0,
            "time/sync_s": 0.5, "time/step_s": 10.0, "tokens_per_s": 1500.0,
            "trained_tokens": 4000 * step, "env/latency_s": [0.2, 0.4],
            "staleness/values": [0, 1, (step % 3)], "staleness/max": step % 3,
            "idle/trainer_s": 0.5,
        }))
        .unwrap();
    }
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-12)
}

/// The hand-computed example of PLAN.md.
fn example() -> WorkloadShape {
    WorkloadShape {
        params: 1e9,
        mean_output_tokens: 512.0,
        p95_output_tokens: 1024.0,
        prompt_tokens: 256.0,
        samples_per_step: 64,
        env_latency_mean_s: 0.5,
        env_latency_p95_s: 1.0,
        env_concurrency: Some(16),
        env_calls_per_sample: 1.0,
        staleness_tolerance: 0,
        gpus: 1,
        gpu: GpuKind::H100,
        arch: Some(ModelArch {
            layers: 16,
            hidden: 2048,
            kv_heads: 8,
            head_dim: 64,
        }),
        mfu: 0.4,
        weight_copies: 1,
    }
}

#[test]
fn hand_computed_example() {
    // kv = 2·16·8·64·2 = 32768 B/token. Weights W = 2·1e9 = 2e9 B (fits half of 80 GB: tp 1).
    // KV room 0.9·80e9 − 2e9 = 70e9 B; one full sequence (256 + 1024)·32768 = 41.94 MB →
    // 1668 slots ≥ 64 samples: one wave, b = 64.
    // Decode step: bytes = 2e9 + 64·32768·(256 + 512/2) = 3,073,741,824 → /3.35e12 =
    // 9.17535e-4 s; compute 2·1e9·64 / (989e12·0.4) = 3.2356e-4 s → memory-bound.
    // Decode 1024 · 9.17535e-4 = 0.939556 s; prefill 2·1e9·64·256 / 3.956e14 = 0.082831 s.
    // τ_R = 1.022387 s.
    // τ_V = 1 call · ⌈64/16⌉ waves · 1.0 s p95 = 4.0 s.
    // τ_T = 6·1e9·64·(256 + 512) / (1·989e12·0.4) = 2.94912e14 / 3.956e14 = 0.745480 s.
    // τ_S = 2e9 / 450e9 = 0.004444 s.
    // step = 5.772311 s; binding: reward, 4.0 / 5.772311 = 69.3%.
    let plan = plan_from_shape(&example()).unwrap();
    assert!(
        close(plan.walls.rollout_s, 1.022387, 1e-5),
        "{}",
        plan.walls.rollout_s
    );
    assert!(close(plan.walls.reward_s, 4.0, 1e-12));
    assert!(
        close(plan.walls.train_s, 0.745480, 1e-5),
        "{}",
        plan.walls.train_s
    );
    assert!(close(plan.walls.sync_s, 0.0044444, 1e-4));
    assert!(close(plan.step_s, 5.772311, 1e-5), "{}", plan.step_s);
    assert_eq!(plan.binding_wall, "reward");
    assert!(close(plan.binding_share, 4.0 / 5.772311, 1e-5));
    let m = plan.memory.as_ref().unwrap();
    // Trainer state 16e9 B + generator weights 2e9 B = 18e9 ≤ 72e9: fits; min GPUs ⌈16e9/72e9⌉ = 1.
    assert!(m.fits);
    assert_eq!(m.min_gpus, 1);
    assert_eq!(m.kv_bytes_per_token, 32768.0);
    // One GPU: no split possible, colocated it is.
    assert_eq!(plan.layouts.len(), 1);
    assert_eq!(plan.recommended, Layout::ColocatedSync);
    assert!(
        plan.first_knob.contains("env concurrency (now 16)"),
        "{}",
        plan.first_knob
    );
    let text = plan.to_string();
    assert!(
        text.contains("← binding") && text.contains("recommended: colocated-sync"),
        "{text}"
    );
}

#[test]
fn long_tail_rollout_with_staleness_goes_async() {
    // The CLI example: 7B, mean 2000 / p95 8000 tokens, 8 H100, staleness 2.
    let opts = PlanOptions {
        params: Some(7e9),
        mean_output: Some(2000.0),
        p95_output: Some(8000.0),
        env_latency: Some(2.0),
        gpus: Some(8),
        gpu: Some("h100".into()),
        staleness: Some(2),
        ..Default::default()
    };
    let plan = plan_from_shape(&opts.to_shape().unwrap()).unwrap();
    assert_eq!(plan.binding_wall, "rollout");
    assert_eq!(plan.layouts.len(), 3);
    // Async decodes for the mean (2000) instead of the p95 (8000) and overlaps training.
    let async_l = &plan.layouts[2];
    assert!(async_l.step_s < plan.layouts[1].step_s);
    assert_eq!(plan.recommended, Layout::BoundedAsync { max_staleness: 2 });
    // Same workload, on-policy only: colocated, with the reason naming the tolerance.
    let on_policy = plan_from_shape(
        &PlanOptions {
            staleness: Some(0),
            ..opts.clone()
        }
        .to_shape()
        .unwrap(),
    )
    .unwrap();
    assert_eq!(on_policy.recommended, Layout::ColocatedSync);
    assert!(on_policy
        .recommendation
        .contains("staleness tolerance is 0"));
    let json: serde_json::Value =
        serde_json::from_str(&plan_cli(&PlanOptions { json: true, ..opts }).unwrap()).unwrap();
    assert_eq!(json["recommended"]["layout"], "bounded-async");
    assert_eq!(json["recommended"]["max_staleness"], 2);
}

#[test]
fn memory_check_and_arch_defaults() {
    // 70B on 1 L40S: 16·70e9 = 1.12e12 B; min GPUs ⌈1.12e12 / (0.9·48e9)⌉ = ⌈25.93⌉ = 26.
    let shape = WorkloadShape {
        params: 70e9,
        gpus: 1,
        gpu: GpuKind::L40s,
        ..Default::default()
    };
    let plan = plan_from_shape(&shape).unwrap();
    let m = plan.memory.unwrap();
    assert!(!m.fits);
    assert_eq!(m.min_gpus, 26);
    assert!(plan.first_knob.starts_with("memory first"));
    // 7e9 maps to Qwen2.5-7B: 2·28·4·128·2 = 57344 B/token.
    assert_eq!(ModelArch::for_params(7e9).kv_bytes_per_token(), 57344.0);
    assert_eq!(ModelArch::for_params(5e8).layers, 24);
}

#[test]
fn bad_options_name_the_flag() {
    let err = plan_cli(&PlanOptions::default()).unwrap_err().to_string();
    assert!(err.contains("--params"), "{err}");
    let err = PlanOptions {
        params: Some(1e9),
        mean_output: Some(100.0),
        p95_output: Some(50.0),
        ..Default::default()
    }
    .to_shape()
    .unwrap_err()
    .to_string();
    assert!(err.contains("--p95-output"), "{err}");
    let err = PlanOptions {
        params: Some(1e9),
        mean_output: Some(100.0),
        gpu: Some("tpu".into()),
        ..Default::default()
    }
    .to_shape()
    .unwrap_err()
    .to_string();
    assert!(err.contains("--gpu"), "{err}");
    let err = PlanOptions {
        params: Some(-1.0),
        mean_output: Some(100.0),
        ..Default::default()
    }
    .to_shape()
    .unwrap_err()
    .to_string();
    assert!(err.contains("--params"), "{err}");
}

#[test]
fn plan_from_measured_run() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path());
    let plan = plan_from_run_with(dir.path(), Some(2)).unwrap();
    assert_eq!(plan.source, "measured");
    // Synthetic walls: rollout 6, reward 1.5, train 2, sync 0.5 of a 10 s step.
    assert_eq!(plan.binding_wall, "rollout");
    assert!(close(plan.binding_share, 0.6, 1e-12));
    assert!(close(plan.trained_tokens_per_step, 4000.0, 1e-12));
    assert!(plan.layouts[1].step_s < plan.layouts[0].step_s);
    let text = plan_cli(&PlanOptions {
        from_run: Some(dir.path().to_path_buf()),
        ..Default::default()
    })
    .unwrap();
    assert!(text.contains("measured"), "{text}");
    let err = plan_from_run(&dir.path().join("nope")).unwrap_err();
    assert!(format!("{err:#}").contains("metrics.jsonl"));
}
