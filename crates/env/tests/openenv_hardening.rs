//! Issue 19 for the OpenEnv client and pool, against real openenv-core servers started by the
//! tests from `$OPENENV_VENV` (the venv of ../shared/openenv/start-server.sh): a refused
//! connection is its own failure cause (never a timeout) and its text reaches the stats and
//! the log; a server gone for good stops the pool after `server_down_budget`; a server with
//! fewer sessions than `max_concurrent` lowers the pool's concurrency for it; an MCP-tools-only
//! server is refused at the first reset.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{free_port, service_var, PyServer, ScriptedPolicy};
use composer_env::{
    Env, EnvError, EnvPool, EpisodeConfig, EpisodeEnd, FailureKind, OpenEnvClient,
    OpenEnvClientConfig, PoolConfig, ResetOptions,
};

fn fast_config() -> OpenEnvClientConfig {
    OpenEnvClientConfig {
        connect_retries: 3,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(400),
        ..Default::default()
    }
}

fn short_episode() -> EpisodeConfig {
    EpisodeConfig {
        max_turns: 2,
        max_total_tokens: 1024,
    }
}

#[tokio::test]
async fn refused_connection_is_its_own_cause_not_a_timeout() {
    // Nothing listens on this port: every attempt is refused at once.
    let url = format!("http://127.0.0.1:{}", free_port());
    match OpenEnvClient::connect(&url, fast_config()).await {
        Err(e @ EnvError::Refused(_)) => {
            assert_eq!(e.kind(), FailureKind::Refused);
            assert!(e.to_string().contains("connection refused"), "{e}");
            assert!(e.to_string().contains("/health"), "{e}");
        }
        other => panic!("expected a refused connection, got {:?}", other.err()),
    }
}

