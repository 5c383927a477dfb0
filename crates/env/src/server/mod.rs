//! An OpenEnv-protocol server (as openenv-core 0.3.0 / openenv 0.10 speak it, see
//! PROTOCOL.md) for any [`EnvFactory`]: stateless HTTP `/reset` `/step` `/state`, `/health`
//! `/metadata` `/schema`, stateful episodes over WebSocket `/ws` (one env per session), and
//! for envs with MCP tools ([`Env::mcp_tools`]) JSON-RPC on `POST /mcp` and in `{"type":"mcp"}`
//! messages, with HTTP-made sessions that a WebSocket `/ws?session_id=ID` attaches to.

mod mcp;
mod sessions;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
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
        .route("/ws", get(ws_upgrade))
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

/// The `/ws` query: `session_id` attaches to an HTTP-made session.
#[derive(serde::Deserialize)]
struct WsQuery {
    session_id: Option<String>,
}

async fn ws_upgrade(
    State(state): State<AppState>,
    Query(query): Query<WsQuery>,
    ws: WebSocketUpgrade,
) -> Response {
    let max = state.config.max_message_bytes;
    ws.max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| ws_session(socket, state, query.session_id))
}

fn error_frame(code: &str, message: &str, extra: Value) -> Message {
    let mut data = json!({"message": message, "code": code});
    if let (Some(d), Value::Object(e)) = (data.as_object_mut(), extra) {
        d.extend(e);
    }
    Message::text(json!({"type": "error", "data": data}).to_string())
}

fn close_frame(code: u16, reason: &str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}

/// What to do after handling one client message.
enum Next {
    Reply(Message),
    /// Reply (if any), then close with 1000.
    Close(Option<Message>),
}

/// Makes the WebSocket's own session, or attaches to the HTTP-made one named in the query.
async fn open_ws_session(
    state: &AppState,
    attach_to: Option<String>,
) -> Result<(String, SharedEnv), Message> {
    if let Some(id) = attach_to {
        return match state.sessions.attach(&id) {
            Ok(env) => Ok((id, env)),
            Err(e) => Err(error_frame("SESSION_ERROR", &e.to_string(), json!({}))),
        };
    }
    let capacity = |e: SessionError| {
        let (active, max) = match e {
            SessionError::Capacity { active, max } => (active, max),
            _ => (state.sessions.active(), state.sessions.max()),
        };
        error_frame(
            "CAPACITY_REACHED",
            &e.to_string(),
            json!({"active_sessions": active, "max_sessions": max}),
        )
    };
    for idle in state.sessions.reap_idle() {
        close_env(idle).await;
    }
    state.sessions.check_room().map_err(capacity)?;
    let env = (state.factory)().map_err(|e| {
        error_frame(
            "FACTORY_ERROR",
            &format!("{e:#}"),
            json!({"factory_name": "composer-env"}),
        )
    })?;
    match state.sessions.insert(env, true) {
        Ok(session) => Ok(session),
        Err((e, mut env)) => {
            let _ = env.close().await;
            Err(capacity(e))
        }
    }
}

async fn ws_session(mut socket: WebSocket, state: AppState, attach_to: Option<String>) {
    let (session_id, env) = match open_ws_session(&state, attach_to).await {
        Ok(s) => s,
        Err(frame) => {
            let _ = socket.send(frame).await;
            let _ = socket.send(close_frame(1000, "")).await;
            return;
        }
    };
    let mut shutdown = state.shutdown.clone();
    let peer_timeout = state.config.peer_timeout.max(Duration::from_millis(30));
    let mut pings = tokio::time::interval_at(
        tokio::time::Instant::now() + peer_timeout / 3,
        peer_timeout / 3,
    );
    pings.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When the peer last sent anything, or the server last finished a reply to it (time
    // spent on a step is the server's, not the peer's silence).
    let mut last_heard = Instant::now();
    loop {
        let msg = tokio::select! {
            _ = wait_for_shutdown(&mut shutdown) => {
                let _ = socket.send(close_frame(1012, "service restart")).await;
                break;
            }
            _ = pings.tick() => {
                if last_heard.elapsed() >= peer_timeout {
                    tracing::info!("session {session_id}: the peer answered nothing for {peer_timeout:?}; dropping it");
                    let _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        socket.send(close_frame(1001, "no answer to pings")),
                    )
                    .await;
                    break;
                }
                if send_within(&mut socket, Message::Ping(Bytes::new()), peer_timeout).await {
                    continue;
                }
                break;
            }
            msg = socket.recv() => msg,
        };
        last_heard = Instant::now();
        let next = match msg {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Binary(_))) => {
                Next::Close(Some(error_frame("SESSION_ERROR", "'text'", json!({}))))
            }
            Some(Ok(Message::Text(text))) => {
                handle_message(&state, (session_id.as_str(), &env), text.as_str()).await
            }
        };
        match next {
            Next::Reply(reply) => {
                if !send_within(&mut socket, reply, peer_timeout).await {
                    break;
                }
            }
            Next::Close(reply) => {
                if let Some(reply) = reply {
                    let _ = send_within(&mut socket, reply, peer_timeout).await;
                }
                let _ = send_within(&mut socket, close_frame(1000, ""), peer_timeout).await;
                break;
            }
        }
        last_heard = Instant::now();
    }
    if let Some(env) = state.sessions.detach(&session_id) {
        close_env(env).await;
    }
}

