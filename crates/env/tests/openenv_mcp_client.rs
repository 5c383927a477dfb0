//! Our MCP tool client ([`ToolEnv`] for [`composer_env::RemoteEnv`]) against an MCP-tool
//! environment served by the `openenv` 0.10.0 package itself: tests/fixtures/
//! openenv_mcp_env.py subclasses the package's `MCPEnvironment` and serves it with the
//! package's `create_app` (only its four tools are ours), run as a child process from
//! `$OPENENV_MCP_VENV` (tools/openenv-mcp-venv.sh; unset: SKIPPED, or a failure under `CI`).
//! Reference values are the fixture's: `add(3, 4)` is 7, `submit("7")` after a reset with
//! `target = "7"` ends the episode with reward 1.0, a wrong answer with 0.0.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{free_port, service_var, PyServer};
use composer_env::{
    parse_tool_listing, Env, OpenEnvClient, OpenEnvClientConfig, ResetOptions, ToolEnv,
};
use serde_json::json;

fn fast_config() -> OpenEnvClientConfig {
    OpenEnvClientConfig {
        connect_retries: 3,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(400),
        ..Default::default()
    }
}

fn reset_to(target: &str) -> ResetOptions {
    let mut opts = ResetOptions::default();
    opts.extra.insert("target".into(), json!(target));
    opts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_tool_client_plays_an_episode_on_the_openenv_packages_mcp_server() {
    let Some(venv) = service_var(
        "OPENENV_MCP_VENV",
        "our_tool_client_plays_an_episode_on_the_openenv_packages_mcp_server",
    ) else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut server = PyServer::spawn_app(
        &PathBuf::from(venv),
        free_port(),
        logs.path(),
        &fixtures,
        "openenv_mcp_env",
    );
    server.wait_healthy().await;
    let client = OpenEnvClient::connect(&server.url(), fast_config())
        .await
        .unwrap();
    // The package's /schema shows the tool interface (CallToolAction).
    let interface = client.mcp_tool_interface();
    assert!(
        interface
            .as_deref()
            .is_some_and(|i| i.contains("CallToolAction")),
        "{}",
        client.schema()
    );
    let mut env = client.tool_session();

    // Reset: the reset keys reach the env's `reset(**kwargs)`; the statement comes back
    // in the observation's metadata.
    let first = ToolEnv::reset(&mut env, reset_to("7")).await.unwrap();
    assert!(!first.done);
    assert_eq!(
        first.observation["metadata"]["statement"],
        "Use the tools to compute 7, then submit it.",
        "{:?}",
        first.observation
    );

    // The listing: names, descriptions and FastMCP's argument schemas.
    let tools = env.list_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["echo", "add", "divide", "submit"]);
    let add = &tools[1];
    assert_eq!(add.description, "Adds two integers.");
    assert_eq!(add.input_schema["properties"]["a"]["type"], "integer");
    assert_eq!(add.input_schema["required"], json!(["a", "b"]));
    assert_eq!(
        add.as_chat_tool()["function"]["parameters"],
        add.input_schema
    );
    // The JSON-RPC listing (`tools/list` over the session) is the same set, `inputSchema`d.
    let rpc = env
        .mcp(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
        .await
        .unwrap();
    assert_eq!(parse_tool_listing(&rpc["result"]).unwrap(), tools);

    // Valid calls: the result's text content is what the agent sees.
    let sum = env.call_tool("add", json!({"a": 3, "b": 4})).await.unwrap();
    assert_eq!(
        (sum.text.as_str(), sum.error_type.as_deref(), sum.done),
        ("7", None, false),
        "{sum:?}"
    );
    let echoed = env
        .call_tool("echo", json!({"message": "hello\nworld"}))
        .await
        .unwrap();
    assert_eq!(echoed.text, "hello\nworld");

    // Bad calls are error outcomes for the agent, and the session goes on.
    let bad_args = env.call_tool("add", json!({"a": "x"})).await.unwrap();
    assert_eq!(
        bad_args.error_type.as_deref(),
        Some("invalid_args"),
        "{bad_args:?}"
    );
    assert!(
        bad_args.text.starts_with("Error (invalid_args): ")
            && bad_args.text.contains("valid integer"),
        "{}",
        bad_args.text
    );
    let unknown = env.call_tool("nope", json!({})).await.unwrap();
    assert_eq!(unknown.error_type.as_deref(), Some("tool_not_found"));
    assert!(unknown.text.contains("'nope'"), "{}", unknown.text);
    // Arguments that are not an object fail the server's message validation
    // (VALIDATION_ERROR frame), which we turn into an invalid_args outcome.
    let not_object = env.call_tool("add", json!([3, 4])).await.unwrap();
    assert_eq!(not_object.error_type.as_deref(), Some("invalid_args"));
    assert!(
        not_object.text.contains("valid dictionary"),
        "{}",
        not_object.text
    );
    let raised = env
        .call_tool("divide", json!({"a": 1, "b": 0}))
        .await
        .unwrap();
    assert_eq!(raised.error_type.as_deref(), Some("execution_error"));
    assert!(raised.text.contains("division by zero"), "{}", raised.text);
    let quarter = env
        .call_tool("divide", json!({"a": 1, "b": 4}))
        .await
        .unwrap();
    assert_eq!((quarter.text.as_str(), quarter.error_type), ("0.25", None));

    // Steps the server counted: list_tools and every call it took as a step (the
    // non-object arguments were refused before reaching the env).
    let state = env.state().await.unwrap();
    assert_eq!(state["step_count"], 7, "{state}");

    // `submit` ends the episode with the env's reward.
    let submitted = env
        .call_tool("submit", json!({"answer": "7"}))
        .await
        .unwrap();
    assert!(submitted.done, "{submitted:?}");
    assert_eq!(submitted.reward, Some(1.0));
    assert_eq!(submitted.text, "submitted '7'");
    ToolEnv::close(&mut env).await.unwrap();
    assert!(!env.is_connected());

    // A second episode on the same RemoteEnv reconnects; a wrong answer scores 0.
    let again = ToolEnv::reset(&mut env, reset_to("9")).await.unwrap();
    assert!(again.observation["metadata"]["statement"]
        .as_str()
        .is_some_and(|s| s.contains("compute 9")));
    let wrong = env
        .call_tool("submit", json!({"answer": "7"}))
        .await
        .unwrap();
    assert_eq!((wrong.done, wrong.reward), (true, Some(0.0)), "{wrong:?}");
    ToolEnv::close(&mut env).await.unwrap();
    let fresh = env.call_tool("echo", json!({"message": "x"})).await;
    assert!(fresh.is_err(), "a closed session took a call: {fresh:?}");
    // The server itself never failed a request (FastMCP does log `divide`'s exception).
    let log = server.log_tail();
    assert!(!log.contains("Exception in ASGI"), "server log:\n{log}");
}
