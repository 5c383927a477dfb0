//! Every key that real short runs write to metrics.jsonl is in the typed schema
//! (`composer_telemetry::metric_keys::lookup`): a sync run with all three channels, the KL
//! term, dynamic sampling and eval; an `[env]` run on the built-in echo env; and a DiLoCo
//! replica (a `diloco-replica` process) through a folder store. A key written anywhere
//! without a schema entry fails here.

use std::path::Path;
use std::process::Command;

use composer_telemetry::metric_keys::lookup;
use composer_telemetry::read_metrics;

#[path = "../../train/tests/common/mod.rs"]
mod train_common;
use train_common::{tiny_model_and_task, train_quietly};

const BIN: &str = env!("CARGO_BIN_EXE_diloco-replica");

/// Sync run: all channels, KL to the reference, DAPO dynamic sampling, warm-up and eval.
const SYNC: &str = concat!(
    tiny_model_and_task!(),
    r#"
[rollout]
num_generations = 4
max_completion_length = 3

[loss]
hint_weight = 1.0
replay_weight = 1.0
beta = 0.05
dynamic_sampling = true
max_dynamic_sampling_rounds = 2

[loss.hint.template]
reprompt = "{solution}{prompt}"
solution = "[{successful_previous_attempt}]"
feedback = ""

[warmup]
steps = 5
batch_size = 8
hint_fraction = 0.3

[replay]
traces = ["builtin:scripted"]

[train]
steps = 2
prompts_per_step = 2
seed = 3
eval_every = 1
checkpoint_every = 0
"#
);

/// `[env]` run on the built-in echo env (no server).
const ENV: &str = concat!(
    tiny_model_and_task!(),
    r#"
[rollout]
num_generations = 2
max_completion_length = 4

[train]
steps = 2
prompts_per_step = 2
seed = 3
eval_every = 0
checkpoint_every = 0

[env]
kind = "builtin"
name = "echo"
max_turns = 2
"#
);

/// One DiLoCo replica, H = 1: every inner step ends an outer round.
const DILOCO: &str = concat!(
    tiny_model_and_task!(),
    r#"
[rollout]
num_generations = 4
max_completion_length = 3

[loss]
replay_weight = 1.0

[warmup]
steps = 5
batch_size = 8

[replay]
traces = ["builtin:scripted"]

[train]
steps = 2
prompts_per_step = 2
seed = 7
eval_every = 2
checkpoint_every = 0

[diloco]
inner_steps = 1
num_replicas = 1
min_replicas = 1
quorum_timeout_s = 60
outer_lr = 0.7
outer_momentum = 0.9
poll_interval_s = 0.01
"#
);

/// The keys of `run_dir`'s metrics.jsonl that the schema does not know, as `kind:key`; also
/// returns the set of line kinds seen.
fn unknown_keys(run_dir: &Path) -> (Vec<String>, Vec<String>) {
    let lines = read_metrics(&run_dir.join("metrics.jsonl")).unwrap();
    assert!(!lines.is_empty(), "{}: no metrics", run_dir.display());
    let mut unknown = Vec::new();
    let mut kinds = Vec::new();
    for l in &lines {
        let kind = l["kind"].as_str().unwrap_or("?").to_string();
        for key in l.as_object().unwrap().keys() {
            if lookup(key).is_none() {
                unknown.push(format!("{kind}:{key}"));
            }
        }
        kinds.push(kind);
    }
    unknown.sort();
    unknown.dedup();
    kinds.sort();
    kinds.dedup();
    (unknown, kinds)
}

#[test]
fn every_metrics_key_of_real_runs_is_in_the_schema() {
    let tmp = tempfile::tempdir().unwrap();
    let mut unknown = Vec::new();

    for (name, text) in [("sync", SYNC), ("env", ENV)] {
        let recipe = tmp.path().join(format!("{name}.toml"));
        std::fs::write(&recipe, text).unwrap();
        let run = tmp.path().join(name);
        train_quietly(&recipe, &run).unwrap();
        let (u, kinds) = unknown_keys(&run);
        assert!(kinds.contains(&"train".to_string()), "{name}: {kinds:?}");
        unknown.extend(u.into_iter().map(|k| format!("{name} {k}")));
    }
    let (_, sync_kinds) = unknown_keys(&tmp.path().join("sync"));
    assert!(sync_kinds.contains(&"eval".to_string()), "{sync_kinds:?}");

    let recipe = tmp.path().join("diloco.toml");
    std::fs::write(&recipe, DILOCO).unwrap();
    let store = format!("file://{}", tmp.path().join("store").display());
    let run = tmp.path().join("diloco");
    let out = Command::new(BIN)
        .args(["--recipe", recipe.to_str().unwrap(), "--replica-id", "0"])
        .args(["--store", &store])
        .args(["--run-dir", run.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (u, kinds) = unknown_keys(&run);
    assert!(kinds.contains(&"diloco".to_string()), "{kinds:?}");
    unknown.extend(u.into_iter().map(|k| format!("diloco {k}")));

    assert!(
        unknown.is_empty(),
        "keys written to metrics.jsonl but missing from the schema: {unknown:?}"
    );
}

#[test]
fn lookup_refuses_an_unknown_key() {
    assert!(lookup("loss/rlvr").is_some());
    assert!(lookup("loss/no_such_key").is_none());
}