/// Sends `msg` unless the peer does not take it within `limit` (a full TCP window: a peer
/// that stopped reading is as gone as a silent one). Whether it was sent.
async fn send_within(socket: &mut WebSocket, msg: Message, limit: Duration) -> bool {
    matches!(
        tokio::time::timeout(limit, socket.send(msg)).await,
        Ok(Ok(()))
    )
}

fn env_error_frame(e: &EnvError) -> Message {
    match e {
        EnvError::InvalidAction { message, errors } => {
            error_frame("VALIDATION_ERROR", message, json!({"errors": errors}))
        }
        other => error_frame("EXECUTION_ERROR", &other.to_string(), json!({})),
    }
}

async fn handle_message(state: &AppState, session: (&str, &SharedEnv), text: &str) -> Next {
    let env = session.1;
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            return Next::Reply(error_frame(
                "INVALID_JSON",
                &format!("Invalid JSON: {e}"),
                json!({}),
            ))
        }
    };
    let ty = value
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let invalid = |errors: Value| {
        Next::Reply(error_frame(
            "VALIDATION_ERROR",
            "Invalid message",
            json!({"errors": errors}),
        ))
    };
    if let Some(obj) = value.as_object() {
        let extra: Vec<&String> = obj
            .keys()
            .filter(|k| *k != "type" && *k != "data")
            .collect();
        if !extra.is_empty() && matches!(ty.as_str(), "reset" | "step" | "state" | "close" | "mcp")
        {
            let errors: Vec<Value> = extra
                .iter()
                .map(|k| json!({"type": "extra_forbidden", "loc": [k], "msg": "Extra inputs are not permitted", "input": obj[k.as_str()]}))
                .collect();
            return invalid(Value::Array(errors));
        }
    }
    let data = value.get("data").cloned().unwrap_or(Value::Null);
    match ty.as_str() {
        "reset" => {
            let data = match data {
                Value::Null => Map::new(),
                Value::Object(m) => m,
                other => {
                    return invalid(
                        json!([{"type": "dict_type", "loc": ["data"], "msg": "Input should be a valid dictionary", "input": other}]),
                    )
                }
            };
            let opts = match reset_options(&data, &["data"]) {
                Ok(o) => o,
                Err(errors) => return invalid(errors),
            };
            match env.lock().await.reset(opts).await {
                Ok(r) => Next::Reply(Message::text(
                    json!({"type": "observation", "data": wire(&r)}).to_string(),
                )),
                Err(e) => Next::Reply(env_error_frame(&e)),
            }
        }
        "step" => {
            if data.is_null() {
                return invalid(
                    json!([{"type": "missing", "loc": ["data"], "msg": "Field required", "input": value}]),
                );
            }
            if let Some(errors) = validation_issues(state, &data) {
                return invalid(errors);
            }
            match env.lock().await.step(data).await {
                Ok(r) => Next::Reply(Message::text(
                    json!({"type": "observation", "data": wire(&r)}).to_string(),
                )),
                Err(e) => Next::Reply(env_error_frame(&e)),
            }
        }
        "state" => match env.lock().await.state().await {
            Ok(s) => Next::Reply(Message::text(
                json!({"type": "state", "data": s}).to_string(),
            )),
            Err(e) => Next::Reply(env_error_frame(&e)),
        },
        "close" => Next::Close(None),
        "mcp" => {
            let response = mcp::handle_rpc(state, &data, Some(session)).await;
            Next::Reply(Message::text(
                json!({"type": "mcp", "data": response}).to_string(),
            ))
        }
        other => Next::Reply(error_frame(
            "UNKNOWN_TYPE",
            &format!("Unknown message type: {other}"),
            json!({}),
        )),
    }
}

/// Resolves once the server is shutting down. The watch guard is dropped inside, so the
/// caller's future stays `Send`.
async fn wait_for_shutdown(shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await.map(|_| ());
}
