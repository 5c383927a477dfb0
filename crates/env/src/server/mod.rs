//! An OpenEnv-protocol server (as openenv-core 0.3.0 / openenv 0.10 speak it, see
//! PROTOCOL.md) for any [`EnvFactory`]: stateless HTTP `/reset` `/step` `/state`, `/health`
//! `/metadata` `/schema`, stateful episodes over WebSocket `/ws` (one env per session), and
//! for envs with MCP tools ([`Env::mcp_tools`]) JSON-RPC on `POST /mcp` and in `{"type":"mcp"}`
//! messages, with HTTP-made sessions that a WebSocket `/ws?session_id=ID` attaches to.

mod mcp;
mod sessions;
mod ws;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::env::{EnvError, EnvFactory, ResetOptions, StepResult};
use crate::schema::validate_action;
use sessions::{close_env, reap_idle_sessions, SessionError, SessionStore, SharedEnv};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Most concurrent sessions (WebSocket and HTTP-made); more are refused with
    /// `CAPACITY_REACHED` (JSON-RPC: a `-32000` error).
    pub max_sessions: usize,
    /// Largest accepted WebSocket message.
    pub max_message_bytes: usize,
    /// How long a WebSocket peer may stay silent while the server waits for it: it is pinged
    /// every third of this, and a peer that answers nothing (no message, no pong) for this
    /// long, or does not take a reply within it, is dropped and its session ends. A client
    /// that vanished without closing its TCP connection would otherwise hold its session
    /// (a `max_sessions` slot and its episode's sandbox) forever. Live clients answer pings
    /// while idle (tungstenite, `websockets`), so they are not dropped.
    pub peer_timeout: Duration,
    /// A session without a WebSocket attached (made by `openenv/session/create`, or whose
    /// WebSocket left without closing it) that nobody uses for this long is ended, so an
    /// HTTP client that vanished does not hold its slot (and sandbox) forever.
    pub session_idle_timeout: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            max_sessions: 16,
            max_message_bytes: 128 << 20,
            peer_timeout: Duration::from_secs(120),
            session_idle_timeout: Duration::from_secs(600),
        }
    }
}

#[derive(Clone)]
struct AppState {
    factory: EnvFactory,
    config: ServeConfig,
    sessions: Arc<SessionStore>,
    shutdown: watch::Receiver<bool>,
    /// The env's MCP tools (`None`: it speaks no MCP).
    mcp_tools: Arc<Option<Vec<Value>>>,
    schema: Arc<Value>,
    action_schema: Arc<Option<Value>>,
    metadata: Arc<Value>,
}

/// Serves `factory` on `addr` until Ctrl-C or SIGTERM (open sessions get close code 1012).
/// `on_bound` gets the address actually bound (the port chosen for port 0) once the listener
/// is up, before the first connection.
pub async fn serve_env(
    factory: EnvFactory,
    addr: SocketAddr,
    config: ServeConfig,
    on_bound: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    if config.max_sessions == 0 {
        anyhow::bail!("max_sessions must be at least 1 (every session would be refused)");
    }
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let bound = listener.local_addr().unwrap_or(addr);
    tracing::info!("serving the OpenEnv protocol on http://{bound} (ws://{bound}/ws)");
    on_bound(bound);
    serve_env_until(factory, listener, config, shutdown_signal()).await
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Serves `factory` on `listener` until `shutdown` completes; then open WebSocket sessions
/// are closed with code 1012 ("service restart") and the listener is released.
pub async fn serve_env_until(
    factory: EnvFactory,
    listener: TcpListener,
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // One env up front: the schema and metadata, and an early, clear factory error.
    let probe = factory().context("creating the env to read its schema and metadata")?;
    let action_schema = probe.action_schema();
    let schema = json!({
        "action": action_schema.clone().unwrap_or_else(|| json!({"type": "object"})),
        "observation": probe.observation_schema(),
        "state": probe.state_schema(),
    });
    let metadata = probe.metadata();
    let mcp_tools = probe.mcp_tools();
    drop(probe);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let state = AppState {
        factory,
        sessions: Arc::new(SessionStore::new(
            config.max_sessions,
            config.session_idle_timeout,
        )),
        config,
        shutdown: shutdown_rx,
        mcp_tools: Arc::new(mcp_tools),
        schema: Arc::new(schema),
        action_schema: Arc::new(action_schema),
        metadata: Arc::new(metadata),
    };
    let app = Router::new()
        .route(
            "/health",
            get(|| async { Json(json!({"status": "healthy"})) }),
        )
        .route(
            "/metadata",
            get(|State(s): State<AppState>| async move { Json((*s.metadata).clone()) }),
        )
        .route(
            "/schema",
            get(|State(s): State<AppState>| async move { Json((*s.schema).clone()) }),
        )
        .route("/reset", post(http_reset))
        .route("/step", post(http_step))
        .route("/state", get(http_state))
        .route("/mcp", post(mcp::http_mcp))
        .route("/ws", get(ws::ws_upgrade))
        .with_state(state.clone());
    let reaper = tokio::spawn(reap_idle_sessions(Arc::clone(&state.sessions)));
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            let _ = shutdown_tx.send(true);
        })
        .await
        .context("serving the OpenEnv protocol");
    reaper.abort();
    // HTTP-made sessions nobody closed: end their episodes (sandboxes) too.
    for env in state.sessions.drain() {
        close_env(env).await;
    }
    served
}

