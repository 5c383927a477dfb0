//! End-to-end runs of the loop on a very small model: determinism, resume equivalence, a
//! kill in the middle of a checkpoint write, non-finite steps, reward rising.

use std::path::{Path, PathBuf};
use std::process::Command;

use composer_telemetry::read_metrics;
use composer_train::{run_train, TrainOptions};
use serde_json::Value;

mod common;
use common::{all_channels_rollout, tiny_model_and_task};

const SMALL: &str = concat!(
    tiny_model_and_task!(),
    all_channels_rollout!(),
    r#"

[train]
steps = 6
prompts_per_step = 4
seed = 7
eval_every = 3
checkpoint_every = 3
num_iterations = 2
mini_batches = 2

[warmup]
steps = 20
batch_size = 16
hint_fraction = 0.3

[replay]
traces = ["builtin:scripted"]
"#
);

fn write_recipe(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("recipe.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn opts(recipe: &Path, run_dir: &Path) -> TrainOptions {
    TrainOptions {
        recipe_path: Some(recipe.to_path_buf()),
        resume: None,
        quiet: true,
        run_dir_override: Some(run_dir.to_path_buf()),
        max_steps_override: None,
        overwrite: false,
    }
}

/// Metric lines without wall-clock fields.
fn stable_metrics(run_dir: &Path) -> Vec<Vec<(String, Value)>> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|r| {
            r.as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| {
                    !k.starts_with("time/") && *k != "tokens_per_s" && *k != "env/latency_s"
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .collect()
}

fn assert_close(a: &[Vec<(String, Value)>], b: &[Vec<(String, Value)>]) {
    assert_eq!(a.len(), b.len(), "number of metric lines");
    for (la, lb) in a.iter().zip(b) {
        assert_eq!(la.len(), lb.len(), "{la:?} vs {lb:?}");
        for ((ka, va), (kb, vb)) in la.iter().zip(lb) {
            assert_eq!(ka, kb);
            match (va.as_f64(), vb.as_f64()) {
                (Some(x), Some(y)) => {
                    assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "{ka}: {x} vs {y}")
                }
                _ => assert_eq!(va, vb, "{ka}"),
            }
        }
    }
}

#[test]
fn same_seed_same_metrics_and_resume_is_equivalent() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = write_recipe(tmp.path(), SMALL);
    let a = tmp.path().join("a");
    let out_a = run_train(&opts(&recipe, &a)).unwrap();
    assert_eq!(out_a.steps_completed, 6);
    assert!(a.join("report.html").is_file());
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "optimizer.safetensors",
        "trainer_state.json",
        "recipe.toml",
    ] {
        assert!(a.join("checkpoint").join(f).is_file(), "{f}");
    }
    // Same seed, same recipe: same run.
    let a2 = tmp.path().join("a2");
    run_train(&opts(&recipe, &a2)).unwrap();
    assert_close(&stable_metrics(&a), &stable_metrics(&a2));

    // 3 steps, then resume to 6: same metrics as the 6-step run.
    let b = tmp.path().join("b");
    let mut o = opts(&recipe, &b);
    o.max_steps_override = Some(3);
    assert_eq!(run_train(&o).unwrap().steps_completed, 3);
    let resumed = run_train(&TrainOptions {
        resume: Some(b.clone()),
        quiet: true,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(resumed.steps_completed, 6);
    assert_close(&stable_metrics(&a), &stable_metrics(&b));
}

/// Runs one test of this binary in a child process with extra environment variables.
fn run_child(test: &str, envs: &[(&str, String)]) -> std::process::Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("COMPOSER_TRAIN_TEST_CHILD", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// Child body: trains the SMALL recipe into $CHILD_RUN_DIR (only inside `run_child`).
#[test]
fn child_train() {
    let Ok(dir) = std::env::var("CHILD_RUN_DIR") else {
        return;
    };
    if std::env::var("COMPOSER_TRAIN_TEST_CHILD").is_err() {
        return;
    }
    let dir = PathBuf::from(dir);
    // CHILD_MODE=async: the same recipe in the async layout.
    let text = match std::env::var("CHILD_MODE").as_deref() {
        Ok("async") => {
            let t = SMALL.replace(
                "[train]\n",
                "[train]\nmode = \"async\"\nmax_staleness = 1\n",
            );
            assert_ne!(t, SMALL, "SMALL has no [train] section");
            t
        }
        _ => SMALL.to_string(),
    };
    let recipe = write_recipe(dir.parent().unwrap(), &text);
    match run_train(&opts(&recipe, &dir)) {
        Ok(o) => println!(
            "CHILD OK steps={} skipped={}",
            o.steps_completed, o.skipped_steps
        ),
        Err(e) => {
            println!("CHILD ERR {e:#}");
            std::process::exit(3);
        }
    }
}

#[test]
fn killed_mid_checkpoint_resumes_from_previous_complete_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let out = run_child(
        "child_train",
        &[
            ("CHILD_RUN_DIR", dir.display().to_string()),
            (composer_train::checkpoint::ABORT_HOOK_ENV, "6".into()),
        ],
    );
    assert!(
        !out.status.success(),
        "the child must die mid-write: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // The step-3 checkpoint is intact, the half-written one is not picked up.
    let ck = composer_train::checkpoint::find_checkpoint(&dir).unwrap();
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 3);
    let resumed = run_train(&TrainOptions {
        resume: Some(dir.clone()),
        quiet: true,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(resumed.steps_completed, 6);
    // And the result equals an uninterrupted run.
    let clean = tmp.path().join("clean");
    let recipe = write_recipe(tmp.path(), SMALL);
    run_train(&opts(&recipe, &clean)).unwrap();
    assert_close(&stable_metrics(&clean), &stable_metrics(&dir));
}

#[test]
fn non_finite_steps_are_skipped_then_the_run_stops() {
    let tmp = tempfile::tempdir().unwrap();
    // One NaN step: skipped and counted, the run finishes.
    let dir = tmp.path().join("one");
    let out = run_child(
        "child_train",
        &[
            ("CHILD_RUN_DIR", dir.display().to_string()),
            (composer_train::trainer::NAN_HOOK_ENV, "2".into()),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD OK steps=6 skipped=1"),
        "{stdout}"
    );
    let lines = read_metrics(&dir.join("metrics.jsonl")).unwrap();
    let s2 = lines
        .iter()
        .find(|r| r["step"] == 2 && r["kind"] == "train")
        .unwrap();
    assert_eq!(s2["skipped"], true);
    // Three in a row: the run stops, naming the reason and the last good checkpoint.
    let dir = tmp.path().join("three");
    let out = run_child(
        "child_train",
        &[
            ("CHILD_RUN_DIR", dir.display().to_string()),
            (composer_train::trainer::NAN_HOOK_ENV, "4,5,6".into()),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains("non-finite") && stdout.contains("checkpoint"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&dir.join("checkpoint").display().to_string()),
        "{stdout}"
    );
}

#[test]
fn non_finite_async_steps_are_skipped_then_the_run_stops() {
    let tmp = tempfile::tempdir().unwrap();
    let child = |name: &str, steps: &str| {
        let dir = tmp.path().join(name);
        let out = run_child(
            "child_train",
            &[
                ("CHILD_RUN_DIR", dir.display().to_string()),
                ("CHILD_MODE", "async".into()),
                (composer_train::trainer::NAN_HOOK_ENV, steps.into()),
            ],
        );
        (dir, out)
    };
    // One NaN step: skipped and counted, the run finishes.
    let (dir, out) = child("one", "2");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD OK steps=6 skipped=1"),
        "{stdout}"
    );
    let lines = read_metrics(&dir.join("metrics.jsonl")).unwrap();
    let s2 = lines
        .iter()
        .find(|r| r["step"] == 2 && r["kind"] == "train")
        .unwrap();
    assert_eq!(s2["skipped"], true);
    // The async layout ran (only it reports what its trainer actor consumed).
    assert!(s2.get("actors/consumed").is_some(), "not async: {s2}");
    // Three in a row: the run stops, naming the reason and the last good checkpoint.
    let (dir, out) = child("three", "4,5,6");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains("non-finite") && stdout.contains("checkpoint"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&dir.join("checkpoint").display().to_string()),
        "{stdout}"
    );
}

#[test]
fn bad_checkpoint_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let e = format!(
        "{:#}",
        run_train(&TrainOptions {
            resume: Some(tmp.path().to_path_buf()),
            ..Default::default()
        })
        .unwrap_err()
    );
    assert!(e.contains("no complete checkpoint"), "{e}");
    let ck = tmp.path().join("checkpoint");
    std::fs::create_dir_all(&ck).unwrap();
    std::fs::write(ck.join("trainer_state.json"), "{not json").unwrap();
    let e = format!(
        "{:#}",
        run_train(&TrainOptions {
            resume: Some(tmp.path().to_path_buf()),
            ..Default::default()
        })
        .unwrap_err()
    );
    assert!(e.contains("trainer_state.json"), "{e}");
}

#[test]
fn reward_rises_in_a_short_run() {
    let tmp = tempfile::tempdir().unwrap();
    let text = SMALL
        .replace("steps = 6\n", "steps = 60\n")
        .replace("hidden_size = 16", "hidden_size = 32")
        .replace("intermediate_size = 32", "intermediate_size = 64")
        .replace(
            "num_iterations = 2\nmini_batches = 2",
            "num_iterations = 1\nmini_batches = 1",
        )
        .replace("checkpoint_every = 3", "checkpoint_every = 0")
        .replace("prompts_per_step = 4", "prompts_per_step = 16")
        .replace("[warmup]\nsteps = 20", "[warmup]\nsteps = 150")
        + "\n[optimizer]\nlr = 2e-3\n";
    let recipe = write_recipe(tmp.path(), &text);
    let dir = tmp.path().join("r");
    run_train(&opts(&recipe, &dir)).unwrap();
    let rewards: Vec<f64> = read_metrics(&dir.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == "train")
        .map(|r| r["reward/mean"].as_f64().unwrap())
        .collect();
    let first: f64 = rewards[..10].iter().sum::<f64>() / 10.0;
    let last: f64 = rewards[rewards.len() - 10..].iter().sum::<f64>() / 10.0;
    assert!(
        last > first + 0.05,
        "reward should rise: first {first:.3}, last {last:.3}, all {rewards:?}"
    );
}

fn shared_dir() -> PathBuf {
    std::env::var("COMPOSER_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared")))
}

