//! Our OpenEnv server (`serve_env_until`, what `composer-rl serve-env` runs) driven by
//! openenv's own Python client, `GenericEnvClient` from openenv-core 0.3.0 in the venv that
//! ../shared/openenv/start-server.sh makes (`$OPENENV_VENV`; unset: SKIPPED, or a failure
//! under `CI`). Reference values: the echo env's reward 0.1 × len(message) and the code env's
//! fraction of the task's unit tests passed (builtin/sum_of_evens has 4 tests).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::service_var;
use composer_env::{
    builtin_env_factory, serve_env_until, CodeEnv, CodeEnvConfig, EnvFactory, ServeConfig,
};
use serde_json::{json, Value};

/// The client script: runs the `plan` (a list of `["reset", kwargs]` / `["step", action]`)
/// with `GenericEnvClient(...).sync()` and prints one JSON line of results.
const CLIENT_PY: &str = r#"
import json, sys
from openenv import GenericEnvClient

url, plan_path = sys.argv[1], sys.argv[2]
with open(plan_path) as f:
    plan = json.load(f)
results = []
with GenericEnvClient(base_url=url).sync() as env:
    for kind, arg in plan:
        if kind == "reset":
            r = env.reset(**arg)
        elif kind == "step":
            r = env.step(arg)
        else:
            raise SystemExit(f"bad plan entry {kind}")
        results.append({"observation": r.observation, "reward": r.reward, "done": r.done})
    state = env.state()
    results.append({"state": state if isinstance(state, dict) else state.model_dump()})
print("RESULT " + json.dumps(results))
"#;

/// Serves `factory` on an ephemeral port, runs the Python client with `plan`, stops the
/// server, and returns the client's results.
async fn run_python_client(venv: &Path, factory: EnvFactory, plan: Value) -> Vec<Value> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_env_until(
        factory,
        listener,
        ServeConfig::default(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("client.py");
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&script, CLIENT_PY).unwrap();
    std::fs::write(&plan_path, plan.to_string()).unwrap();
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        tokio::process::Command::new(venv.join("bin/python"))
            .arg(&script)
            .arg(&url)
            .arg(&plan_path)
            .output(),
    )
    .await
    .expect("the Python client did not finish in 120 s")
    .expect("running $OPENENV_VENV/bin/python");
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python client failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line:\n{stdout}\n{stderr}"));
    serde_json::from_str::<Vec<Value>>(line).unwrap()
}

fn venv() -> Option<PathBuf> {
    service_var("OPENENV_VENV", "serve_python_client").map(PathBuf::from)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_generic_client_drives_the_code_env() {
    let Some(venv) = venv() else { return };
    let factory = CodeEnv::factory(CodeEnvConfig {
        max_attempts: 2,
        ..Default::default()
    })
    .unwrap();
    let wrong = "```python\ndef sum_of_evens(numbers):\n    return sum(numbers)\n```";
    let right = "def sum_of_evens(numbers):\n    return sum(n for n in numbers if n % 2 == 0)\n";
    let plan = json!([
        ["reset", {"task_id": "builtin/sum_of_evens"}],
        ["step", {"code": wrong}],
        ["step", {"code": right}],
    ]);
    let r = run_python_client(&venv, factory, plan).await;
    // Reset: the task prompt, no reward yet.
    assert_eq!(r[0]["observation"]["task_id"], "builtin/sum_of_evens");
    assert!(r[0]["observation"]["prompt"]
        .as_str()
        .unwrap()
        .contains("sum_of_evens(numbers)"));
    assert_eq!(r[0]["reward"], Value::Null);
    assert_eq!(r[0]["done"], false);
    // Wrong: sum([1,2,3,4]) = 10 ≠ 6, sum([]) = 0 ok, sum([1,3,5]) = 9 ≠ 0, sum([-2,-3,10]) = 5 ≠ 8:
    // 1 of 4 tests pass; feedback names a failing test; one attempt left, so not done.
    assert_eq!(r[1]["observation"]["passed"], 1);
    assert_eq!(r[1]["observation"]["total"], 4);
    assert!(
        (r[1]["reward"].as_f64().unwrap() - 0.25).abs() < 1e-9,
        "{}",
        r[1]
    );
    assert_eq!(r[1]["done"], false);
    // It names the failing test by number and its error, not its source (the expected values
    // there could be hard-coded by the next attempt).
    let feedback = r[1]["observation"]["feedback"].as_str().unwrap();
    assert!(
        feedback.contains("first failing test: #") && feedback.contains("AssertionError"),
        "{feedback}"
    );
    assert!(!feedback.contains("sum_of_evens("), "{feedback}");
    // Right: all tests pass, done.
    assert_eq!(r[2]["reward"].as_f64(), Some(1.0), "{}", r[2]);
    assert_eq!(r[2]["done"], true);
    assert_eq!(r[2]["observation"]["all_passed"], true);
    assert_eq!(r[3]["state"]["step_count"], 2);
    assert_eq!(r[3]["state"]["task_id"], "builtin/sum_of_evens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_generic_client_drives_the_echo_env() {
    let Some(venv) = venv() else { return };
    let factory = builtin_env_factory("echo").unwrap();
    let plan = json!([
        ["reset", {}],
        ["step", {"message": "hello"}],
        ["step", {"message": "composer"}],
    ]);
    let r = run_python_client(&venv, Arc::clone(&factory), plan).await;
    assert_eq!(
        r[0]["observation"]["echoed_message"],
        "Echo Env environment ready!"
    );
    assert_eq!(r[0]["reward"].as_f64(), Some(0.0));
    assert_eq!(r[1]["observation"]["echoed_message"], "hello");
    assert_eq!(r[1]["observation"]["message_length"], 5);
    assert!((r[1]["reward"].as_f64().unwrap() - 0.5).abs() < 1e-9);
    assert!((r[2]["reward"].as_f64().unwrap() - 0.8).abs() < 1e-9);
    assert_eq!(r[2]["done"], false);
    assert_eq!(r[3]["state"]["step_count"], 2);
}
