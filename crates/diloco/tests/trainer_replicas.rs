//! The composer-train trainer as DiLoCo replicas (`run_replica`) in separate processes
//! through a local folder store and through the S3 test server.

use std::path::Path;
use std::process::{Command, Stdio};

use composer_diloco::codec::decode;
use composer_diloco::split_recipe;
use serde_json::Value;

mod common;
use common::{s3_endpoint, s3_env, s3_url};

const BIN: &str = env!("CARGO_BIN_EXE_diloco-replica");

/// A small RL recipe (the tiny built-in model on 1-digit arithmetic, as composer-train's own
/// run tests; a short warm-up and the replay channel so gradients are non-zero while rewards
/// are still 0) plus the `[diloco]` section: 2 replicas, H = 2, 4 inner steps → 2 rounds.
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

[loss]
replay_weight = 1.0

[warmup]
steps = 10
batch_size = 8

[replay]
traces = ["builtin:scripted"]

[train]
steps = 4
prompts_per_step = 2
seed = 7
eval_every = 4
checkpoint_every = 2

[diloco]
inner_steps = 2
num_replicas = 2
min_replicas = 2
quorum_timeout_s = 60
outer_lr = 0.7
outer_momentum = 0.9
poll_interval_s = 0.01
"#;

/// Runs replicas 0 and 1 as processes (against the S3 server at `s3` if given); returns their
/// FINAL json lines.
fn run_both(recipe: &Path, store: &str, dir: &Path, s3: Option<&str>) -> Vec<Value> {
    let children: Vec<_> = (0..2)
        .map(|i| {
            let mut cmd = Command::new(BIN);
            if let Some(endpoint) = s3 {
                s3_env(&mut cmd, endpoint);
            }
            cmd.args([
                "--recipe",
                recipe.to_str().unwrap(),
                "--replica-id",
                &i.to_string(),
            ])
            .args(["--store", store])
            .args(["--run-dir", dir.join(format!("run-{i}")).to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    let mut finals = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        let s = String::from_utf8(out.stdout).unwrap();
        let line = s
            .lines()
            .find_map(|l| l.strip_prefix("FINAL "))
            .unwrap_or_else(|| panic!("{s}\n{err}"));
        finals.push(serde_json::from_str::<Value>(line).unwrap());
    }
    finals
}

/// Checks what both replicas' run directories say: 4 train steps with non-zero gradients, 2
/// rounds with both replicas in quorum, outer state saved, different data per replica, and the
/// same final accuracy (both end on the round's global weights).
fn assert_trained_together(finals: &[Value], dir: &Path) {
    let mut first_grad_norms = Vec::new();
    for (i, f) in finals.iter().enumerate() {
        assert_eq!(f["steps"], 4, "{f}");
        assert_eq!(f["round"], 2, "{f}");
        let metrics = std::fs::read_to_string(dir.join(format!("run-{i}/metrics.jsonl"))).unwrap();
        let lines: Vec<Value> = metrics
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .collect();
        let rounds: Vec<&Value> = lines.iter().filter(|v| v["kind"] == "diloco").collect();
        assert_eq!(rounds.len(), 2, "{metrics}");
        let train: Vec<&Value> = lines.iter().filter(|v| v["kind"] == "train").collect();
        assert_eq!(train.len(), 4);
        assert!(
            train.iter().all(|t| t["grad_norm"].as_f64().unwrap() > 0.0),
            "{metrics}"
        );
        first_grad_norms.push(train[0]["grad_norm"].as_f64().unwrap());
        for r in &rounds {
            assert_eq!(r["diloco/replicas"], 2);
            assert!(r["diloco/bytes"].as_u64().unwrap() > 0);
            assert!(r["time/outer_sync_s"].as_f64().unwrap() >= 0.0);
        }
        assert!(dir
            .join(format!("run-{i}/checkpoint/diloco-state.safetensors"))
            .exists());
    }
    // Different prompts per replica (the data split), hence different gradients.
    assert_ne!(first_grad_norms[0], first_grad_norms[1]);
    assert_eq!(finals[0]["final_accuracy"], finals[1]["final_accuracy"]);
}

#[test]
fn two_trainer_replicas_in_processes_sync_through_a_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("recipe.toml");
    std::fs::write(&recipe, RECIPE).unwrap();
    let store = format!("file://{}", tmp.path().join("store").display());
    let finals = run_both(&recipe, &store, tmp.path(), None);
    assert_trained_together(&finals, tmp.path());
    // The outer steps moved the global weights.
    let read = |p: &str| decode(&std::fs::read(tmp.path().join("store").join(p)).unwrap()).unwrap();
    let (init, last) = (
        read("init.safetensors"),
        read("round-000001/frag-0/global.safetensors"),
    );
    let moved = init.tensors.iter().any(|t| {
        let u = last.tensors.iter().find(|u| u.name == t.name).unwrap();
        t.data != u.data
    });
    assert!(moved, "global weights unchanged after two rounds");
    assert!(tmp
        .path()
        .join("store/round-000001/frag-0/global.safetensors")
        .exists());
}

/// `[train] bf16 = true`: the replicas compute on bf16 copies of their f32 masters, which the
/// outer steps overwrite (the hook casts the copy again); checkpoints keep the f32 masters.
#[test]
fn bf16_replicas_sync_through_a_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("recipe.toml");
    let text = RECIPE.replace("[train]\n", "[train]\nbf16 = true\n");
    assert_ne!(text, RECIPE);
    std::fs::write(&recipe, text).unwrap();
    let store = format!("file://{}", tmp.path().join("store").display());
    let finals = run_both(&recipe, &store, tmp.path(), None);
    assert_trained_together(&finals, tmp.path());
    for i in 0..2 {
        let ck = tmp
            .path()
            .join(format!("run-{i}/checkpoint/model.safetensors"));
        for (name, t) in candle_core::safetensors::load(&ck, &candle_core::Device::Cpu).unwrap() {
            assert_eq!(t.dtype(), candle_core::DType::F32, "replica {i}: {name}");
        }
    }
}

/// `[model] use_peft = true`: the replicas train and average only the LoRA adapters (the
/// store holds PEFT-named adapter tensors, nothing of the frozen base), and each replica's
/// checkpoint is a PEFT adapter.
#[test]
fn lora_replicas_sync_only_the_adapters() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("recipe.toml");
    let lora = "[model]\nuse_peft = true\nlora_r = 4\nlora_target_modules = \"all-linear\"\n";
    std::fs::write(&recipe, format!("{lora}{RECIPE}")).unwrap();
    let store = format!("file://{}", tmp.path().join("store").display());
    let finals = run_both(&recipe, &store, tmp.path(), None);
    assert_trained_together(&finals, tmp.path());
    let read = |p: &str| decode(&std::fs::read(tmp.path().join("store").join(p)).unwrap()).unwrap();
    let (init, last) = (
        read("init.safetensors"),
        read("round-000001/frag-0/global.safetensors"),
    );
    // 7 projections × (A, B) in the 1-layer model, and their outer momentum.
    assert_eq!(last.tensors.len(), 28);
    for t in &last.tensors {
        let name = t.name.strip_prefix("momentum/").unwrap_or(&t.name);
        assert!(
            name.starts_with("base_model.model.model.layers.0.") && name.contains(".lora_"),
            "{}",
            t.name
        );
    }
    let moved = init.tensors.iter().any(|t| {
        let u = last.tensors.iter().find(|u| u.name == t.name).unwrap();
        t.data != u.data
    });
    assert!(moved, "global adapters unchanged after two rounds");
    for i in 0..2 {
        let ck = tmp.path().join(format!("run-{i}/checkpoint"));
        assert!(ck.join("adapter_model.safetensors").is_file());
        assert!(!ck.join("model.safetensors").exists());
    }
}

