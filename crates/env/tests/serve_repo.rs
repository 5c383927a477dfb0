//! `serve-env repo` over the wire (REPO_ENV.md): the repository-task env served by
//! `serve_env_until` on a real port, driven with raw WebSocket frames and HTTP JSON-RPC.
//! Honest agents score 1.0, doing nothing scores 0, attacks score 0, malformed calls are
//! error observations, sessions run concurrently, and HTTP-made sessions attach to `/ws`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use composer_env::repo::{load_tasks, EpisodeBudget, RepoEnv, RepoTask};
use composer_env::{serve_env_until, ServeConfig};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

mod planted;

fn tasks_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("repo_tasks/tasks")
}

fn source_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("repo_tasks/source")
}

fn task(symbol: &str) -> RepoTask {
    load_tasks(&tasks_dir())
        .unwrap()
        .into_iter()
        .find(|t| t.spec.removed[0].kind == "body" && t.spec.removed[0].symbols == [symbol])
        .unwrap_or_else(|| panic!("a task for {symbol}"))
}

/// A running server; dropping it stops the server.
struct Server {
    addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Server {
    async fn start(max_sessions: usize) -> Server {
        let factory = RepoEnv::factory(&tasks_dir(), EpisodeBudget::default()).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let config = ServeConfig {
            max_sessions,
            ..Default::default()
        };
        let handle = tokio::spawn(serve_env_until(factory, listener, config, async move {
            let _ = rx.await;
        }));
        Server {
            addr,
            stop: Some(tx),
            handle: Some(handle),
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn ws(&self, query: &str) -> Ws {
        let (stream, _) = tokio_tungstenite::connect_async(format!("ws://{}/ws{query}", self.addr))
            .await
            .expect("WebSocket connects");
        Ws { stream }
    }

    async fn rpc(&self, body: &str) -> Value {
        let r = reqwest::Client::new()
            .post(format!("{}/mcp", self.url()))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "POST /mcp is always HTTP 200");
        r.json().await.unwrap()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.handle.take().unwrap().await.unwrap().unwrap();
    }
}

struct Ws {
    stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

impl Ws {
    /// Sends a text frame and returns the next reply (parsed).
    async fn send_raw(&mut self, text: &str) -> Value {
        self.stream.send(Message::text(text)).await.unwrap();
        self.next_text().await
    }

    /// The next text frame (parsed); fails the test after 180 s instead of hanging.
    async fn next_text(&mut self) -> Value {
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(180), self.stream.next())
                .await
                .expect("a reply within 180 s")
                .expect("the socket stays open")
                .unwrap();
            if let Message::Text(t) = msg {
                return serde_json::from_str(t.as_str()).unwrap();
            }
        }
    }

    async fn send(&mut self, v: Value) -> Value {
        self.send_raw(&v.to_string()).await
    }

    /// `reset` to a task; returns the result payload.
    async fn reset(&mut self, task_id: &str) -> Value {
        let r = self
            .send(json!({"type": "reset", "data": {"task_id": task_id}}))
            .await;
        assert_eq!(r["type"], "observation", "{r}");
        r["data"].clone()
    }

    /// A `call_tool` step; returns the result payload (checked to carry reward and done).
    async fn call(&mut self, tool: &str, arguments: Value) -> Value {
        let r = self
            .send(json!({"type": "step", "data": {"type": "call_tool", "tool_name": tool, "arguments": arguments}}))
            .await;
        assert_eq!(r["type"], "observation", "{r}");
        let d = r["data"].clone();
        assert!(d["reward"].is_number() && d["done"].is_boolean(), "{d}");
        assert_eq!(d["observation"]["tool_name"], tool);
        d
    }

    /// The text of a successful call.
    async fn ok(&mut self, tool: &str, arguments: Value) -> String {
        let d = self.call(tool, arguments).await;
        assert!(d["observation"]["error"].is_null(), "{tool}: {d}");
        assert_eq!(d["observation"]["result"]["is_error"], false);
        d["observation"]["result"]["content"][0]["text"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// The `error_type` of a failed call.
    async fn fails(&mut self, tool: &str, arguments: Value) -> String {
        let d = self.call(tool, arguments).await;
        assert_eq!(d["observation"]["result"]["is_error"], true, "{d}");
        d["observation"]["error"]["error_type"]
            .as_str()
            .unwrap_or_else(|| panic!("{tool}: not an error: {d}"))
            .to_string()
    }

    async fn submit(&mut self) -> f64 {
        let d = self.call("submit", json!({})).await;
        assert_eq!(d["done"], true, "{d}");
        d["reward"].as_f64().unwrap()
    }
}

/// Restores the task's file from the original source over the wire and submits.
async fn honest_episode(ws: &mut Ws, task: &RepoTask) -> f64 {
    let file = task.spec.removed[0].file.clone();
    let original = std::fs::read_to_string(source_dir().join(&file)).unwrap();
    let reset = ws.reset(task.id()).await;
    assert_eq!(reset["done"], false);
    assert_eq!(
        reset["observation"]["statement"],
        task.spec.statement.as_str()
    );
    let listed = ws.ok("list_files", json!({})).await;
    if task.spec.removed[0].kind == "body" {
        assert!(listed.lines().any(|l| l == file), "{listed}");
        assert!(ws
            .ok("read_file", json!({"path": file}))
            .await
            .contains("NotImplementedError"));
    } else {
        // A deleted module is gone from the working copy.
        assert!(!listed.lines().any(|l| l == file), "{listed}");
    }
    ws.ok("write_file", json!({"path": file, "content": original}))
        .await;
    let tests = ws.ok("run_tests", json!({})).await;
    assert!(tests.starts_with("exit code: 0"), "{tests}");
    ws.submit().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn honest_agent_scores_one_and_do_nothing_scores_zero() {
    let server = Server::start(4).await;
    let mut ws = server.ws("").await;
    let listed = ws
        .send(json!({"type": "step", "data": {"type": "list_tools"}}))
        .await;
    let tools = listed["data"]["observation"]["tools"].as_array().unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "list_files",
            "read_file",
            "write_file",
            "replace_in_file",
            "run_shell",
            "run_tests",
            "submit"
        ]
    );
    assert_eq!(tools[1]["input_schema"]["required"], json!(["path"]));
    assert_eq!(honest_episode(&mut ws, &task("gcd")).await, 1.0);
    // After submit: still an open session; calls are error observations with done.
    let after = ws.call("list_files", json!({})).await;
    assert_eq!(after["done"], true);
    assert_eq!(after["reward"].as_f64(), Some(1.0));
    assert_eq!(
        after["observation"]["error"]["error_type"],
        "execution_error"
    );
    // A second episode on the same socket: do nothing, submit.
    ws.reset(task("caesar").id()).await;
    let d = ws.call("submit", json!({})).await;
    assert_eq!(
        (d["reward"].as_f64(), &d["done"]),
        (Some(0.0), &json!(true))
    );
    let grade = &d["observation"]["metadata"]["grade"];
    assert_eq!(grade["passed"], 0);
    assert!(grade["total"].as_u64().unwrap() >= 2, "{grade}");
    assert_eq!(d["metadata"]["grade"], *grade, "metadata is also a sibling");
    let state = ws.send(json!({"type": "state"})).await;
    assert_eq!(state["data"]["task_id"], task("caesar").id());
    assert_eq!(state["data"]["done"], true);
    drop(ws);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attacks_over_the_wire_score_zero() {
    let server = Server::start(4).await;
    let mut ws = server.ws("").await;
    let t = task("caesar");
    ws.reset(t.id()).await;
    let hidden = t.hidden_tests_dir().display().to_string();
    let secret = "test_caesar_case_and_roundtrip";
    for c in [
        format!("cat {hidden}/*.py"),
        "cat ../hidden_tests/*.py ../../hidden_tests/*.py".to_string(),
        format!("cat /proc/self/root{hidden}/*.py /proc/self/cwd/../hidden_tests/*.py"),
        format!("ln -s {hidden} h; cat h/*.py; ln -s / r; cat r{hidden}/*.py"),
    ] {
        let d = ws.call("run_shell", json!({"command": c})).await;
        assert!(!d.to_string().contains(secret), "{c}: {d}");
    }
    for p in [
        "h/test_strings.py",
        "../hidden_tests/test_strings.py",
        "/etc/passwd",
    ] {
        let kind = ws.fails("read_file", json!({"path": p})).await;
        assert!(
            kind == "invalid_args" || kind == "execution_error",
            "{p}: {kind}"
        );
    }
    // The function stays broken; runner configuration that would install the correct one
    // (if the grader copied or ran it) scores 0, the same patch in a graded file scores 1.
    let file = t.spec.removed[0].file.clone();
    let broken = std::fs::read_to_string(t.repo_dir().join(&file)).unwrap();
    let correct = std::fs::read_to_string(source_dir().join(&file)).unwrap();
    let module = file.trim_end_matches(".py").replace('/', ".");
    let trapped = planted::booby_trapped_module(&broken);
    let patch = planted::patch_source(&correct, &module);
    ws.ok("write_file", json!({"path": file, "content": trapped}))
        .await;
    for p in planted::PLANTED {
        let content = planted::planted_content(p, &patch);
        ws.ok("write_file", json!({"path": p, "content": content}))
            .await;
    }
    assert_eq!(ws.submit().await, 0.0);
    ws.reset(t.id()).await;
    ws.ok("write_file", json!({"path": file, "content": trapped}))
        .await;
    let content = planted::planted_content(planted::CONTROL, &patch);
    ws.ok(
        "write_file",
        json!({"path": planted::CONTROL, "content": content}),
    )
    .await;
    assert_eq!(ws.submit().await, 1.0, "the patch itself must work");
    // A module that patches builtins / json / sys.exit at import.
    ws.reset(t.id()).await;
    let evil = format!(
        "import builtins, sys, json\n\
         builtins.AssertionError = type('X', (Exception,), {{}})\n\
         builtins.NotImplementedError = StopIteration\n\
         json.dumps = lambda *a, **k: '{{\"status\": \"pass\"}}'\n\
         sys.exit = lambda *a: None\n{broken}"
    );
    ws.ok("write_file", json!({"path": file, "content": evil}))
        .await;
    assert_eq!(ws.submit().await, 0.0);
    drop(ws);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_messages_and_calls_keep_the_session() {
    let server = Server::start(4).await;
    let mut ws = server.ws("").await;
    // A call before any reset is an error observation too.
    assert_eq!(ws.fails("list_files", json!({})).await, "execution_error");
    ws.reset(task("dedupe").id()).await;
    for (tool, args, kind) in [
        ("no_such_tool", json!({}), "tool_not_found"),
        ("read_file", json!({}), "invalid_args"),
        ("read_file", json!({"path": 3}), "invalid_args"),
        (
            "read_file",
            json!({"path": "x", "bogus": 1}),
            "invalid_args",
        ),
        ("read_file", json!({"path": "nope.py"}), "execution_error"),
        (
            "replace_in_file",
            json!({"path": "textkit/seqs.py", "old_str": "def ", "new_str": "x"}),
            "execution_error",
        ),
        (
            "run_shell",
            json!({"command": "sleep 5", "timeout_s": 0.5}),
            "timeout",
        ),
    ] {
        assert_eq!(ws.fails(tool, args.clone()).await, kind, "{tool} {args}");
    }
    let r = ws.send_raw("this is not json").await;
    assert_eq!(
        (&r["type"], &r["data"]["code"]),
        (&json!("error"), &json!("INVALID_JSON"))
    );
    for bad in [
        json!({"type": "step"}),
        json!({"type": "step", "data": {"tool_name": "submit"}}),
        json!({"type": "step", "data": {"type": "call_tool"}}),
        json!({"type": "step", "data": {"type": "call_tool", "tool_name": "submit", "arguments": "x"}}),
        json!({"type": "reset", "data": {"task_id": "no-such-task"}}),
    ] {
        let r = ws.send(bad.clone()).await;
        assert_eq!(r["data"]["code"], "VALIDATION_ERROR", "{bad}: {r}");
    }
    // The episode is intact: an honest finish still scores 1.
    let t = task("dedupe");
    let file = t.spec.removed[0].file.clone();
    let original = std::fs::read_to_string(source_dir().join(&file)).unwrap();
    ws.ok("write_file", json!({"path": file, "content": original}))
        .await;
    assert_eq!(ws.submit().await, 1.0);
    drop(ws);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_sessions_complete_and_sixteen_fit() {
    let server = Server::start(16).await;
    let all = load_tasks(&tasks_dir()).unwrap();
    let mut runs = Vec::new();
    for t in all.into_iter().take(8) {
        let mut ws = server.ws("").await;
        ws.send(json!({"type": "state"})).await; // a reply: its session exists
                                                 // The socket comes back with the result: a finished episode keeps its session open
                                                 // until the 17th connection has been refused (else that one could take its place).
        runs.push(tokio::spawn(async move {
            let r = honest_episode(&mut ws, &t).await;
            (t.id().to_string(), r, ws)
        }));
    }
    // While those run: 8 more sessions fit (16 in all), the 17th is refused.
    let mut extra = Vec::new();
    for _ in 0..8 {
        let mut ws = server.ws("").await;
        ws.reset(task("gcd").id()).await;
        extra.push(ws);
    }
    let mut over = server.ws("").await;
    let refused = over.next_text().await;
    assert_eq!(refused["data"]["code"], "CAPACITY_REACHED", "{refused}");
    assert_eq!(refused["data"]["max_sessions"], 16);
    let mut finished = Vec::new();
    for r in runs {
        let (id, reward, ws) = r.await.unwrap();
        assert_eq!(reward, 1.0, "{id}");
        finished.push(ws);
    }
    drop(finished);
    drop(extra);
    drop(over);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_mcp_sessions_attach_to_the_websocket() {
    let server = Server::start(2).await;
    let r = server.rpc("{not json").await;
    assert_eq!(
        (r["error"]["code"].as_i64(), &r["id"]),
        (Some(-32700), &Value::Null)
    );
    let r = server
        .rpc(r#"{"jsonrpc":"2.0","id":1,"method":"bogus"}"#)
        .await;
    assert_eq!(r["error"]["code"], -32601, "{r}");
    let r = server
        .rpc(r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#)
        .await;
    let tools = r["result"]["tools"].as_array().unwrap();
    assert_eq!(tools.len(), 7);
    assert_eq!(tools[2]["name"], "write_file");
    assert_eq!(
        tools[2]["inputSchema"]["required"],
        json!(["path", "content"])
    );
    let r = server
        .rpc(r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"list_files","session_id":"nope"}}"#)
        .await;
    assert_eq!(r["error"]["code"], -32602, "{r}");

    let r = server
        .rpc(r#"{"jsonrpc":"2.0","id":4,"method":"openenv/session/create"}"#)
        .await;
    let sid = r["result"]["session_id"].as_str().unwrap().to_string();
    let mut ws = server.ws(&format!("?session_id={sid}")).await;
    let t = task("mean");
    ws.reset(t.id()).await;
    let mut second = server.ws(&format!("?session_id={sid}")).await;
    let r = second.next_text().await;
    assert!(r.to_string().contains("SESSION_ERROR"), "{r}");
    // The session cap counts HTTP sessions: one WS + this one fill it.
    let mut other = server.ws("").await;
    other.send(json!({"type": "state"})).await; // a reply: its session exists
    let r = server
        .rpc(r#"{"jsonrpc":"2.0","id":5,"method":"openenv/session/create"}"#)
        .await;
    assert_eq!(r["error"]["code"], -32000, "{r}");
    assert_eq!(r["error"]["data"]["max_sessions"], 2);

    let file = t.spec.removed[0].file.clone();
    let original = std::fs::read_to_string(source_dir().join(&file)).unwrap();
    let call = |id: u32, name: &str, args: Value| {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": name, "arguments": args, "session_id": sid}})
        .to_string()
    };
    let r = server.rpc(&call(6, "nope", json!({}))).await;
    assert_eq!(r["result"]["error"]["error_type"], "tool_not_found", "{r}");
    assert_eq!(r["result"]["is_error"], true);
    let r = server
        .rpc(&call(
            7,
            "write_file",
            json!({"path": file, "content": original}),
        ))
        .await;
    assert_eq!(r["result"]["is_error"], false, "{r}");
    assert_eq!(
        (&r["result"]["done"], r["result"]["reward"].as_f64()),
        (&json!(false), Some(0.0))
    );
    // The WebSocket sees the same working copy; its submit gets the reward.
    assert!(ws
        .ok("run_tests", json!({}))
        .await
        .starts_with("exit code: 0"));
    let mcp = ws
        .send(json!({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 8, "method": "tools/list"}}))
        .await;
    assert_eq!(mcp["type"], "mcp");
    assert_eq!(mcp["data"]["result"]["tools"].as_array().unwrap().len(), 7);
    assert_eq!(ws.submit().await, 1.0);
    // Closing while attached ends the session when the WebSocket goes.
    let r = server
        .rpc(&json!({"jsonrpc": "2.0", "id": 9, "method": "openenv/session/close", "params": {"session_id": sid}}).to_string())
        .await;
    assert_eq!(r["result"]["closing"], true, "{r}");
    ws.stream.close(None).await.unwrap();
    drop(ws);
    let mut gone = false;
    for _ in 0..50 {
        let r = server.rpc(&call(10, "list_files", json!({}))).await;
        if r["error"]["code"] == -32602 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the session ends after its WebSocket detaches");
    drop((second, other));
    server.stop().await;
}
