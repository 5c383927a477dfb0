//! Our MCP tool client ([`ToolEnv`] for [`composer_env::RemoteEnv`]) against an MCP-tool
//! environment served by the `openenv` 0.10.0 package itself: tests/fixtures/
//! openenv_mcp_env.py subclasses the package's `MCPEnvironment` and serves it with the
//! package's `create_app` (only its four tools are ours), run as a child process from
//! `$OPENENV_MCP_VENV` (tools/openenv-mcp-venv.sh; unset: SKIPPED, or a failure under `CI`).
//! Reference values are the fixture's: `add(3, 4)` is 7, `submit("7")` after a reset with
//! `target = "7"` ends the episode with reward 1.0, a wrong answer with 0.0.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{service_var, PyServer};
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

/// Serves the fixture app `module` from `$OPENENV_MCP_VENV` (None: skipped) and connects.
async fn serve(module: &str, test: &str) -> Option<(PyServer, OpenEnvClient, tempfile::TempDir)> {
    let venv = service_var("OPENENV_MCP_VENV", test)?;
    let logs = tempfile::tempdir().unwrap();
    let mut server = PyServer::spawn_app(&PathBuf::from(venv), logs.path(), module);
    server.wait_healthy().await;
    let client = OpenEnvClient::connect(&server.url(), fast_config())
        .await
        .unwrap();
    Some((server, client, logs))
}

fn reset_to(target: &str) -> ResetOptions {
    let mut opts = ResetOptions::default();
    opts.extra.insert("target".into(), json!(target));
    opts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_tool_client_plays_an_episode_on_the_openenv_packages_mcp_server() {
    let Some((server, client, _logs)) = serve(
        "openenv_mcp_env",
        "our_tool_client_plays_an_episode_on_the_openenv_packages_mcp_server",
    )
    .await
    else {
        return;
    };
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
        first.observation["metadata"]["statement"], "Use the tools to compute 7, then submit it.",
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_that_failed_on_the_packages_server_is_an_error_naming_why() {
    let Some((_server, client, _logs)) = serve(
        "openenv_mcp_env",
        "a_listing_that_failed_on_the_packages_server_is_an_error_naming_why",
    )
    .await
    else {
        return;
    };
    let mut env = client.tool_session();
    let mut opts = ResetOptions::default();
    opts.extra.insert("break_listing".into(), json!(true));
    ToolEnv::reset(&mut env, opts).await.unwrap();
    // MCPEnvironment answers `{"tools": [], "metadata": {"error", "error_type"}}`.
    match env.list_tools().await {
        Err(composer_env::EnvError::Server { code, message }) => {
            assert_eq!(code, "list_tools_failed");
            assert!(
                message.contains("the tool registry is unavailable"),
                "{message}"
            );
        }
        other => panic!("a failed listing read as {other:?}"),
    }
    // The session survives: tools still work.
    let echoed = env
        .call_tool("echo", json!({"message": "ok"}))
        .await
        .unwrap();
    assert_eq!(echoed.text, "ok");
    ToolEnv::close(&mut env).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_env_with_its_own_action_class_is_played_over_json_rpc() {
    let Some((_server, client, _logs)) = serve(
        "openenv_mcp_env_own_action",
        "an_env_with_its_own_action_class_is_played_over_json_rpc",
    )
    .await
    else {
        return;
    };
    // Its /schema shows its own action, so even a plain session may play it.
    assert_eq!(client.mcp_tool_interface(), None, "{}", client.schema());
    let mut env = client.tool_session();
    ToolEnv::reset(&mut env, reset_to("3")).await.unwrap();
    // The gym-style `list_tools` step is refused (VALIDATION_ERROR); the listing comes
    // over JSON-RPC, and so do the calls from then on.
    let tools = env.list_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["echo", "add", "divide", "submit"]);
    let sum = env.call_tool("add", json!({"a": 1, "b": 2})).await.unwrap();
    assert_eq!(
        (sum.text.as_str(), sum.error_type.as_deref()),
        ("3", None),
        "{sum:?}"
    );
    let unknown = env.call_tool("nope", json!({})).await.unwrap();
    assert_eq!(unknown.error_type.as_deref(), Some("tool_not_found"));
    let bad_args = env
        .call_tool("add", json!({"a": "x", "b": 1}))
        .await
        .unwrap();
    assert_eq!(
        bad_args.error_type.as_deref(),
        Some("invalid_args"),
        "{bad_args:?}"
    );
    let raised = env
        .call_tool("divide", json!({"a": 1, "b": 0}))
        .await
        .unwrap();
    assert_eq!(raised.error_type.as_deref(), Some("execution_error"));
    assert!(raised.text.contains("division by zero"), "{}", raised.text);
    // JSON-RPC has no reward or done: the tool runs, the episode goes on.
    let submitted = env
        .call_tool("submit", json!({"answer": "3"}))
        .await
        .unwrap();
    assert_eq!(
        (submitted.text.as_str(), submitted.done, submitted.reward),
        ("submitted '3'", false, None)
    );
    // The env's own actions still go through `step`.
    let own = Env::step(&mut env, json!({"guess": "3"})).await.unwrap();
    assert!(own.observation["metadata"]["error"]
        .as_str()
        .is_some_and(|e| e.contains("GuessAction")));
    ToolEnv::close(&mut env).await.unwrap();
}
