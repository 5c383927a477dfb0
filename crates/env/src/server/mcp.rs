//! MCP JSON-RPC 2.0 over HTTP `POST /mcp` and WebSocket `{"type":"mcp"}` messages, as
//! openenv 0.10 serves an MCP-tool env: `tools/list`, `tools/call` (mapped onto the env's
//! `list_tools` / `call_tool` steps), `openenv/session/create` and `openenv/session/close`.
//! Errors are JSON-RPC errors (HTTP 200 always); a tool that fails is a result with
//! `is_error` and `error` set, not a JSON-RPC error, so the episode goes on.

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Map, Value};

use super::sessions::{close_env, CloseOutcome, SessionError, SharedEnv};
use super::AppState;
use crate::env::EnvError;

/// JSON-RPC error codes (the subset openenv uses).
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;
const INTERNAL_ERROR: i64 = -32603;
const SERVER_ERROR: i64 = -32000;

fn rpc_error(id: &Value, code: i64, message: &str, data: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message, "data": data}})
}

fn rpc_result(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

/// `POST /mcp`: one JSON-RPC request in the body, the response as HTTP 200.
pub(super) async fn http_mcp(State(state): State<AppState>, body: Bytes) -> Json<Value> {
    match serde_json::from_slice::<Value>(&body) {
        Ok(request) => Json(handle_rpc(&state, &request, None).await),
        Err(_) => Json(rpc_error(
            &Value::Null,
            PARSE_ERROR,
            "Parse error",
            Value::Null,
        )),
    }
}

/// The tools in MCP's `tools/list` form (`inputSchema`).
fn mcp_tool_list(tools: &[Value]) -> Value {
    let tools: Vec<Value> = tools
        .iter()
        .map(|t| {
            json!({
                "name": t.get("name").cloned().unwrap_or(Value::Null),
                "description": t.get("description").cloned().unwrap_or(json!("")),
                "inputSchema": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"})),
            })
        })
        .collect();
    json!({ "tools": tools })
}

/// Answers one JSON-RPC request; `ws_session` is the WebSocket's own session when the
/// request came as a `{"type":"mcp"}` message.
pub(super) async fn handle_rpc(
    state: &AppState,
    request: &Value,
    ws_session: Option<(&str, &SharedEnv)>,
) -> Value {
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    let Some(obj) = request.as_object() else {
        return rpc_error(
            &id,
            INVALID_REQUEST,
            "Invalid request: not a JSON object",
            Value::Null,
        );
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return rpc_error(
            &id,
            INVALID_REQUEST,
            "Invalid request: `jsonrpc` must be \"2.0\"",
            Value::Null,
        );
    }
    let Some(method) = obj.get("method").and_then(Value::as_str) else {
        return rpc_error(
            &id,
            INVALID_REQUEST,
            "Invalid request: `method` must be a string",
            Value::Null,
        );
    };
    let params = match obj.get("params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(p)) => p.clone(),
        Some(_) => return rpc_error(&id, INVALID_PARAMS, "Params must be an object", Value::Null),
    };
    let requested = params.get("session_id").and_then(Value::as_str);
    match method {
        "openenv/session/create" => {
            if let Some((sid, _)) = ws_session {
                return rpc_result(&id, json!({"session_id": sid}));
            }
            match create_http_session(state).await {
                Ok(sid) => rpc_result(&id, json!({"session_id": sid})),
                Err((message, data)) => rpc_error(&id, SERVER_ERROR, &message, data),
            }
        }
        "openenv/session/close" => {
            let Some(target) = requested else {
                return rpc_error(
                    &id,
                    INVALID_PARAMS,
                    "Invalid params - 'session_id' is required",
                    Value::Null,
                );
            };
            if ws_session.is_some_and(|(sid, _)| sid == target) {
                return rpc_error(
                    &id,
                    INVALID_REQUEST,
                    "Cannot close active WebSocket-managed session via MCP method",
                    Value::Null,
                );
            }
            match state.sessions.close(target) {
                CloseOutcome::Closed(env) => {
                    close_env(env).await;
                    rpc_result(&id, json!({"session_id": target, "closed": true}))
                }
                CloseOutcome::Closing => rpc_result(
                    &id,
                    json!({"session_id": target, "closed": false, "closing": true}),
                ),
                CloseOutcome::Unknown => rpc_error(
                    &id,
                    INVALID_PARAMS,
                    &format!("Unknown session_id: {target}"),
                    Value::Null,
                ),
            }
        }
        "tools/list" => {
            let Some(tools) = state.mcp_tools.as_ref() else {
                return no_mcp(&id);
            };
            if ws_session.is_none() {
                if let Some(sid) = requested {
                    if let Err(e) = state.sessions.get(sid) {
                        return rpc_error(&id, INVALID_PARAMS, &e.to_string(), Value::Null);
                    }
                }
            }
            rpc_result(&id, mcp_tool_list(tools))
        }
        "tools/call" => {
            if state.mcp_tools.is_none() {
                return no_mcp(&id);
            }
            let Some(name) = params.get("name").and_then(Value::as_str) else {
                return rpc_error(&id, INVALID_PARAMS, "Missing 'name' in params", Value::Null);
            };
            let env = match (ws_session, requested) {
                (Some((_, env)), _) => env.clone(),
                (None, Some(sid)) => match state.sessions.get(sid) {
                    Ok(env) => env,
                    Err(e) => return rpc_error(&id, INVALID_PARAMS, &e.to_string(), Value::Null),
                },
                (None, None) => {
                    return rpc_error(
                        &id,
                        INVALID_PARAMS,
                        "tools/call over HTTP needs params.session_id: make a session with \
                         openenv/session/create and reset it over WS /ws?session_id=ID",
                        Value::Null,
                    )
                }
            };
            let arguments = params.get("arguments").cloned().unwrap_or(json!({}));
            let action = json!({"type": "call_tool", "tool_name": name, "arguments": arguments});
            let result = env.lock().await.step(action).await;
            match result {
                Ok(r) => {
                    let mut out = match r.observation.get("result") {
                        Some(Value::Object(m)) => m.clone(),
                        Some(other) => {
                            let mut m = Map::new();
                            m.insert("data".into(), other.clone());
                            m
                        }
                        None => Map::new(),
                    };
                    out.insert(
                        "error".into(),
                        r.observation.get("error").cloned().unwrap_or(Value::Null),
                    );
                    out.insert("reward".into(), json!(r.reward));
                    out.insert("done".into(), json!(r.done));
                    rpc_result(&id, Value::Object(out))
                }
                Err(EnvError::InvalidAction { message, errors }) => {
                    rpc_error(&id, INVALID_PARAMS, &message, errors)
                }
                Err(e) => rpc_error(&id, INTERNAL_ERROR, &e.to_string(), Value::Null),
            }
        }
        other => rpc_error(
            &id,
            METHOD_NOT_FOUND,
            &format!("Method not found: {other}"),
            Value::Null,
        ),
    }
}

fn no_mcp(id: &Value) -> Value {
    rpc_error(
        id,
        INTERNAL_ERROR,
        "Environment does not support MCP",
        Value::Null,
    )
}

/// Makes an HTTP session: a new env in the store. Errors as (message, JSON-RPC data).
async fn create_http_session(state: &AppState) -> Result<String, (String, Value)> {
    let capacity = |e: SessionError| {
        let data = match &e {
            SessionError::Capacity { active, max } => {
                json!({"active_sessions": active, "max_sessions": max})
            }
            _ => Value::Null,
        };
        (e.to_string(), data)
    };
    for idle in state.sessions.reap_idle() {
        close_env(idle).await;
    }
    state.sessions.check_room().map_err(capacity)?;
    let env = (state.factory)()
        .map_err(|e| (format!("{e:#}"), json!({"factory_name": "composer-env"})))?;
    match state.sessions.insert(env, false) {
        Ok((sid, _)) => Ok(sid),
        Err((e, mut env)) => {
            let _ = env.close().await;
            Err(capacity(e))
        }
    }
}