/// Starts an own echo server with `max_sessions`, or None (SKIPPED) without `$OPENENV_VENV`.
async fn own_server(test: &str, max_sessions: usize, logs: &Path) -> Option<PyServer> {
    let venv = service_var("OPENENV_VENV", test)?;
    let mut server = PyServer::spawn(&PathBuf::from(venv), free_port(), max_sessions, logs);
    server.wait_healthy().await;
    Some(server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_gone_for_good_stops_the_pool_with_a_clear_error() {
    let logs = tempfile::tempdir().unwrap();
    let Some(mut server) = own_server(
        "server_gone_for_good_stops_the_pool_with_a_clear_error",
        2,
        logs.path(),
    )
    .await
    else {
        return;
    };
    let client = OpenEnvClient::connect(&server.url(), fast_config())
        .await
        .unwrap();
    let mut pool = EnvPool::new(PoolConfig {
        server_down_budget: Duration::from_secs(2),
        // Fail fast so this test stays short; the down budget is what stops the pool.
        call_timeout: Duration::from_secs(5),
        ..Default::default()
    });
    pool.add_server("echo", client.factory(), 2);
    let mut policy = ScriptedPolicy::new(&["abc"]);
    let ep = pool
        .run_episode(&mut policy, ResetOptions::default(), &short_episode())
        .await
        .unwrap();
    assert_eq!(ep.end, EpisodeEnd::MaxTurns, "{:?}", ep.end);

    // The server goes away for good: episodes fail as refused, then the pool gives up.
    server.stop();
    let mut error = None;
    for _ in 0..200 {
        match pool
            .run_episode(&mut policy, ResetOptions::default(), &short_episode())
            .await
        {
            Ok(ep) => match &ep.end {
                EpisodeEnd::EnvFailed { kind, message } => {
                    assert!(
                        matches!(kind, FailureKind::Refused | FailureKind::Connection),
                        "{kind:?}: {message}"
                    );
                    assert_ne!(*kind, FailureKind::Timeout, "{message}");
                }
                other => panic!("an episode ran without a server: {other:?}"),
            },
            Err(e) => {
                error = Some(format!("{e:#}"));
                break;
            }
        }
    }
    let error = error.expect("the pool kept retrying a dead server");
    assert!(
        error.contains("down") && error.contains("server_down_budget"),
        "{error}"
    );
    assert!(
        error.contains("`echo`") && error.contains("refused"),
        "{error}"
    );
    let stats = pool.stats();
    assert!(stats.failures.refused >= 1, "{:?}", stats.failures);
    assert_eq!(stats.failures.timeout, 0, "{:?}", stats.failures);
    let last = stats.failures.last_error.clone().unwrap_or_default();
    assert!(
        last.starts_with("echo: ") && last.contains("refused"),
        "{last}"
    );
    assert!(stats.servers[0].gone);
    // The error text is in the metrics' form of the stats too (`env/failures`).
    let json = serde_json::to_value(&stats.failures).unwrap();
    assert!(
        json["last_error"].as_str().unwrap().contains("refused"),
        "{json}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn smaller_server_capacity_lowers_the_pool_concurrency() {
    let logs = tempfile::tempdir().unwrap();
    // The server holds one session; the pool is configured for three.
    let Some(server) = own_server(
        "smaller_server_capacity_lowers_the_pool_concurrency",
        1,
        logs.path(),
    )
    .await
    else {
        return;
    };
    let client = OpenEnvClient::connect(
        &server.url(),
        OpenEnvClientConfig {
            // Refusals reach the pool at once instead of being retried in the client.
            capacity_retries: 0,
            ..fast_config()
        },
    )
    .await
    .unwrap();
    let mut pool = EnvPool::new(PoolConfig::default());
    pool.add_server("small", client.factory(), 3);
    let pool = Arc::new(pool);
    let mut tasks = Vec::new();
    for k in 0..3 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let mut policy = ScriptedPolicy::new(&["ab"]);
            policy.delay = Duration::from_millis(100);
            let mut ends = Vec::new();
            for _ in 0..2 {
                let ep = pool
                    .run_episode(&mut policy, ResetOptions::seeded(k), &short_episode())
                    .await
                    .unwrap();
                ends.push(ep.end);
            }
            ends
        }));
    }
    for t in tasks {
        for end in t.await.unwrap() {
            // No episode failed (and none would be replaced by a duplicate of a peer).
            assert_eq!(end, EpisodeEnd::MaxTurns);
        }
    }
    let stats = pool.stats();
    assert_eq!(stats.episodes_ok, 6, "{stats:?}");
    assert_eq!(stats.episodes_failed, 0, "{stats:?}");
    assert_eq!(stats.servers[0].max_concurrent, 1, "{stats:?}");
    assert!(stats.failures.capacity >= 1, "{:?}", stats.failures);
    // The server's own words reach the stats.
    let last = stats.failures.last_error.clone().unwrap_or_default();
    assert!(
        last.contains("small: ") && last.contains("max_sessions 1"),
        "{last}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tool_server_is_refused_at_the_first_reset() {
    let Some(venv) = service_var(
        "OPENENV_VENV",
        "mcp_tool_server_is_refused_at_the_first_reset",
    ) else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut server = PyServer::spawn_app(&PathBuf::from(venv), logs.path(), "mcp_tool_app");
    server.wait_healthy().await;
    let client = OpenEnvClient::connect(&server.url(), fast_config())
        .await
        .unwrap();
    assert!(client.mcp_tool_interface().is_some(), "{}", client.schema());
    let mut env = client.session();
    match env.reset(ResetOptions::default()).await {
        Err(e) => {
            let m = e.to_string();
            // Refused for plain-action play, pointing at the tool-call client.
            assert!(m.contains("speaks only MCP tools"), "{m}");
            assert!(m.contains("kind = \"openenv_tools\""), "{m}");
            assert!(m.contains("CallToolAction"), "{m}");
            assert!(m.contains(&server.url()), "{m}");
        }
        Ok(r) => panic!("an MCP tool server was accepted: {r:?}"),
    }
    assert!(!env.is_connected(), "refused before opening a session");
}

/// A hostile (or broken) server's `/schema` of 40 MB is refused with an error naming it,
/// not buffered whole: the client caps the bodies of its small HTTP replies.
#[tokio::test]
async fn a_huge_http_body_from_a_hostile_server_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = vec![0u8; 4096];
                let n = sock.read(&mut head).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&head[..n]).to_string();
                let reply = if head.starts_with("GET /health") {
                    r#"{"status":"healthy"}"#.to_string()
                } else {
                    format!("{{\"action\": {{}}{}}}", " ".repeat(40 << 20))
                };
                // No Content-Length: the body ends when the connection closes.
                let _ = sock
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n")
                    .await;
                let _ = sock.write_all(reply.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    let result = OpenEnvClient::connect(&format!("http://{addr}"), fast_config()).await;
    match result {
        Err(EnvError::Protocol(m)) => {
            assert!(m.contains("/schema") && m.contains("bytes"), "{m}")
        }
        Err(other) => panic!("expected a protocol error naming /schema, got {other}"),
        Ok(_) => panic!("a 40 MB /schema was accepted"),
    }
    server.abort();
}
