//! Repository tasks: the shipped task set, the tools, honest and dishonest agents.
//!
//! `REGENERATE_REPO_TASKS=1 cargo test -p composer-env --test repo_tasks shipped_tasks_match`
//! rewrites `repo_tasks/tasks/` from `repo_tasks/source/`.

use std::path::{Path, PathBuf};

use composer_env::repo::{
    load_tasks, make_tasks, tool_specs, EpisodeBudget, RepoEpisode, RepoTask, ToolErrorKind,
};
use serde_json::{json, Value};

#[path = "../planted/mod.rs"]
mod planted;

mod attacks;
mod honest_agents;
mod tools_and_limits;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("repo_tasks")
}

fn tasks() -> Vec<RepoTask> {
    load_tasks(&root().join("tasks")).expect("shipped tasks load")
}

fn episode(task: &RepoTask) -> RepoEpisode {
    RepoEpisode::new(task, EpisodeBudget::default()).expect("episode starts")
}

fn call(ep: &mut RepoEpisode, name: &str, args: Value) -> Result<String, (ToolErrorKind, String)> {
    ep.call_tool(name, &args)
        .map(|o| o.text)
        .map_err(|e| (e.error_type, e.message))
}

fn submit(ep: &mut RepoEpisode) -> f64 {
    let out = ep.call_tool("submit", &json!({})).expect("submit works");
    assert!(out.done);
    out.grade.expect("graded").reward
}

/// The original file the task's removed symbol lives in.
fn original(task: &RepoTask) -> (String, String) {
    let file = task.spec.removed[0].file.clone();
    let text = std::fs::read_to_string(root().join("source").join(&file)).unwrap();
    (file, text)
}

fn task_for(symbol: &str) -> RepoTask {
    tasks()
        .into_iter()
        .find(|t| t.spec.removed[0].kind == "body" && t.spec.removed[0].symbols == [symbol])
        .unwrap_or_else(|| panic!("a task for {symbol}"))
}

/// Run by `repo_tasks_refuse_a_sandbox_without_private_root` in a process whose sandbox has
/// namespaces disabled: episodes and the served env must refuse, naming the capability.
#[test]
#[ignore = "run in a child process by repo_tasks_refuse_a_sandbox_without_private_root"]
fn no_private_root_child() {
    assert!(!composer_sandbox::sandbox_capabilities().private_root);
    let task = task_for("caesar");
    let hidden = task.hidden_tests_dir().display().to_string();
    let e = RepoEpisode::new(&task, EpisodeBudget::default())
        .err()
        .expect("an episode without a private root is refused");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("private_root") && msg.contains(&hidden),
        "{msg}"
    );
    let e = composer_env::repo::RepoEnv::factory(&root().join("tasks"), EpisodeBudget::default())
        .err()
        .expect("serving without a private root is refused");
    assert!(format!("{e:#}").contains("private_root"), "{e:#}");
    println!("NO_PRIVATE_ROOT_CHILD_OK");
}

#[test]
fn repo_tasks_refuse_a_sandbox_without_private_root() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "no_private_root_child",
            "--nocapture",
        ])
        .env("COMPOSER_SANDBOX_NO_NAMESPACES", "1")
        .output()
        .expect("the test binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("NO_PRIVATE_ROOT_CHILD_OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