#[test]
fn two_trainer_replicas_in_processes_sync_through_s3() {
    let Some(endpoint) = s3_endpoint() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("recipe.toml");
    std::fs::write(&recipe, RECIPE).unwrap();
    let finals = run_both(
        &recipe,
        &s3_url("trainer-replicas"),
        tmp.path(),
        Some(&endpoint),
    );
    assert_trained_together(&finals, tmp.path());
}

#[test]
fn diloco_section_is_split_off_and_bad_fields_are_named() {
    let (cfg, rest) = split_recipe(RECIPE, "r.toml".as_ref()).unwrap();
    assert_eq!((cfg.inner_steps, cfg.num_replicas), (2, 2));
    assert!(!rest.contains("diloco") && rest.contains("builtin_tiny"));
    let bad = RECIPE.replace("outer_lr = 0.7", "outer_lrr = 0.7");
    let e = format!("{:#}", split_recipe(&bad, "r.toml".as_ref()).unwrap_err());
    assert!(e.contains("r.toml") && e.contains("outer_lrr"), "{e}");
    let e = format!(
        "{:#}",
        split_recipe("[train]\nsteps = 1\n", "r.toml".as_ref()).unwrap_err()
    );
    assert!(e.contains("no [diloco] section"), "{e}");
}

/// A replica runs composer-train's step loop: a non-finite step is skipped as in
/// `composer-rl train` (the trainer's NaN test hook), and its metrics carry the same walls.
#[test]
fn a_replica_skips_a_non_finite_step_and_logs_the_walls() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("recipe.toml");
    let one = RECIPE
        .replace("num_replicas = 2", "num_replicas = 1")
        .replace("min_replicas = 2", "min_replicas = 1");
    std::fs::write(&recipe, one).unwrap();
    let store = format!("file://{}", tmp.path().join("store").display());
    let run_dir = tmp.path().join("run-0");
    let out = Command::new(BIN)
        .args(["--recipe", recipe.to_str().unwrap(), "--replica-id", "0"])
        .args(["--store", &store])
        .args(["--run-dir", run_dir.to_str().unwrap()])
        .env(composer_train::trainer::NAN_HOOK_ENV, "2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let train: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["kind"] == "train")
        .collect();
    assert_eq!(train.len(), 4, "{metrics}");
    for t in &train {
        let skipped = t["step"] == 2;
        assert_eq!(t["skipped"] == true, skipped, "{t}");
        assert_eq!(
            t["skipped_steps"],
            if t["step"] == 1 { 0 } else { 1 },
            "{t}"
        );
        for key in [
            "time/rollout_s",
            "time/reward_s",
            "time/train_s",
            "time/sync_s",
            "time/step_s",
        ] {
            assert!(t[key].as_f64().is_some_and(|x| x >= 0.0), "{key}: {t}");
        }
        assert_eq!(t["diloco/replica"], 0);
    }
    assert!(run_dir.join("checkpoint/diloco-state.safetensors").exists());
}

