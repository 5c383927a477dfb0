//! OpenEnv client: episodes over WebSocket `/ws`, HTTP for `/health`, `/schema`, `/metadata`.
//!
//! Each [`RemoteEnv`] owns one WebSocket session. A background task owns the socket and
//! keeps its read half polled (so pongs answer uvicorn's keepalive pings); calls go to it
//! through an mpsc channel and get their reply through a oneshot. The protocol is strict
//! request/response, so replies are paired with requests in order. After a reply timeout
//! the socket is dropped (a late reply would otherwise be paired with the next request).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;

use crate::env::{Action, Env, EnvError, EnvFactory, ResetOptions, StepResult};

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
        let body = resp
            .text()
            .await
            .map_err(|e| http_error(&url, e, timeout))?;
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
        RemoteEnv {
            client: self.clone(),
            conn: None,
            episode_deadline: None,
            mcp_tools: false,
            retried: Vec::new(),
        }
    }

    /// A new session for an MCP-tool server, driven with [`RemoteEnv::list_tools`] and
    /// [`RemoteEnv::call_tool`] (see [`crate::ToolEnv`]); its `reset` does not refuse a
    /// server whose `/schema` shows only tool actions.
    pub fn tool_session(&self) -> RemoteEnv {
        RemoteEnv {
            mcp_tools: true,
            ..self.session()
        }
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

/// One request to the socket task; `reply: None` means no reply is expected.
struct Request {
    text: String,
    reply: Option<oneshot::Sender<Result<Value, EnvError>>>,
}

struct Connection {
    tx: mpsc::Sender<Request>,
    task: JoinHandle<()>,
    /// Why the socket task ended (close code, capacity refusal, I/O error).
    dead_reason: Arc<Mutex<Option<EnvError>>>,
}

impl Connection {
    fn dead_error(&self) -> EnvError {
        let reason = self.dead_reason.lock().ok().and_then(|g| g.clone());
        reason.unwrap_or_else(|| EnvError::Connection("the WebSocket session ended".into()))
    }
}

/// An OpenEnv session over `/ws`, implementing [`Env`].
///
/// Error codes that keep the session (`INVALID_JSON`, `UNKNOWN_TYPE`, `VALIDATION_ERROR`,
/// `EXECUTION_ERROR`) fail only that call. `CAPACITY_REACHED` during `reset` is retried with
/// back-off; `FACTORY_ERROR`, `SESSION_ERROR`, a closed connection or a timeout end the
/// session: later steps fail with [`EnvError::NoSession`] and the next `reset` reconnects.
pub struct RemoteEnv {
    client: OpenEnvClient,
    conn: Option<Connection>,
    episode_deadline: Option<Instant>,
    /// Made by [`OpenEnvClient::tool_session`]: tool actions are expected.
    mcp_tools: bool,
    /// Connection failures retried past since the pool last asked
    /// ([`Env::take_retried_failures`]).
    retried: Vec<EnvError>,
}

/// Maps a server error frame's `data` to an [`EnvError`].
fn error_from_frame(data: &Value) -> EnvError {
    let code = data
        .get("code")
        .and_then(Value::as_str)
        .unwrap_or("UNKNOWN")
        .to_string();
    let message = data
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    match code.as_str() {
        "VALIDATION_ERROR" => EnvError::InvalidAction {
            message: format!("{message}: {}", data.get("errors").unwrap_or(&Value::Null)),
            errors: data.get("errors").cloned().unwrap_or(Value::Null),
        },
        "CAPACITY_REACHED" => EnvError::Capacity(format!(
            "{message} (active_sessions {}, max_sessions {})",
            data.get("active_sessions").unwrap_or(&Value::Null),
            data.get("max_sessions").unwrap_or(&Value::Null)
        )),
        _ => EnvError::Server { code, message },
    }
}

/// Whether the server closes the session after this error.
fn closes_session(e: &EnvError) -> bool {
    match e {
        EnvError::Server { code, .. } => matches!(code.as_str(), "FACTORY_ERROR" | "SESSION_ERROR"),
        EnvError::InvalidAction { .. } | EnvError::Protocol(_) => false,
        _ => true,
    }
}

/// Parses one server frame into a reply.
fn parse_frame(text: &str) -> Result<Value, EnvError> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| EnvError::Protocol(format!("server frame is not JSON: {e}")))?;
    match v.get("type").and_then(Value::as_str) {
        Some("error") => Err(error_from_frame(v.get("data").unwrap_or(&Value::Null))),
        Some(_) => Ok(v),
        None => Err(EnvError::Protocol(format!(
            "server frame without `type`: {text:.200}"
        ))),
    }
}

