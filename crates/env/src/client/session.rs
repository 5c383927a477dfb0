//! One OpenEnv session over `/ws` ([`RemoteEnv`]): the background socket task, the pairing
//! of replies with requests, error frames and reconnection.
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

use crate::env::{Action, Env, EnvError, ResetOptions, StepResult};

use super::{is_refused, OpenEnvClient};

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
    /// The server refused the gym-style `list_tools` step (an env with an action class of
    /// its own), so tools are listed and called over MCP JSON-RPC (`crate::ToolEnv`).
    pub(crate) tools_over_rpc: bool,
    /// Connection failures retried past since the pool last asked
    /// ([`Env::take_retried_failures`]).
    retried: Vec<EnvError>,
}

impl RemoteEnv {
    /// A new, not yet connected session of `client` (`mcp_tools`: a tool-action server).
    pub(super) fn new(client: OpenEnvClient, mcp_tools: bool) -> Self {
        RemoteEnv {
            client,
            conn: None,
            episode_deadline: None,
            mcp_tools,
            tools_over_rpc: false,
            retried: Vec::new(),
        }
    }
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
pub(super) fn closes_session(e: &EnvError) -> bool {
    match e {
        EnvError::Server { code, .. } => matches!(code.as_str(), "FACTORY_ERROR" | "SESSION_ERROR"),
        EnvError::InvalidAction { .. } | EnvError::Protocol(_) => false,
        _ => true,
    }
}

/// Parses one server frame into a reply.
pub(super) fn parse_frame(text: &str) -> Result<Value, EnvError> {
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
