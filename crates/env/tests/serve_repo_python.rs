//! `serve-env repo` (the repository-task env served by `serve_env_until`) driven by OpenEnv's
//! own Python clients from the `openenv` 0.10.0 package: `MCPToolClient` (session made over
//! HTTP `/mcp`, reset/step over `WS /ws?session_id=ID`, tool calls over `/mcp`) and
//! `GenericEnvClient` (gym-style `call_tool` steps). The venv is `$OPENENV_MCP_VENV`
//! (tools/openenv-mcp-venv.sh; unset: SKIPPED, or a failure under `CI`). Reference values:
//! restoring the deleted function scores 1.0; a wrong body scores passed/total of the
//! hidden tests (`textkit-numbers-gcd` has 2, the wrong one passes 1).

mod common;

use std::path::{Path, PathBuf};

use common::service_var;
use composer_env::repo::{EpisodeBudget, RepoEnv};
use composer_env::{serve_env_until, ServeConfig};
use serde_json::{json, Value};

/// Plays one episode with `MCPToolClient` (restoring the file the plan names), then one
/// with `GenericEnvClient` (a partial fix), and prints one JSON line of what it saw.
const CLIENT_PY: &str = r#"
import json, sys
from openenv import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient
from openenv.core.env_server.mcp_types import CallToolAction

url, plan_path = sys.argv[1], sys.argv[2]
with open(plan_path) as f:
    plan = json.load(f)
out = {}
with MCPToolClient(base_url=url).sync() as env:
    r = env.reset(task_id=plan["task_id"])
    out["reset_done"] = r.done
    out["reset_obs"] = r.observation.model_dump()
    tools = env.list_tools()
    out["tools"] = {t.name: t.input_schema for t in tools}
    out["listing"] = env.call_tool("list_files")
    out["before"] = env.call_tool("read_file", path=plan["file"])
    out["write"] = env.call_tool("write_file", path=plan["file"], content=plan["original"])
    out["tests"] = env.call_tool("run_tests")
    bad = env.call_tool("no_such_tool")
    out["bad_tool"] = bad
    s = env.step(CallToolAction(tool_name="submit", arguments={}))
    out["submit"] = {"reward": s.reward, "done": s.done,
                     "error": None if s.observation.error is None else s.observation.error.message}
    out["state"] = env.state().model_dump()
with GenericEnvClient(base_url=url).sync() as env:
    r = env.reset(task_id=plan["task_id"])
    s = env.step({"type": "call_tool", "tool_name": "write_file",
                  "arguments": {"path": plan["file"], "content": plan["partial"]}})
    out["generic_write"] = {"reward": s.reward, "done": s.done, "error": s.observation["error"]}
    s = env.step({"type": "call_tool", "tool_name": "submit", "arguments": {}})
    out["generic_submit"] = {"reward": s.reward, "done": s.done,
                             "grade": s.observation["metadata"]["grade"]}
print("RESULT " + json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn openenv_mcp_tool_client_plays_a_repo_episode() {
    let Some(venv) = service_var("OPENENV_MCP_VENV", "serve_repo_python").map(PathBuf::from) else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("repo_tasks");
    let factory = RepoEnv::factory(&root.join("tasks"), EpisodeBudget::default()).unwrap();
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
    let file = "textkit/numbers.py";
    let original = std::fs::read_to_string(root.join("source").join(file)).unwrap();
    // Wrong for zeros only: test_gcd passes, test_gcd_zero fails.
    let partial = original.replace(
        "    a, b = abs(a), abs(b)\n",
        "    a, b = abs(a), abs(b)\n    if a == 0:\n        return -1\n",
    );
    assert_ne!(partial, original);
    let plan = json!({"task_id": "textkit-numbers-gcd", "file": file, "original": original, "partial": partial});
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("client.py");
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&script, CLIENT_PY).unwrap();
    std::fs::write(&plan_path, plan.to_string()).unwrap();
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(300),
        tokio::process::Command::new(venv.join("bin/python"))
            .arg(&script)
            .arg(&url)
            .arg(&plan_path)
            .output(),
    )
    .await
    .expect("the Python client did not finish in 300 s")
    .expect("running $OPENENV_MCP_VENV/bin/python");
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
    let r: Value = serde_json::from_str(line).unwrap();

    assert_eq!(r["reset_done"], false);
    let statement = r["reset_obs"]["statement"].as_str().unwrap();
    assert!(
        statement.contains("`gcd` in `textkit/numbers.py`"),
        "{statement}"
    );
    let tools = r["tools"].as_object().unwrap();
    assert_eq!(tools.len(), 7, "{tools:?}");
    assert_eq!(
        tools["replace_in_file"]["required"],
        json!(["path", "old_str", "new_str"])
    );
    // call_tool over HTTP /mcp returns the result's `data`: the tool's text.
    assert!(
        r["listing"].as_str().unwrap().contains(file),
        "{}",
        r["listing"]
    );
    assert!(r["before"]
        .as_str()
        .unwrap()
        .contains("NotImplementedError"));
    assert!(
        r["write"].as_str().unwrap().starts_with("wrote "),
        "{}",
        r["write"]
    );
    assert!(
        r["tests"].as_str().unwrap().starts_with("exit code: 0"),
        "{}",
        r["tests"]
    );
    assert!(
        r["bad_tool"].as_str().unwrap().contains("tool_not_found"),
        "{}",
        r["bad_tool"]
    );
    assert_eq!(r["submit"]["reward"].as_f64(), Some(1.0), "{}", r["submit"]);
    assert_eq!(r["submit"]["done"], true);
    assert_eq!(r["submit"]["error"], Value::Null);
    assert!(
        r["state"]["step_count"].as_u64().unwrap() >= 1,
        "{}",
        r["state"]
    );

    assert_eq!(r["generic_write"]["done"], false);
    assert_eq!(r["generic_write"]["error"], Value::Null);
    assert_eq!(
        r["generic_submit"]["reward"].as_f64(),
        Some(0.5),
        "{}",
        r["generic_submit"]
    );
    assert_eq!(r["generic_submit"]["done"], true);
    assert_eq!(r["generic_submit"]["grade"]["passed"], 1);
    assert_eq!(
        r["generic_submit"]["grade"]["failed"][0]["test"],
        "test_numbers::test_gcd_zero"
    );
}
