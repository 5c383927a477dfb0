//! The frozen reference policy (KL, DPO, EMA sync) and DAPO dynamic sampling.

use super::*;

#[test]
fn kl_to_a_frozen_reference_and_dpo_against_it() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = small_recipe(
        tmp.path(),
        "beta = 0.05\nsync_ref_model = true\nref_model_sync_steps = 2\nref_model_mixup_alpha = 0.5\n",
        "[train]\nsteps = 4\nprompts_per_step = 4\nseed = 3\neval_every = 0\ncheckpoint_every = 2\n",
    );
    let run = tmp.path().join("run");
    run_train(&opts(&recipe, &run)).unwrap();
    let lines = train_metrics(&run);
    assert_eq!(lines.len(), 4);
    // Step 1 starts at π = π_ref: KL 0; later steps move away from the frozen reference.
    let kl: Vec<f64> = lines.iter().map(|l| l["kl"].as_f64().unwrap()).collect();
    assert!(kl[0].abs() < 1e-6, "{kl:?}");
    assert!(kl[1..].iter().any(|k| *k > 1e-7), "{kl:?}");
    // DPO against a frozen reference is not log 2 once the policy has moved.
    let dpo: Vec<f64> = lines
        .iter()
        .filter(|l| l["replay/dpo_pairs"].as_u64().unwrap() > 0)
        .map(|l| l["loss/replay_dpo"].as_f64().unwrap())
        .collect();
    assert!(!dpo.is_empty());
    assert!(
        dpo.iter()
            .any(|d| (d - std::f64::consts::LN_2).abs() > 1e-5),
        "{dpo:?}"
    );
    assert!(run.join("checkpoint/reference.safetensors").is_file());
}

/// A checkpoint's weights file as f64 vectors by name.
fn load_weights(path: &Path) -> std::collections::BTreeMap<String, Vec<f64>> {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let v = t
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            (k, v)
        })
        .collect()
}

fn max_abs_diff(
    a: &std::collections::BTreeMap<String, Vec<f64>>,
    b: &std::collections::BTreeMap<String, Vec<f64>>,
) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .flat_map(|(k, x)| x.iter().zip(&b[k]).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f64::max)
}

#[test]
fn sync_ref_model_mixes_the_policy_into_the_reference_on_sync_steps_only() {
    // TRL's SyncRefModelCallback: every `ref_model_sync_steps` steps,
    // π_ref ← α·π + (1 − α)·π_ref; untouched on the other steps. Checked on the
    // checkpointed weights after steps 1 (no sync), 2 (sync) and 3 (no sync).
    let tmp = tempfile::tempdir().unwrap();
    let alpha = 0.3;
    let recipe = small_recipe(
        tmp.path(),
        &format!(
            "beta = 0.05\nsync_ref_model = true\nref_model_sync_steps = 2\nref_model_mixup_alpha = {alpha}\n"
        ),
        "[train]\nsteps = 3\nprompts_per_step = 4\nseed = 3\neval_every = 0\ncheckpoint_every = 1\n",
    );
    let run = tmp.path().join("run");
    let snapshot = || {
        let c = run.join("checkpoint");
        (
            load_weights(&c.join("model.safetensors")),
            load_weights(&c.join("reference.safetensors")),
        )
    };
    let mut o = opts(&recipe, &run);
    o.max_steps_override = Some(1);
    run_train(&o).unwrap();
    let (_, r1) = snapshot();
    let mut states = Vec::new();
    for stop in [2, 3] {
        let resumed = TrainOptions {
            resume: Some(run.clone()),
            quiet: true,
            max_steps_override: Some(stop),
            ..Default::default()
        };
        assert_eq!(run_train(&resumed).unwrap().steps_completed, stop);
        states.push(snapshot());
    }
    let (p2, r2) = &states[0];
    let (p3, r3) = &states[1];
    // Step 2 synced: r2 = α·p2 + (1 − α)·r1, and that moved the reference.
    let mixed: std::collections::BTreeMap<String, Vec<f64>> = r1
        .iter()
        .map(|(k, r)| {
            let p = &p2[k];
            (
                k.clone(),
                r.iter()
                    .zip(p)
                    .map(|(r, p)| alpha * p + (1.0 - alpha) * r)
                    .collect(),
            )
        })
        .collect();
    assert!(
        max_abs_diff(r2, &mixed) < 1e-6,
        "{}",
        max_abs_diff(r2, &mixed)
    );
    assert!(
        max_abs_diff(r2, &r1) > 1e-5,
        "the sync did not move the reference"
    );
    // Step 3 did not sync: the reference is unchanged though the policy moved.
    assert_eq!(max_abs_diff(r3, r2), 0.0);
    assert!(max_abs_diff(p3, p2) > 1e-6);
}

#[test]
fn dynamic_sampling_fills_the_batch_with_nonzero_variance_groups() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = small_recipe(
        tmp.path(),
        "dynamic_sampling = true\nmax_dynamic_sampling_rounds = 3\n",
        "[train]\nsteps = 3\nprompts_per_step = 4\nseed = 5\neval_every = 0\ncheckpoint_every = 0\n",
    );
    let run = tmp.path().join("run");
    run_train(&opts(&recipe, &run)).unwrap();
    for l in train_metrics(&run) {
        let dropped = l["dynamic_sampling/dropped_groups"].as_u64().unwrap();
        let rounds = l["dynamic_sampling/rounds"].as_u64().unwrap();
        assert!((1..=4).contains(&rounds), "{l}");
        let n = l["completions/lengths"].as_array().unwrap().len();
        if rounds < 4 {
            // The batch was filled: 4 groups of 4, none with zero reward variance.
            assert_eq!(n, 16, "{l}");
        }
        if dropped == 0 {
            assert_eq!(rounds, 1);
        }
        let reward_std = l["reward/std"].as_f64().unwrap();
        assert!(reward_std > 0.0 || n == 16, "{l}");
    }
}
