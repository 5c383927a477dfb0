//! OpenEnv client: episodes over WebSocket `/ws`, HTTP for `/health`, `/schema`, `/metadata`.
//!
//! Each [`RemoteEnv`] owns one WebSocket session. A background task owns the socket and
//! keeps its read half polled (so pongs answer uvicorn's keepalive pings); calls go to it
//! through an mpsc channel and get their reply through a oneshot. The protocol is strict
//! request/response, so replies are paired with requests in order. After a reply timeout
//! the socket is dropped (a late reply would otherwise be paired with the next request).
//!
//! This module holds the client (HTTP side, configuration); `session` the WebSocket session
//! [`RemoteEnv`] and its socket task.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::env::{Env, EnvError, EnvFactory};

mod session;
pub use session::RemoteEnv;

/// Timeouts, retries and limits of an [`OpenEnvClient`].
#[derive(Debug, Clone)]
pub struct OpenEnvClientConfig {
    /// Limit of one connection attempt (TCP + WebSocket handshake); the Python client uses 10 s.
    pub connect_timeout: Duration,
    /// Limit of one reply (reset/step/state); the Python client uses 60 s.
    pub call_timeout: Duration,
    /// Limit of one HTTP request (`/health`, `/schema`, `/metadata`).
    pub http_timeout: Duration,
    /// Limit of a whole episode from its `reset` (None: unlimited).
    pub episode_timeout: Option<Duration>,
    /// Connection attempts after the first one fails (connection refused, reset...).
    pub connect_retries: u32,
    /// Attempts after a `CAPACITY_REACHED` refusal.
    pub capacity_retries: u32,
    /// First back-off delay; doubles per attempt (with jitter) up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Largest back-off delay.
    pub max_backoff: Duration,
    /// Largest accepted WebSocket message/frame (observations can be large).
    pub max_message_bytes: usize,
}

impl Default for OpenEnvClientConfig {
    fn default() -> Self {
        OpenEnvClientConfig {
            connect_timeout: Duration::from_secs(10),
            call_timeout: Duration::from_secs(60),
            http_timeout: Duration::from_secs(10),
            episode_timeout: None,
            connect_retries: 6,
            capacity_retries: 8,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
            max_message_bytes: 128 << 20,
        }
    }
}

impl OpenEnvClientConfig {
    /// The delay before retry number `attempt` (0-based): exponential with ±25% jitter.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let base = self.initial_backoff.as_secs_f64() * 2f64.powi(attempt.min(30) as i32);
        let capped = base.min(self.max_backoff.as_secs_f64());
        Duration::from_secs_f64(capped * rand::random_range(0.75..1.25))
    }

    /// The longest [`OpenEnvClientConfig::backoff`] of retry `attempt` can be (+25% jitter).
    pub fn backoff_max(&self, attempt: u32) -> Duration {
        let base = self.initial_backoff.as_secs_f64() * 2f64.powi(attempt.min(30) as i32);
        Duration::from_secs_f64(base.min(self.max_backoff.as_secs_f64()) * 1.25)
    }
}

struct ClientInner {
    base_url: String,
    ws_url: String,
    http: reqwest::Client,
    config: OpenEnvClientConfig,
    schema: Value,
}

/// A connection to one OpenEnv server; cheap to clone. Make episodes with
/// [`OpenEnvClient::session`] or [`OpenEnvClient::factory`].
#[derive(Clone)]
pub struct OpenEnvClient {
    inner: Arc<ClientInner>,
}

/// Splits a server URL into its HTTP base and WebSocket `/ws` URL. Accepts `http(s)://` and
/// `ws(s)://`, with or without a trailing `/` or `/ws`.
fn server_urls(url: &str) -> Result<(String, String), EnvError> {
    let trimmed = url.trim().trim_end_matches('/');
    let trimmed = trimmed.strip_suffix("/ws").unwrap_or(trimmed);
    let (scheme, rest) = trimmed.split_once("://").ok_or_else(|| {
        EnvError::Connection(format!(
            "bad OpenEnv URL `{url}`: expected http://HOST:PORT"
        ))
    })?;
    let (http, ws) = match scheme {
        "http" | "ws" => ("http", "ws"),
        "https" | "wss" => ("https", "wss"),
        other => {
            return Err(EnvError::Connection(format!(
                "bad OpenEnv URL `{url}`: unsupported scheme `{other}` (use http:// or ws://)"
            )))
        }
    };
    if rest.is_empty() || rest.starts_with('/') || rest.contains(char::is_whitespace) {
        return Err(EnvError::Connection(format!(
            "bad OpenEnv URL `{url}`: no host"
        )));
    }
    Ok((format!("{http}://{rest}"), format!("{ws}://{rest}/ws")))
}

