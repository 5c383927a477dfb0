//! `grpo_passk` and `remax` as recipe-selectable estimators: their serde names are verl's, and
//! `compute_advantages` / `compute_remax_advantages` give the free functions' values (those
//! are checked against verl itself in `upstream_parity.rs`) with the recipe's reward weights.
use composer_loss::*;

#[test]
fn estimators_are_spelled_as_verl_spells_them() {
    for (name, e) in [
        ("grpo_passk", AdvantageEstimator::GrpoPassk),
        ("remax", AdvantageEstimator::Remax),
    ] {
        let parsed: AdvantageEstimator = serde_json::from_str(&format!("\"{name}\"")).unwrap();
        assert_eq!(parsed, e);
    }
}

#[test]
fn grpo_passk_through_compute_advantages_is_the_library_function() {
    // Two reward functions, weights 1 and 0.5; groups of 3.
    let rpf = vec![
        vec![1.0, 0.0],
        vec![0.0, 1.0],
        vec![1.0, 1.0],
        vec![0.0, 0.0],
        vec![0.0, 1.0],
        vec![0.0, 0.0],
    ];
    let weights = [1.0, 0.5];
    let summed: Vec<f64> = rpf
        .iter()
        .map(|r: &Vec<f64>| r[0] * weights[0] + r[1] * weights[1])
        .collect();
    for (scale, norm) in [(StdScaling::Group, true), (StdScaling::None, false)] {
        let cfg = AdvantageConfig {
            estimator: AdvantageEstimator::GrpoPassk,
            reward_weights: Some(weights.to_vec()),
            scale_rewards: scale,
            ..AdvantageConfig::verl()
        };
        let got = compute_advantages(&cfg, &rpf, &[1; 6], 3).unwrap();
        let want = grpo_passk_advantages(&summed, 3, norm, 1e-6).unwrap();
        assert_eq!(got, want);
        // Only each group's best completion is non-zero.
        assert_eq!(got.iter().filter(|a| **a != 0.0).count(), 2, "{got:?}");
    }
    let batch = AdvantageConfig {
        estimator: AdvantageEstimator::GrpoPassk,
        scale_rewards: StdScaling::Batch,
        ..Default::default()
    };
    let e = compute_advantages(&batch, &rpf, &[1; 6], 3).unwrap_err();
    assert!(e.to_string().contains("scale_rewards"), "{e}");
}

#[test]
fn remax_subtracts_the_weighted_greedy_reward() {
    let cfg = AdvantageConfig {
        estimator: AdvantageEstimator::Remax,
        reward_weights: Some(vec![2.0, 1.0]),
        ..Default::default()
    };
    let rpf = vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![1.0, 1.0]];
    let base = vec![vec![0.0, 1.0], vec![0.0, 1.0], vec![1.0, 0.0]];
    let got = compute_remax_advantages(&cfg, &rpf, &base).unwrap();
    assert_eq!(
        got,
        remax_advantages(&[2.0, 1.0, 3.0], &[1.0, 1.0, 2.0]).unwrap()
    );
    assert_eq!(got, vec![1.0, 0.0, 1.0]);
    // Without baselines the general entry point refuses, naming the key.
    let e = compute_advantages(&cfg, &rpf, &[1; 3], 3).unwrap_err();
    assert!(e.to_string().contains("estimator"), "{e}");
    let e = compute_remax_advantages(&cfg, &rpf, &base[..2]).unwrap_err();
    assert!(e.to_string().contains("baselines_per_func"), "{e}");
}