/// The wire form of a result; openenv 0.10 also sends a non-empty observation `metadata`
/// as a top-level sibling.
fn wire(r: &StepResult) -> Value {
    let mut v = r.to_wire();
    if let Some(meta) = r
        .observation
        .get("metadata")
        .filter(|m| m.as_object().is_some_and(|o| !o.is_empty()))
    {
        v["metadata"] = meta.clone();
    }
    v
}

fn detail(issues: Value) -> Response {
    (
        StatusCode::UNPROCESSABLE_ENTITY,
        Json(json!({ "detail": issues })),
    )
        .into_response()
}

fn internal_error(e: impl std::fmt::Display) -> Response {
    tracing::warn!("env failed in an HTTP request: {e}");
    (StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error").into_response()
}

/// Parses an optional JSON object body (FastAPI style 422 on errors).
#[allow(clippy::result_large_err)] // the error is the ready HTTP response; it is returned once per request
fn parse_body(body: &Bytes) -> Result<Map<String, Value>, Response> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(detail(
            json!([{"type": "model_attributes_type", "loc": ["body"],
            "msg": "Input should be a valid dictionary or object to extract fields from", "input": other}]),
        )),
        Err(e) => Err(detail(json!([{"type": "json_invalid", "loc": ["body", 0],
            "msg": "JSON decode error", "input": {}, "ctx": {"error": e.to_string()}}]))),
    }
}

/// Reset options from a request object; issues use `loc_prefix` (`["body"]` over HTTP).
fn reset_options(data: &Map<String, Value>, loc_prefix: &[&str]) -> Result<ResetOptions, Value> {
    let loc = |field: &str| {
        let mut l: Vec<Value> = loc_prefix.iter().map(|s| json!(s)).collect();
        l.push(json!(field));
        l
    };
    if let Some(seed) = data.get("seed").filter(|v| !v.is_null()) {
        match seed.as_i64() {
            Some(s) if s < 0 => {
                return Err(json!([{"type": "greater_than_equal", "loc": loc("seed"),
                "msg": "Input should be greater than or equal to 0", "input": seed, "ctx": {"ge": 0}}]))
            }
            Some(_) => {}
            None if seed.is_u64() => {}
            None => {
                return Err(json!([{"type": "int_type", "loc": loc("seed"),
                "msg": "Input should be a valid integer", "input": seed}]))
            }
        }
    }
    if let Some(id) = data.get("episode_id").filter(|v| !v.is_null()) {
        match id.as_str() {
            Some(s) if s.chars().count() > 255 => {
                return Err(json!([{"type": "string_too_long", "loc": loc("episode_id"),
                "msg": "String should have at most 255 characters", "input": id}]))
            }
            Some(_) => {}
            None => {
                return Err(json!([{"type": "string_type", "loc": loc("episode_id"),
                "msg": "Input should be a valid string", "input": id}]))
            }
        }
    }
    let mut data = data.clone();
    data.retain(|_, v| !v.is_null());
    serde_json::from_value(Value::Object(data)).map_err(
        |e| json!([{"type": "value_error", "loc": loc_prefix, "msg": e.to_string(), "input": {}}]),
    )
}

fn validation_issues(state: &AppState, action: &Value) -> Option<Value> {
    let schema = state.action_schema.as_ref().as_ref()?;
    let issues = validate_action(schema, action);
    if issues.is_empty() {
        None
    } else {
        Some(serde_json::to_value(issues).unwrap_or(Value::Null))
    }
}

async fn http_reset(State(state): State<AppState>, body: Bytes) -> Response {
    let data = match parse_body(&body) {
        Ok(d) => d,
        Err(r) => return r,
    };
    let opts = match reset_options(&data, &["body"]) {
        Ok(o) => o,
        Err(issues) => return detail(issues),
    };
    let mut env = match (state.factory)() {
        Ok(e) => e,
        Err(e) => return internal_error(e),
    };
    let result = env.reset(opts).await;
    let _ = env.close().await;
    match result {
        Ok(r) => Json(wire(&r)).into_response(),
        Err(e) => internal_error(e),
    }
}

async fn http_step(State(state): State<AppState>, body: Bytes) -> Response {
    let data = match parse_body(&body) {
        Ok(d) => d,
        Err(r) => return r,
    };
    let Some(action) = data.get("action") else {
        return detail(
            json!([{"type": "missing", "loc": ["body", "action"], "msg": "Field required",
            "input": data}]),
        );
    };
    if let Some(issues) = validation_issues(&state, action) {
        return detail(issues);
    }
    let mut env = match (state.factory)() {
        Ok(e) => e,
        Err(e) => return internal_error(e),
    };
    let result = env.step(action.clone()).await;
    let _ = env.close().await;
    match result {
        Ok(r) => Json(wire(&r)).into_response(),
        Err(EnvError::InvalidAction { message, errors }) => detail(if errors.is_null() {
            json!([{"type": "value_error", "loc": ["action"], "msg": message, "input": action}])
        } else {
            errors
        }),
        Err(e) => internal_error(e),
    }
}

async fn http_state(State(state): State<AppState>) -> Response {
    let mut env = match (state.factory)() {
        Ok(e) => e,
        Err(e) => return internal_error(e),
    };
    let result = env.state().await;
    let _ = env.close().await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => internal_error(e),
    }
}