#[test]
fn hf_checkpoint_trains_on_a_jsonl_dataset_and_saves_loadable_weights() {
    let fixture = shared_dir().join("fixtures/hf-tiny/qwen2-tiny");
    if !fixture.join("config.json").is_file() {
        assert!(
            std::env::var("CI").is_err(),
            "fixture {} missing",
            fixture.display()
        );
        println!("SKIPPED: fixture {} not found", fixture.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("train.jsonl");
    let rows: String = (0..8)
        .map(|i| format!("{{\"prompt\": \"{i}+1=\", \"answer\": \"{}\"}}\n", i + 1))
        .collect();
    std::fs::write(&data, rows).unwrap();
    let text = format!(
        "[model]\npath = {:?}\n[data]\ndataset = {:?}\neval_size = 2\n[rollout]\nnum_generations = 2\nmax_completion_length = 3\n\
         [loss]\nhint_weight = 1.0\n[train]\nsteps = 2\nprompts_per_step = 2\neval_every = 1\ncheckpoint_every = 1\n",
        fixture.display().to_string(),
        data.display().to_string()
    );
    let recipe = write_recipe(tmp.path(), &text);
    let dir = tmp.path().join("run");
    let out = run_train(&opts(&recipe, &dir)).unwrap();
    assert_eq!(out.steps_completed, 2);
    let ck = dir.join("checkpoint");
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "qwen2");
    composer_model::Transformer::load(&ck, &candle_core::Device::Cpu, candle_core::DType::F32)
        .unwrap();
    // Resume continues from the HF-format checkpoint.
    let resumed = run_train(&TrainOptions {
        resume: Some(dir.clone()),
        quiet: true,
        max_steps_override: Some(3),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(resumed.steps_completed, 3);
}

/// A warm-up example longer than the model's context is refused naming its file and row when
/// the run opens, before any step; a file that fits is what the warm-up trains on.
#[test]
fn an_overlong_warmup_example_is_refused_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("sft.jsonl");
    let long = "7".repeat(300);
    std::fs::write(
        &data,
        format!(
            "{{\"prompt\": \"1+1=\", \"completion\": \"2\"}}\n{{\"prompt\": \"2+2=\", \"completion\": \"{long}\"}}\n"
        ),
    )
    .unwrap();
    let model_and_task = tiny_model_and_task!().replacen(
        "intermediate_size = 32\n",
        "intermediate_size = 32\nmax_position_embeddings = 64\n",
        1,
    );
    let text = format!(
        "{model_and_task}{}\n[train]\nsteps = 1\nprompts_per_step = 2\n\n\
         [warmup]\nsteps = 2\nbatch_size = 2\ndataset = {:?}\n",
        all_channels_rollout!(),
        data.display().to_string()
    );
    let recipe = write_recipe(tmp.path(), &text);
    let e = format!(
        "{:#}",
        run_train(&opts(&recipe, &tmp.path().join("run"))).unwrap_err()
    );
    assert!(
        e.contains("sft.jsonl row 2") && e.contains("context of 64"),
        "{e}"
    );
    assert!(!tmp.path().join("run/metrics.jsonl").exists());
    // Without the long row the same run warms up on the file's examples and trains.
    std::fs::write(&data, "{\"prompt\": \"1+1=\", \"completion\": \"2\"}\n").unwrap();
    let out = run_train(&opts(&recipe, &tmp.path().join("run"))).unwrap();
    assert_eq!(out.steps_completed, 1);
    assert!(out.warmup_accuracy.is_some());
}