/// SIGTERM stops a replica like `composer-rl train`: checkpoint and outer state written, exit
/// 143; `--resume` then finishes the run.
#[test]
fn sigterm_checkpoints_a_replica_which_then_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = tmp.path().join("recipe.toml");
    let one = RECIPE
        .replace("num_replicas = 2", "num_replicas = 1")
        .replace("min_replicas = 2", "min_replicas = 1");
    std::fs::write(&recipe, one).unwrap();
    let store = format!("file://{}", tmp.path().join("store").display());
    let run_dir = tmp.path().join("run-0");
    let replica = |resume: bool| {
        let mut cmd = Command::new(BIN);
        cmd.args(["--recipe", recipe.to_str().unwrap(), "--replica-id", "0"])
            .args(["--store", &store])
            .args(["--run-dir", run_dir.to_str().unwrap()]);
        if resume {
            cmd.arg("--resume");
        } else {
            cmd.env(composer_train::trainer::SIGTERM_HOOK_ENV, "3");
        }
        cmd.output().unwrap()
    };
    let out = replica(false);
    assert_eq!(
        out.status.code(),
        Some(143),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(composer_train::checkpoint::find_checkpoint(&run_dir).is_ok());
    assert!(run_dir.join("checkpoint/diloco-state.safetensors").exists());
    let out = replica(true);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("FINAL "))
        .unwrap();
    let fin: Value = serde_json::from_str(line).unwrap();
    assert_eq!(fin["steps"], 4, "{fin}");
    assert_eq!(fin["round"], 2, "{fin}");
}