async fn socket_task(
    ws: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
    mut rx: mpsc::Receiver<Request>,
    dead_reason: Arc<Mutex<Option<EnvError>>>,
) {
    let (mut sink, mut stream) = ws.split();
    let mut pending: VecDeque<oneshot::Sender<Result<Value, EnvError>>> = VecDeque::new();
    // An unsolicited error (CAPACITY_REACHED right after the handshake) answers the next request.
    let mut unsolicited: Option<EnvError> = None;
    let end = loop {
        tokio::select! {
            req = rx.recv() => match req {
                Some(req) => {
                    if let Some(e) = &unsolicited {
                        if let Some(reply) = req.reply {
                            let _ = reply.send(Err(e.clone()));
                        }
                        continue;
                    }
                    if let Err(e) = sink.send(Message::text(req.text)).await {
                        let err = EnvError::Connection(format!("sending: {e}"));
                        if let Some(reply) = req.reply {
                            let _ = reply.send(Err(err.clone()));
                        }
                        break err;
                    }
                    if let Some(reply) = req.reply {
                        pending.push_back(reply);
                    }
                }
                None => {
                    // Every sender dropped: close politely (frees the server's slot at once).
                    let _ = tokio::time::timeout(Duration::from_secs(2), async {
                        let _ = sink.send(Message::text(r#"{"type":"close"}"#)).await;
                        let _ = sink.close().await;
                    })
                    .await;
                    break EnvError::NoSession("the session was closed by the client".into());
                }
            },
            msg = stream.next() => match msg {
                Some(Ok(Message::Text(text))) => {
                    let reply = parse_frame(text.as_str());
                    match pending.pop_front() {
                        Some(tx) => { let _ = tx.send(reply); }
                        None => {
                            if let Err(e) = reply {
                                unsolicited = Some(e);
                            }
                        }
                    }
                }
                Some(Ok(Message::Close(frame))) => {
                    let (code, reason) = frame
                        .map(|f| (u16::from(f.code), f.reason.to_string()))
                        .unwrap_or((1005, String::new()));
                    break unsolicited.take().unwrap_or_else(|| EnvError::Connection(format!(
                        "server closed the WebSocket (code {code}{}{reason})",
                        if reason.is_empty() { "" } else { ": " }
                    )));
                }
                Some(Ok(Message::Binary(_))) => {
                    if let Some(tx) = pending.pop_front() {
                        let _ = tx.send(Err(EnvError::Protocol("unexpected binary frame".into())));
                    }
                }
                // Pings are answered by tungstenite while we keep reading.
                Some(Ok(_)) => {}
                Some(Err(e)) => break EnvError::Connection(format!("WebSocket error: {e}")),
                None => break EnvError::Connection("the WebSocket ended without a close frame".into()),
            },
        }
    };
    for tx in pending.drain(..) {
        let _ = tx.send(Err(end.clone()));
    }
    if let Ok(mut g) = dead_reason.lock() {
        *g = Some(end);
    }
}

impl RemoteEnv {
    /// The client this session belongs to.
    pub fn client(&self) -> &OpenEnvClient {
        &self.client
    }

    /// Whether a WebSocket session is open.
    pub fn is_connected(&self) -> bool {
        self.conn
            .as_ref()
            .is_some_and(|c| !c.tx.is_closed() && !c.task.is_finished())
    }

    fn drop_conn(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.task.abort();
        }
    }

    /// Opens the WebSocket, retrying connection errors with back-off (polling `/health`
    /// between attempts, so a restarting server is waited for). No retry starts past
    /// `deadline`: the caller's own timeout would otherwise fire first and report a
    /// refused connection as a timeout.
    async fn connect(&mut self, deadline: Option<Instant>) -> Result<(), EnvError> {
        self.drop_conn();
        let cfg = &self.client.inner.config;
        let ws_cfg = WebSocketConfig::default()
            .max_message_size(Some(cfg.max_message_bytes))
            .max_frame_size(Some(cfg.max_message_bytes));
        let url = self.client.inner.ws_url.clone();
        let mut attempt = 0u32;
        loop {
            if attempt > 0 {
                tokio::time::sleep(cfg.backoff(attempt - 1)).await;
            }
            let health = if attempt > 0 {
                self.client.health().await
            } else {
                Ok(())
            };
            let result: Result<(), EnvError> = if let Err(e) = health {
                Err(match e {
                    // Keep the cause: a refused connection says the server is down.
                    EnvError::Refused(m) => EnvError::Refused(m),
                    other => EnvError::Connection(format!(
                        "{} is not healthy: {other}",
                        self.client.base_url()
                    )),
                })
            } else {
                match tokio::time::timeout(
                    cfg.connect_timeout,
                    tokio_tungstenite::connect_async_with_config(url.as_str(), Some(ws_cfg), true),
                )
                .await
                {
                    Ok(Ok((ws, _response))) => {
                        let (tx, rx) = mpsc::channel(16);
                        let dead_reason = Arc::new(Mutex::new(None));
                        let task = tokio::spawn(socket_task(ws, rx, dead_reason.clone()));
                        self.conn = Some(Connection {
                            tx,
                            task,
                            dead_reason,
                        });
                        return Ok(());
                    }
                    Ok(Err(tokio_tungstenite::tungstenite::Error::Http(resp))) => {
                        // The server answered but refused the upgrade: retrying will not help.
                        return Err(EnvError::Connection(format!(
                            "connecting to {url}: HTTP {} (is this an OpenEnv server?)",
                            resp.status()
                        )));
                    }
                    Ok(Err(e)) if is_refused(&e) => {
                        Err(EnvError::Refused(format!("connecting to {url}: {e}")))
                    }
                    Ok(Err(e)) => Err(EnvError::Connection(format!("connecting to {url}: {e}"))),
                    Err(_) => Err(EnvError::Timeout {
                        seconds: cfg.connect_timeout.as_secs_f64(),
                        during: format!("connecting to {url}"),
                    }),
                }
            };
            if let Err(e) = result {
                let next_wake = Instant::now() + cfg.backoff_max(attempt);
                if attempt >= cfg.connect_retries || deadline.is_some_and(|d| next_wake >= d) {
                    return Err(e);
                }
                tracing::debug!("OpenEnv connect attempt {attempt} failed: {e}");
                self.retried.push(e);
            }
            attempt += 1;
        }
    }

    /// Sends one message and waits for its reply within the call / episode timeout.
    pub(crate) async fn call(&mut self, msg: Value, during: &str) -> Result<Value, EnvError> {
        self.call_text(msg.to_string(), during).await
    }

    /// Sends one raw text frame on this session (connecting first when needed) and returns
    /// the reply frame. A low-level hook for protocol probes: the server's answers to frames
    /// the typed calls never send (`INVALID_JSON`, `UNKNOWN_TYPE`) come back as errors.
    pub async fn call_raw(&mut self, text: &str) -> Result<Value, EnvError> {
        if !self.is_connected() {
            self.connect(None).await?;
        }
        self.call_text(text.to_string(), "raw call").await
    }

    async fn call_text(&mut self, text: String, during: &str) -> Result<Value, EnvError> {
        let Some(conn) = self.conn.as_ref() else {
            return Err(EnvError::NoSession(format!(
                "{during}: no open session; call reset"
            )));
        };
        let call_timeout = self.client.inner.config.call_timeout;
        let (limit, episode_bound) = match self.episode_deadline {
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                (left.min(call_timeout), left < call_timeout)
            }
            None => (call_timeout, false),
        };
        let (tx, rx) = oneshot::channel();
        if conn
            .tx
            .send(Request {
                text,
                reply: Some(tx),
            })
            .await
            .is_err()
        {
            let e = conn.dead_error();
            self.drop_conn();
            return Err(e);
        }
        let result = match tokio::time::timeout(limit, rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(conn.dead_error()),
            Err(_) => Err(EnvError::Timeout {
                seconds: limit.as_secs_f64(),
                during: if episode_bound {
                    format!("{during} (episode timeout)")
                } else {
                    during.into()
                },
            }),
        };
        if let Err(e) = &result {
            if closes_session(e) {
                self.drop_conn();
            }
        }
        result
    }

    pub(crate) fn expect_type(reply: Value, ty: &str) -> Result<Value, EnvError> {
        if reply.get("type").and_then(Value::as_str) != Some(ty) {
            return Err(EnvError::Protocol(format!(
                "expected a `{ty}` reply, got {reply:.300}"
            )));
        }
        Ok(reply.get("data").cloned().unwrap_or(Value::Null))
    }

    /// Sends an MCP JSON-RPC request over `/ws` (`{"type":"mcp"}`) and returns the response.
    pub async fn mcp(&mut self, request: Value) -> Result<Value, EnvError> {
        let reply = self
            .call(json!({"type": "mcp", "data": request}), "mcp")
            .await?;
        Self::expect_type(reply, "mcp")
    }
}

