//! An OpenEnv-protocol server (as openenv-core 0.3.0 speaks it, see PROTOCOL.md) for any
//! [`EnvFactory`]: stateless HTTP `/reset` `/step` `/state`, `/health` `/metadata` `/schema`,
//! and stateful episodes over WebSocket `/ws` (one env per connection).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::env::{Env, EnvError, EnvFactory, ResetOptions};
use crate::schema::validate_action;

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Most concurrent WebSocket sessions; more are refused with `CAPACITY_REACHED`.
    pub max_sessions: usize,
    /// Largest accepted WebSocket message.
    pub max_message_bytes: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            max_sessions: 16,
            max_message_bytes: 128 << 20,
        }
    }
}

#[derive(Clone)]
struct AppState {
    factory: EnvFactory,
    config: ServeConfig,
    active: Arc<AtomicUsize>,
    shutdown: watch::Receiver<bool>,
    schema: Arc<Value>,
    action_schema: Arc<Option<Value>>,
    metadata: Arc<Value>,
}

/// Serves `factory` on `addr` until Ctrl-C or SIGTERM (open sessions get close code 1012).
pub async fn serve_env(
    factory: EnvFactory,
    addr: SocketAddr,
    config: ServeConfig,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!("serving the OpenEnv protocol on http://{addr} (ws://{addr}/ws)");
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
    drop(probe);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let state = AppState {
        factory,
        config,
        active: Arc::new(AtomicUsize::new(0)),
        shutdown: shutdown_rx,
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
        .route("/ws", get(ws_upgrade))
        .with_state(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            let _ = shutdown_tx.send(true);
        })
        .await
        .context("serving the OpenEnv protocol")
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
        Ok(r) => Json(r.to_wire()).into_response(),
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
        Ok(r) => Json(r.to_wire()).into_response(),
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

async fn ws_upgrade(State(state): State<AppState>, ws: WebSocketUpgrade) -> Response {
    let max = state.config.max_message_bytes;
    ws.max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| ws_session(socket, state))
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

/// Decrements the active-session count when a session ends, however it ends.
struct SessionSlot(Arc<AtomicUsize>);

impl Drop for SessionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What to do after handling one client message.
enum Next {
    Reply(Message),
    /// Reply (if any), then close with 1000.
    Close(Option<Message>),
}

async fn ws_session(mut socket: WebSocket, state: AppState) {
    let max = state.config.max_sessions;
    let before = state.active.fetch_add(1, Ordering::SeqCst);
    let _slot = SessionSlot(state.active.clone());
    if before >= max {
        let frame = error_frame(
            "CAPACITY_REACHED",
            &format!("Server at capacity ({before}/{max} sessions). Try again later."),
            json!({"active_sessions": before, "max_sessions": max}),
        );
        let _ = socket.send(frame).await;
        let _ = socket.send(close_frame(1000, "")).await;
        return;
    }
    let mut env = match (state.factory)() {
        Ok(env) => env,
        Err(e) => {
            let frame = error_frame(
                "FACTORY_ERROR",
                &format!("{e:#}"),
                json!({"factory_name": "composer-env"}),
            );
            let _ = socket.send(frame).await;
            let _ = socket.send(close_frame(1000, "")).await;
            return;
        }
    };
    let mut shutdown = state.shutdown.clone();
    loop {
        let msg = tokio::select! {
            _ = wait_for_shutdown(&mut shutdown) => {
                let _ = socket.send(close_frame(1012, "service restart")).await;
                break;
            }
            msg = socket.recv() => msg,
        };
        let next = match msg {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Binary(_))) => {
                Next::Close(Some(error_frame("SESSION_ERROR", "'text'", json!({}))))
            }
            Some(Ok(Message::Text(text))) => {
                handle_message(&state, env.as_mut(), text.as_str()).await
            }
        };
        match next {
            Next::Reply(reply) => {
                if socket.send(reply).await.is_err() {
                    break;
                }
            }
            Next::Close(reply) => {
                if let Some(reply) = reply {
                    let _ = socket.send(reply).await;
                }
                let _ = socket.send(close_frame(1000, "")).await;
                break;
            }
        }
    }
    let _ = env.close().await;
}

fn env_error_frame(e: &EnvError) -> Message {
    match e {
        EnvError::InvalidAction { message, errors } => {
            error_frame("VALIDATION_ERROR", message, json!({"errors": errors}))
        }
        other => error_frame("EXECUTION_ERROR", &other.to_string(), json!({})),
    }
}

async fn handle_message(state: &AppState, env: &mut dyn Env, text: &str) -> Next {
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
            match env.reset(opts).await {
                Ok(r) => Next::Reply(Message::text(
                    json!({"type": "observation", "data": r.to_wire()}).to_string(),
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
            match env.step(data).await {
                Ok(r) => Next::Reply(Message::text(
                    json!({"type": "observation", "data": r.to_wire()}).to_string(),
                )),
                Err(e) => Next::Reply(env_error_frame(&e)),
            }
        }
        "state" => match env.state().await {
            Ok(s) => Next::Reply(Message::text(
                json!({"type": "state", "data": s}).to_string(),
            )),
            Err(e) => Next::Reply(env_error_frame(&e)),
        },
        "close" => Next::Close(None),
        "mcp" => {
            let id = data.get("id").cloned().unwrap_or(Value::Null);
            Next::Reply(Message::text(
                json!({"type": "mcp", "data": {"jsonrpc": "2.0", "id": id,
                    "error": {"code": -32603, "message": "Environment does not support MCP", "data": null}}})
                .to_string(),
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
