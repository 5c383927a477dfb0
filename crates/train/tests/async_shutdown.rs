//! Clean shutdown: a real SIGINT (raised by the test hook at the end of a step) writes a
//! checkpoint and stops every actor, in both layouts; an injected rewarder error in async mode
//! ends the run with a clear message, no hang, and the last checkpoint intact.
//!
//! One test function: the hooks are process-wide environment variables.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use composer_telemetry::read_metrics;
use composer_train::trainer::{REWARD_ERROR_HOOK_ENV, SIGINT_HOOK_ENV};
use composer_train::{run_train, RunOutcome, TrainOptions};

mod common;
use common::tiny_model_and_task;

const RECIPE: &str = concat!(
    tiny_model_and_task!(),
    r#"
[rollout]
num_generations = 4
max_completion_length = 3

[warmup]
steps = 5
batch_size = 16

[train]
steps = 8
prompts_per_step = 4
seed = 3
eval_every = 4
checkpoint_every = 2
"#
);

fn recipe(dir: &Path, mode: &str) -> PathBuf {
    let p = dir.join(format!("recipe-{mode}.toml"));
    std::fs::write(&p, format!("{RECIPE}mode = \"{mode}\"\n")).unwrap();
    p
}

/// Runs in a thread and fails the test instead of hanging.
fn run_with_deadline(recipe: PathBuf, run_dir: PathBuf) -> anyhow::Result<RunOutcome> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = run_train(&TrainOptions {
            recipe_path: Some(recipe),
            quiet: true,
            run_dir_override: Some(run_dir),
            ..Default::default()
        });
        let _ = tx.send(r);
    });
    rx.recv_timeout(Duration::from_secs(300))
        .expect("the run hung (no result within 300 s)")
}

fn checkpoint_step(run_dir: &Path) -> u64 {
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run_dir.join("checkpoint/trainer_state.json")).unwrap(),
    )
    .unwrap();
    state["step"].as_u64().expect("trainer_state.json step")
}

#[test]
fn ctrl_c_and_actor_errors_shut_down_cleanly() {
    let tmp = tempfile::tempdir().unwrap();

    // Ctrl-C at the end of step 3 (not a checkpoint step): a checkpoint at step 3, then stop.
    std::env::set_var(SIGINT_HOOK_ENV, "3");
    for mode in ["sync", "async"] {
        let dir = tmp.path().join(format!("sigint-{mode}"));
        let out = run_with_deadline(recipe(tmp.path(), mode), dir.clone()).unwrap();
        assert!(out.interrupted.is_some(), "{mode}: interrupted");
        assert_eq!(out.steps_completed, 3, "{mode}");
        assert_eq!(
            checkpoint_step(&dir),
            3,
            "{mode}: checkpoint written on Ctrl-C"
        );
        let last = read_metrics(&dir.join("metrics.jsonl"))
            .unwrap()
            .into_iter()
            .rfind(|l| l["kind"] == "train")
            .unwrap();
        assert_eq!(last["step"], 3, "{mode}: nothing trained after Ctrl-C");
        // Resume continues from the checkpoint to the end.
        let resumed = run_train(&TrainOptions {
            resume: Some(dir.clone()),
            quiet: true,
            ..Default::default()
        });
        assert_eq!(resumed.unwrap().steps_completed, 8, "{mode}: resume");
    }
    std::env::remove_var(SIGINT_HOOK_ENV);

    // The rewarder fails on its 5th batch: a clear error naming it, the checkpoint of step 2
    // or 4 (the last one written) still complete.
    std::env::set_var(REWARD_ERROR_HOOK_ENV, "5");
    let dir = tmp.path().join("reward-error");
    let err =
        run_with_deadline(recipe(tmp.path(), "async"), dir.clone()).expect_err("the run must fail");
    std::env::remove_var(REWARD_ERROR_HOOK_ENV);
    let msg = format!("{err:#}");
    assert!(msg.contains("rewarder"), "{msg}");
    assert!(msg.contains("injected verifier failure"), "{msg}");
    assert!(msg.contains("last good checkpoint"), "{msg}");
    let step = checkpoint_step(&dir);
    assert!(step == 2 || step == 4, "last checkpoint at step {step}");
    assert!(dir.join("checkpoint/model.safetensors").is_file());
    assert!(dir.join("checkpoint/optimizer.safetensors").is_file());
}
