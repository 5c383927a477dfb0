//! The async layout (`[train] mode = "async"`) end to end on a very small model, checked from
//! RUN_DIR/metrics.jsonl: the staleness bound, ordering, and that `max_staleness = 0` gives
//! exactly the sync run.

use std::path::{Path, PathBuf};

use composer_telemetry::read_metrics;
use serde_json::Value;

mod common;
use common::{all_channels_rollout, tiny_model_and_task, train_metrics, train_quietly};

/// Same shape as tests/run.rs's SMALL recipe; `[train]` comes from the caller.
const MODEL_AND_DATA: &str = concat!(
    tiny_model_and_task!(),
    all_channels_rollout!(),
    r#"

[warmup]
steps = 10
batch_size = 16
hint_fraction = 0.3

[replay]
traces = ["builtin:scripted"]
"#
);

fn recipe(dir: &Path, mode: &str, max_staleness: u64, steps: usize) -> PathBuf {
    let text = format!(
        "{MODEL_AND_DATA}\n[train]\nsteps = {steps}\nprompts_per_step = 4\nseed = 7\n\
         eval_every = 3\ncheckpoint_every = 3\nnum_iterations = 2\nmini_batches = 2\n\
         mode = \"{mode}\"\nmax_staleness = {max_staleness}\n"
    );
    let p = dir.join(format!("recipe-{mode}-{max_staleness}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn run(recipe: &Path, run_dir: &Path) -> composer_train::RunOutcome {
    train_quietly(recipe, run_dir).unwrap()
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing or not an integer in {v}"))
}

#[test]
fn async_respects_the_staleness_bound_and_orders_steps() {
    let tmp = tempfile::tempdir().unwrap();
    for k in [1u64, 2] {
        let dir = tmp.path().join(format!("async-{k}"));
        let out = run(&recipe(tmp.path(), "async", k, 6), &dir);
        assert_eq!(out.steps_completed, 6);
        assert!(dir.join("checkpoint/model.safetensors").is_file());
        assert!(dir.join("report.html").is_file());
        let lines = train_metrics(&dir);
        assert_eq!(lines.len(), 6, "one train line per step");
        let mut last_version = 0;
        for (i, l) in lines.iter().enumerate() {
            // Ordering: steps 1..=n in order, the trainer's policy version never goes back.
            assert_eq!(u(l, "step"), i as u64 + 1);
            let version = u(l, "policy_version");
            assert!(version >= last_version, "policy_version went back: {l}");
            last_version = version;
            // The bound: no consumed rollout lagged the trainer by more than k ...
            assert!(u(l, "staleness/max") <= k, "step {}: {l}", i + 1);
            assert_eq!(u(l, "staleness/bound"), k);
            let lags = l["staleness/values"].as_array().expect("staleness/values");
            assert!(!lags.is_empty(), "every step consumed something");
            // ... and none came from a version newer than the trainer's (lags are u64 >= 0,
            // and the rollout version = trainer version - lag must not exceed the step).
            for lag in lags {
                let lag = lag.as_u64().expect("lag is a non-negative integer");
                assert!(lag <= k);
                assert!(
                    lag <= i as u64,
                    "step {}: lag {lag} before any update",
                    i + 1
                );
            }
            assert!(l["staleness/mean"].as_f64().unwrap() <= k as f64);
            assert!(l.get("staleness/dropped").and_then(Value::as_u64).is_some());
            for key in [
                "idle/generator_s",
                "idle/rewarder_s",
                "idle/trainer_s",
                "time/rollout_s",
                "time/reward_s",
                "time/train_s",
                "time/sync_s",
            ] {
                assert!(l[key].as_f64().is_some_and(|x| x >= 0.0), "{key} in {l}");
            }
        }
    }
}

/// Metric values that do not depend on timing or on the layout's own bookkeeping.
fn comparable(l: &Value) -> Vec<(String, Value)> {
    l.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| {
            !k.starts_with("time/")
                && !k.starts_with("staleness/")
                && !k.starts_with("actors/")
                && !k.starts_with("idle/")
                && *k != "tokens_per_s"
                && *k != "env/latency_s"
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[test]
fn async_with_max_staleness_zero_is_the_sync_run() {
    let tmp = tempfile::tempdir().unwrap();
    let sync_dir = tmp.path().join("sync");
    let async_dir = tmp.path().join("async0");
    run(&recipe(tmp.path(), "sync", 0, 4), &sync_dir);
    run(&recipe(tmp.path(), "async", 0, 4), &async_dir);
    let a = read_metrics(&sync_dir.join("metrics.jsonl")).unwrap();
    let b = read_metrics(&async_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(a.len(), b.len(), "number of metric lines");
    for (la, lb) in a.iter().zip(&b) {
        let (ca, cb) = (comparable(la), comparable(lb));
        assert_eq!(
            ca.iter().map(|x| &x.0).collect::<Vec<_>>(),
            cb.iter().map(|x| &x.0).collect::<Vec<_>>()
        );
        for ((k, va), (_, vb)) in ca.iter().zip(&cb) {
            match (va.as_f64(), vb.as_f64()) {
                (Some(x), Some(y)) => {
                    assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{k}: {x} vs {y}")
                }
                _ => assert_eq!(va, vb, "{k}"),
            }
        }
        if lb["kind"] == "train" {
            assert_eq!(u(lb, "staleness/max"), 0, "k = 0: on-policy only");
        }
    }
}

/// Metric values that do not depend on timing (the staleness is pinned, so it is kept).
fn deterministic(l: &Value) -> Vec<(String, Value)> {
    l.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| {
            !k.starts_with("time/")
                && !k.starts_with("actors/")
                && !k.starts_with("idle/")
                && *k != "tokens_per_s"
                && *k != "env/latency_s"
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn all_metrics(dir: &Path) -> Vec<Vec<(String, Value)>> {
    read_metrics(&dir.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(deterministic)
        .collect()
}

/// With k > 0 the generator samples each step with pinned weights, so an async run is a
/// function of (recipe, seed), and 3 steps + `--resume` + 3 steps is the 6-step run exactly.
#[test]
fn async_runs_are_deterministic_and_resume_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = recipe(tmp.path(), "async", 2, 6);
    let a = tmp.path().join("a");
    assert_eq!(run(&recipe, &a).steps_completed, 6);
    let lags: Vec<u64> = train_metrics(&a)
        .iter()
        .map(|l| u(l, "staleness/max"))
        .collect();
    assert!(lags.iter().any(|&x| x > 0), "off-policy steps: {lags:?}");
    let a2 = tmp.path().join("a2");
    run(&recipe, &a2);
    assert_eq!(all_metrics(&a), all_metrics(&a2), "same seed, same run");

    let b = tmp.path().join("b");
    let first = composer_train::run_train(&composer_train::TrainOptions {
        recipe_path: Some(recipe.clone()),
        quiet: true,
        run_dir_override: Some(b.clone()),
        max_steps_override: Some(3),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(first.steps_completed, 3);
    let resumed = composer_train::run_train(&composer_train::TrainOptions {
        resume: Some(b.clone()),
        quiet: true,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(resumed.steps_completed, 6);
    assert_eq!(all_metrics(&a), all_metrics(&b), "3 + resume + 3 = 6");
}

/// DAPO dynamic sampling in the async layout: the generator drops zero-variance groups and
/// samples more rounds with the step's pinned weights (same prompts and seeds as the sync
/// loop), so with `max_staleness = 0` the run is the sync run, counts included; with k = 1 it
/// runs off-policy and still fills its batches.
#[test]
fn async_dynamic_sampling_is_the_sync_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dapo = |mode: &str, k: u64| {
        let p = recipe(tmp.path(), mode, k, 4);
        let text = std::fs::read_to_string(&p).unwrap().replacen(
            "[loss]",
            "[loss]\ndynamic_sampling = true\nmax_dynamic_sampling_rounds = 3",
            1,
        );
        let p = tmp.path().join(format!("dapo-{mode}-{k}.toml"));
        std::fs::write(&p, text).unwrap();
        p
    };
    let sync_dir = tmp.path().join("sync");
    let async_dir = tmp.path().join("async0");
    run(&dapo("sync", 0), &sync_dir);
    run(&dapo("async", 0), &async_dir);
    let a = read_metrics(&sync_dir.join("metrics.jsonl")).unwrap();
    let b = read_metrics(&async_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(a.len(), b.len(), "number of metric lines");
    for (la, lb) in a.iter().zip(&b) {
        let (ca, cb) = (comparable(la), comparable(lb));
        assert_eq!(
            ca.iter().map(|x| &x.0).collect::<Vec<_>>(),
            cb.iter().map(|x| &x.0).collect::<Vec<_>>()
        );
        for ((k, va), (_, vb)) in ca.iter().zip(&cb) {
            match (va.as_f64(), vb.as_f64()) {
                (Some(x), Some(y)) => {
                    assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{k}: {x} vs {y}")
                }
                _ => assert_eq!(va, vb, "{k}"),
            }
        }
    }
    let train = train_metrics(&async_dir);
    let dropped: u64 = train
        .iter()
        .map(|l| u(l, "dynamic_sampling/dropped_groups"))
        .sum();
    assert!(dropped > 0, "no group was dropped: the test proves nothing");
    for l in &train {
        let rounds = u(l, "dynamic_sampling/rounds");
        assert!((1..=4).contains(&rounds), "{l}");
        if u(l, "dynamic_sampling/dropped_groups") == 0 {
            assert_eq!(rounds, 1, "{l}");
        }
    }

    let off_policy = tmp.path().join("async1");
    assert_eq!(run(&dapo("async", 1), &off_policy).steps_completed, 4);
    for l in &train_metrics(&off_policy) {
        let rounds = u(l, "dynamic_sampling/rounds");
        assert!((1..=4).contains(&rounds), "{l}");
        if rounds < 4 {
            // Filled: 4 groups of the recipe's num_generations, none with zero variance.
            assert!(l["reward/std"].as_f64().unwrap() > 0.0, "{l}");
        }
    }
}

/// ReMax in the async layout: the generator samples each prompt's greedy baseline with the
/// step's pinned weights and the rewarder scores it, so with `max_staleness = 0` the run is
/// the sync run, `remax/baseline_reward` included.
#[test]
fn async_remax_is_the_sync_one() {
    let tmp = tempfile::tempdir().unwrap();
    let remax = |mode: &str| {
        let text = std::fs::read_to_string(recipe(tmp.path(), mode, 0, 3))
            .unwrap()
            .replacen("[loss]", "[loss]\nestimator = \"remax\"", 1);
        let p = tmp.path().join(format!("remax-{mode}.toml"));
        std::fs::write(&p, text).unwrap();
        p
    };
    let (sync_dir, async_dir) = (tmp.path().join("sync"), tmp.path().join("async0"));
    run(&remax("sync"), &sync_dir);
    run(&remax("async"), &async_dir);
    let a = read_metrics(&sync_dir.join("metrics.jsonl")).unwrap();
    let b = read_metrics(&async_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(a.len(), b.len(), "number of metric lines");
    for (la, lb) in a.iter().zip(&b) {
        let (ca, cb) = (comparable(la), comparable(lb));
        assert_eq!(
            ca.iter().map(|x| &x.0).collect::<Vec<_>>(),
            cb.iter().map(|x| &x.0).collect::<Vec<_>>()
        );
        for ((k, va), (_, vb)) in ca.iter().zip(&cb) {
            match (va.as_f64(), vb.as_f64()) {
                (Some(x), Some(y)) => {
                    assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{k}: {x} vs {y}")
                }
                _ => assert_eq!(va, vb, "{k}"),
            }
        }
    }
    for l in train_metrics(&async_dir) {
        assert!(l["remax/baseline_reward"].is_number(), "{l}");
    }
}