/// Whether `e` (or an error it wraps) is an I/O "connection refused": nothing listens at the
/// address. Such a failure is immediate, so it must not be reported as a timeout.
fn is_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

/// Largest body read from `/health`, `/schema` or `/metadata` (all small): a hostile or
/// broken server could otherwise make the client buffer gigabytes.
const MAX_HTTP_BODY_BYTES: usize = 16 << 20;

/// Reads `resp`'s body as text, refusing one over [`MAX_HTTP_BODY_BYTES`] with an error
/// naming `url`.
async fn read_capped(
    url: &str,
    mut resp: reqwest::Response,
    timeout: Duration,
) -> Result<String, EnvError> {
    let too_big = || {
        EnvError::Protocol(format!(
            "GET {url}: the body is over {MAX_HTTP_BODY_BYTES} bytes"
        ))
    };
    if resp
        .content_length()
        .is_some_and(|n| n > MAX_HTTP_BODY_BYTES as u64)
    {
        return Err(too_big());
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| http_error(url, e, timeout))?
    {
        if body.len() + chunk.len() > MAX_HTTP_BODY_BYTES {
            return Err(too_big());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

fn http_error(url: &str, e: reqwest::Error, timeout: Duration) -> EnvError {
    if is_refused(&e) {
        EnvError::Refused(format!("GET {url}: {e}"))
    } else if e.is_timeout() {
        EnvError::Timeout {
            seconds: timeout.as_secs_f64(),
            during: format!("GET {url}"),
        }
    } else {
        EnvError::Connection(format!("GET {url}: {e}"))
    }
}

impl OpenEnvClient {
    /// Connects to the server at `url` (`http://HOST:PORT`): waits for `/health` (with the
    /// configured retries and back-off) and reads `/schema`.
    pub async fn connect(url: &str, config: OpenEnvClientConfig) -> Result<Self, EnvError> {
        let (base_url, ws_url) = server_urls(url)?;
        let http = reqwest::Client::builder()
            .timeout(config.http_timeout)
            .connect_timeout(config.connect_timeout)
            .build()
            .map_err(|e| EnvError::Connection(format!("building the HTTP client: {e}")))?;
        let mut client = OpenEnvClient {
            inner: Arc::new(ClientInner {
                base_url,
                ws_url,
                http,
                config,
                schema: Value::Null,
            }),
        };
        client.wait_healthy().await?;
        let schema = client.get_json("/schema").await?;
        if !schema.is_object() {
            return Err(EnvError::Protocol(format!(
                "GET /schema: not a JSON object: {schema}"
            )));
        }
        if let Some(inner) = Arc::get_mut(&mut client.inner) {
            inner.schema = schema;
        }
        Ok(client)
    }

    /// The HTTP base URL (`http://HOST:PORT`).
    pub fn base_url(&self) -> &str {
        &self.inner.base_url
    }

    /// The WebSocket URL (`ws://HOST:PORT/ws`).
    pub fn ws_url(&self) -> &str {
        &self.inner.ws_url
    }

    /// The client configuration.
    pub fn config(&self) -> &OpenEnvClientConfig {
        &self.inner.config
    }

    /// The server's `/schema` as read at connect time (`{action, observation, state}`).
    pub fn schema(&self) -> &Value {
        &self.inner.schema
    }

    /// When the server's `/schema` shows an MCP tool interface (an action schema of
    /// openenv-core's `CallToolAction` / `ListToolsAction`: a `type` discriminator of
    /// `call_tool` / `list_tools`), a description of it; `None` for a plain action schema.
    pub fn mcp_tool_interface(&self) -> Option<String> {
        mcp_tool_interface(self.action_schema()?)
    }

    /// The action JSON Schema from `/schema`.
    pub fn action_schema(&self) -> Option<&Value> {
        self.inner.schema.get("action").filter(|v| v.is_object())
    }

    async fn get_json(&self, path: &str) -> Result<Value, EnvError> {
        let url = format!("{}{path}", self.inner.base_url);
        let timeout = self.inner.config.http_timeout;
        let resp = self
            .inner
            .http
            .get(&url)
            .send()
            .await
            .map_err(|e| http_error(&url, e, timeout))?;
        let status = resp.status();
        let body = read_capped(&url, resp, timeout).await?;
        if !status.is_success() {
            return Err(EnvError::Server {
                code: format!("HTTP {}", status.as_u16()),
                message: format!("GET {url}: {}", body.chars().take(500).collect::<String>()),
            });
        }
        serde_json::from_str(&body)
            .map_err(|e| EnvError::Protocol(format!("GET {url}: body is not JSON: {e}")))
    }

    /// `GET /health` once: Ok when the server answers `{"status":"healthy"}`.
    pub async fn health(&self) -> Result<(), EnvError> {
        let v = self.get_json("/health").await?;
        match v.get("status").and_then(Value::as_str) {
            Some("healthy") => Ok(()),
            _ => Err(EnvError::Protocol(format!(
                "GET /health: unexpected body {v}"
            ))),
        }
    }

    /// Polls `/health` with the configured retries and back-off.
    pub async fn wait_healthy(&self) -> Result<(), EnvError> {
        let mut attempt = 0;
        loop {
            match self.health().await {
                Ok(()) => return Ok(()),
                Err(
                    e @ (EnvError::Connection(_) | EnvError::Refused(_) | EnvError::Timeout { .. }),
                ) if attempt < self.inner.config.connect_retries => {
                    tracing::debug!("OpenEnv {} not healthy yet: {e}", self.inner.base_url);
                    tokio::time::sleep(self.inner.config.backoff(attempt)).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// `GET /metadata`.
    pub async fn metadata(&self) -> Result<Value, EnvError> {
        self.get_json("/metadata").await
    }

    /// `GET /schema` (fresh, not the copy read at connect time).
    pub async fn fetch_schema(&self) -> Result<Value, EnvError> {
        self.get_json("/schema").await
    }

    /// A new, not yet connected session; its first `reset` connects.
    pub fn session(&self) -> RemoteEnv {
        RemoteEnv::new(self.clone(), false)
    }

    /// A new session for an MCP-tool server, driven with [`RemoteEnv::list_tools`] and
    /// [`RemoteEnv::call_tool`] (see [`crate::ToolEnv`]); its `reset` does not refuse a
    /// server whose `/schema` shows only tool actions.
    pub fn tool_session(&self) -> RemoteEnv {
        RemoteEnv::new(self.clone(), true)
    }

    /// A factory of sessions on this server, for [`crate::EnvPool`].
    pub fn factory(&self) -> EnvFactory {
        let client = self.clone();
        Arc::new(move || Ok(Box::new(client.session()) as Box<dyn Env>))
    }
}

/// MCP tool actions as openenv-core names them (`mcp_types.py`): class title and the value of
/// their `type` discriminator.
const MCP_ACTIONS: [(&str, &str); 2] = [
    ("CallToolAction", "call_tool"),
    ("ListToolsAction", "list_tools"),
];

/// Whether an action schema (or one of its `anyOf`/`oneOf` branches) is an MCP tool action;
/// returns what gave it away.
fn mcp_tool_interface(action: &Value) -> Option<String> {
    let branches: Vec<&Value> = ["anyOf", "oneOf"]
        .iter()
        .filter_map(|k| action.get(*k).and_then(Value::as_array))
        .flatten()
        .chain(std::iter::once(action))
        .collect();
    for b in branches {
        let title = b.get("title").and_then(Value::as_str).unwrap_or("");
        let discriminator = b.pointer("/properties/type").and_then(|t| {
            t.get("const")
                .or_else(|| t.get("default"))
                .and_then(Value::as_str)
        });
        for (name, ty) in MCP_ACTIONS {
            if title == name || discriminator == Some(ty) {
                return Some(format!("action schema `{name}` (type = \"{ty}\")"));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests;
