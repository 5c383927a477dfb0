//! `composer-rl train` and signals: SIGINT / SIGTERM checkpoint and exit 130 / 143, Ctrl-C
//! during the supervised warm-up exits cleanly, a finished run exits 0. The signals are real
//! (raised inside the process by composer-train's test hooks at a given step).

use std::path::Path;
use std::process::{Command, Output};

use composer_train::trainer::{SIGINT_HOOK_ENV, SIGTERM_HOOK_ENV, WARMUP_SIGINT_HOOK_ENV};

/// The tiny built-in model on 1-digit arithmetic: a short warm-up, 4 steps.
const RECIPE: &str = r#"
[model.builtin_tiny]
hidden_size = 32
layers = 1
heads = 2
kv_heads = 1
intermediate_size = 64

[data]
task = "arithmetic"
eval_size = 8

[data.arithmetic]
digits = 1

[rollout]
num_generations = 4
max_completion_length = 3

[warmup]
steps = 10
batch_size = 8

[train]
steps = 4
prompts_per_step = 2
seed = 7
eval_every = 4
checkpoint_every = 4
"#;

fn train(dir: &Path, env: &[(&str, &str)]) -> Output {
    let recipe = dir.join("recipe.in.toml");
    std::fs::write(&recipe, RECIPE).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_composer-rl"));
    cmd.arg("train")
        .arg(&recipe)
        .arg("--quiet")
        .arg("--run-dir")
        .arg(dir.join("run"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn checkpoint_step(run: &Path) -> u64 {
    let ck = composer_train::checkpoint::find_checkpoint(run).unwrap();
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap())
            .unwrap();
    state["step"].as_u64().unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn sigterm_and_sigint_checkpoint_and_exit_143_and_130() {
    for (var, sig, code) in [
        (SIGTERM_HOOK_ENV, "SIGTERM", 143),
        (SIGINT_HOOK_ENV, "SIGINT", 130),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = train(tmp.path(), &[(var, "2")]);
        let log = text(&out);
        assert_eq!(out.status.code(), Some(code), "{sig}: {log}");
        assert!(log.contains(&format!("interrupted by {sig}")), "{log}");
        assert_eq!(checkpoint_step(&tmp.path().join("run")), 2, "{sig}");
    }
}

#[test]
fn ctrl_c_in_the_warm_up_exits_130_with_a_message() {
    let tmp = tempfile::tempdir().unwrap();
    let out = train(tmp.path(), &[(WARMUP_SIGINT_HOOK_ENV, "3")]);
    let log = text(&out);
    assert_eq!(out.status.code(), Some(130), "{log}");
    assert!(log.contains("during the supervised warm-up"), "{log}");
}

#[test]
fn a_finished_run_exits_0() {
    let tmp = tempfile::tempdir().unwrap();
    let out = train(tmp.path(), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(checkpoint_step(&tmp.path().join("run")), 4);
}
