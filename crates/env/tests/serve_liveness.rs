//! Sessions of clients that are gone do not hold the server's slots forever: a WebSocket
//! peer that stops answering (a client that vanished without closing its TCP connection) is
//! dropped after `peer_timeout`, and an HTTP-made session nobody uses is ended after
//! `session_idle_timeout`; a live client that sits idle keeps its session.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use composer_env::{
    builtin_env_factory, serve_env_until, Env, OpenEnvClient, OpenEnvClientConfig, ResetOptions,
    ServeConfig,
};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

/// Serves the echo env with one session at most and the given liveness limits.
async fn serve(config: ServeConfig) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let factory = builtin_env_factory("echo").unwrap();
    tokio::spawn(serve_env_until(factory, listener, config, async move {
        let _ = rx.await;
    }));
    (addr, tx)
}

/// The first frame a fresh WebSocket gets for a `state` request (an error frame when the
/// server refused the session).
async fn first_reply(addr: SocketAddr) -> Value {
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/ws"))
        .await
        .unwrap();
    use futures::SinkExt;
    let _ = ws.send(Message::text(r#"{"type":"state"}"#)).await;
    loop {
        match tokio::time::timeout(Duration::from_secs(5), ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                let _ = ws.close(None).await;
                return v;
            }
            Ok(Some(Ok(_))) => continue,
            other => panic!("no reply: {other:?}"),
        }
    }
}

/// Polls until a fresh WebSocket gets a session (a `state` reply), for at most `limit`.
async fn wait_for_a_free_slot(addr: SocketAddr, limit: Duration) -> Result<(), Value> {
    let t0 = Instant::now();
    loop {
        let v = first_reply(addr).await;
        if v["type"] == "state" {
            return Ok(());
        }
        if t0.elapsed() > limit {
            return Err(v);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_websocket_peer_is_dropped_and_a_live_idle_one_is_kept() {
    let (addr, stop) = serve(ServeConfig {
        max_sessions: 1,
        peer_timeout: Duration::from_millis(1500),
        ..Default::default()
    })
    .await;
    // A client that vanished: connected, then never reads (so never answers a ping).
    let (ghost, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/ws"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = first_reply(addr).await;
    assert_eq!(refused["data"]["code"], "CAPACITY_REACHED", "{refused}");
    wait_for_a_free_slot(addr, Duration::from_secs(10))
        .await
        .unwrap_or_else(|v| panic!("the silent peer still holds the only slot: {v}"));
    drop(ghost);
    // A live client idle for longer than the peer timeout keeps its session (it answers the
    // server's pings from its socket task).
    let client = OpenEnvClient::connect(&format!("http://{addr}"), OpenEnvClientConfig::default())
        .await
        .unwrap();
    let mut env = client.session();
    env.reset(ResetOptions::default()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let r = env.step(json!({"message": "still here"})).await.unwrap();
    assert_eq!(r.observation["echoed_message"], "still here");
    env.close().await.unwrap();
    let _ = stop.send(());
}

async fn rpc(addr: SocketAddr, body: Value) -> Value {
    reqwest::Client::new()
        .post(format!("http://{addr}/mcp"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unused_http_session_is_ended_after_its_idle_timeout() {
    let (addr, stop) = serve(ServeConfig {
        max_sessions: 1,
        session_idle_timeout: Duration::from_millis(1500),
        ..Default::default()
    })
    .await;
    let create = json!({"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"});
    // A client that made a session and crashed before using or closing it.
    let made = rpc(addr, create.clone()).await;
    let first = made["result"]["session_id"]
        .as_str()
        .expect("a session")
        .to_string();
    let refused = rpc(addr, create.clone()).await;
    assert_eq!(refused["error"]["code"], -32000, "{refused}");
    // Left alone past the timeout, it ends and frees the slot.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let made = rpc(addr, create.clone()).await;
    let second = made["result"]["session_id"]
        .as_str()
        .unwrap_or_else(|| panic!("the unused session still holds the only slot: {made}"))
        .to_string();
    let gone = rpc(
        addr,
        json!({"jsonrpc": "2.0", "id": 3, "method": "openenv/session/close",
               "params": {"session_id": first}}),
    )
    .await;
    assert!(
        gone["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("Unknown session_id"),
        "{gone}"
    );
    // A session with a WebSocket attached is in use however long it idles.
    let (ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/ws?session_id={second}"))
        .await
        .unwrap();
    let (_sink, mut stream) = ws.split();
    let reader = tokio::spawn(async move { while stream.next().await.is_some() {} });
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let refused = rpc(addr, create.clone()).await;
    assert_eq!(refused["error"]["code"], -32000, "attached: {refused}");
    reader.abort();
    let _ = stop.send(());
}
