//! The server's WebSocket side: `/ws` sessions (one env each, or attached to an HTTP-made
//! session), their messages, error and close frames, and the liveness of their peers.

use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::response::Response;
use serde_json::{json, Map, Value};

use super::*;

/// The `/ws` query: `session_id` attaches to an HTTP-made session.
#[derive(serde::Deserialize)]
pub(super) struct WsQuery {
    session_id: Option<String>,
}

/// `GET /ws`: upgrades to a WebSocket session.
pub(super) async fn ws_upgrade(
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