#[async_trait]
impl Env for RemoteEnv {
    fn take_retried_failures(&mut self) -> Vec<EnvError> {
        std::mem::take(&mut self.retried)
    }

    async fn reset(&mut self, opts: ResetOptions) -> Result<StepResult, EnvError> {
        // An MCP-tools-only server takes `call_tool` / `list_tools` actions, never the plain
        // actions our episodes send: refuse it before opening a session rather than fail
        // every step with a validation error.
        if let Some(what) = self.client.mcp_tool_interface().filter(|_| !self.mcp_tools) {
            return Err(EnvError::Protocol(format!(
                "OpenEnv server {} speaks only MCP tools ({what} on /schema); MCP tool servers \
                 are played with `[env] kind = \"openenv_tools\"`, not `\"openenv\"` (plain actions)",
                self.client.base_url()
            )));
        }
        // Connection retries stop short of the call timeout (a pool wraps reset in the same
        // limit), so a server that is down is reported as refused, not as a timeout.
        let call_timeout = self.client.inner.config.call_timeout;
        let margin = (call_timeout / 10).min(Duration::from_secs(1));
        let connect_deadline = Instant::now() + call_timeout.saturating_sub(margin);
        self.episode_deadline = self
            .client
            .inner
            .config
            .episode_timeout
            .map(|d| Instant::now() + d);
        let data = serde_json::to_value(&opts)
            .map_err(|e| EnvError::Protocol(format!("encoding reset options: {e}")))?;
        let msg = json!({"type": "reset", "data": data});
        let mut capacity_attempt = 0u32;
        // A kept connection may have died while idle (server restart): reconnect once.
        let mut may_reconnect = self.conn.is_some();
        loop {
            if !self.is_connected() {
                self.connect(Some(connect_deadline)).await?;
            }
            match self.call(msg.clone(), "reset").await {
                Ok(reply) => {
                    return StepResult::from_wire(&Self::expect_type(reply, "observation")?)
                }
                Err(EnvError::Capacity(m))
                    if capacity_attempt < self.client.inner.config.capacity_retries =>
                {
                    tracing::info!(
                        "OpenEnv {} refused a session at capacity (retry {}): {m}",
                        self.client.base_url(),
                        capacity_attempt + 1
                    );
                    self.drop_conn();
                    tokio::time::sleep(self.client.inner.config.backoff(capacity_attempt)).await;
                    capacity_attempt += 1;
                }
                Err(EnvError::Connection(_)) if may_reconnect => {
                    may_reconnect = false;
                    self.drop_conn();
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn step(&mut self, action: Action) -> Result<StepResult, EnvError> {
        let reply = self
            .call(json!({"type": "step", "data": action}), "step")
            .await?;
        StepResult::from_wire(&Self::expect_type(reply, "observation")?)
    }

    async fn state(&mut self) -> Result<Value, EnvError> {
        let reply = self.call(json!({"type": "state"}), "state").await?;
        Self::expect_type(reply, "state")
    }

    async fn close(&mut self) -> Result<(), EnvError> {
        if let Some(conn) = self.conn.take() {
            // Dropping the sender makes the task send {"type":"close"} and a close frame.
            drop(conn.tx);
            let _ = tokio::time::timeout(Duration::from_secs(3), conn.task).await;
        }
        Ok(())
    }

    fn action_schema(&self) -> Option<Value> {
        self.client.action_schema().cloned()
    }

    fn observation_schema(&self) -> Value {
        self.client
            .inner
            .schema
            .get("observation")
            .cloned()
            .unwrap_or(Value::Null)
    }

    fn state_schema(&self) -> Value {
        self.client
            .inner
            .schema
            .get("state")
            .cloned()
            .unwrap_or(Value::Null)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let (h, w) = server_urls("http://127.0.0.1:8765/").unwrap();
        assert_eq!(
            (h.as_str(), w.as_str()),
            ("http://127.0.0.1:8765", "ws://127.0.0.1:8765/ws")
        );
        let (h, w) = server_urls("ws://host:1/ws").unwrap();
        assert_eq!(
            (h.as_str(), w.as_str()),
            ("http://host:1", "ws://host:1/ws")
        );
        assert!(server_urls("127.0.0.1:8765").is_err());
        assert!(server_urls("ftp://x").is_err());
        assert!(server_urls("http://").is_err());
    }

    #[test]
    fn error_frames() {
        let e = parse_frame(r#"{"type":"error","data":{"message":"Invalid message","code":"VALIDATION_ERROR","errors":[]}}"#).unwrap_err();
        assert!(matches!(e, EnvError::InvalidAction { .. }) && !closes_session(&e));
        let e = parse_frame(r#"{"type":"error","data":{"message":"x","code":"CAPACITY_REACHED","active_sessions":1,"max_sessions":1}}"#).unwrap_err();
        assert!(matches!(e, EnvError::Capacity(_)) && closes_session(&e));
        let e =
            parse_frame(r#"{"type":"error","data":{"message":"boom","code":"EXECUTION_ERROR"}}"#)
                .unwrap_err();
        assert!(!closes_session(&e));
        let e =
            parse_frame(r#"{"type":"error","data":{"message":"'text'","code":"SESSION_ERROR"}}"#)
                .unwrap_err();
        assert!(closes_session(&e));
        assert!(parse_frame("nope").is_err());
    }
}
