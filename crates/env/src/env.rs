//! The environment interface: [`Env`], its results and errors, and [`EnvFactory`].

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The `/metadata` key (an env's [`Env::metadata`]) with the longest one step may take, in
/// seconds. A client whose call timeout is shorter cuts steps that are still running, and a
/// step cut short cannot be graded in time (the episode then fails, which a policy can use to
/// have a losing attempt retried): the trainer refuses such a timeout at start-up.
pub const STEP_TIME_LIMIT_KEY: &str = "step_time_limit_s";

/// An action: a JSON object in the env's action schema (e.g. `{"code": "..."}`).
pub type Action = Value;

/// Options of [`Env::reset`] (OpenEnv passes them as the `reset` message's `data`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResetOptions {
    /// Seed of the episode (task choice for built-ins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Caller-chosen episode id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub episode_id: Option<String>,
    /// Task selection by id (built-in code env: a task id; remote envs: passed through).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// Any other keys, passed through to remote servers unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ResetOptions {
    /// Reset options with only a seed.
    pub fn seeded(seed: u64) -> Self {
        ResetOptions {
            seed: Some(seed),
            ..Default::default()
        }
    }
}

/// The result of a `reset` or `step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepResult {
    /// The observation as an open JSON object (unknown env-specific fields are kept).
    pub observation: Map<String, Value>,
    /// The observation rendered as text for the model.
    pub text: String,
    /// The reward (`None` when the env sent `null`, e.g. after a reset).
    pub reward: Option<f64>,
    /// Whether the episode is over (advisory in OpenEnv: servers keep accepting steps).
    pub done: bool,
    /// Feedback text, e.g. a failing test's message (the hint channel uses it).
    pub feedback: Option<String>,
}

impl StepResult {
    /// Builds a result from an OpenEnv `{"observation", "reward", "done"}` payload.
    pub fn from_wire(payload: &Value) -> Result<StepResult, EnvError> {
        let obj = payload
            .as_object()
            .ok_or_else(|| EnvError::Protocol(format!("result is not an object: {payload}")))?;
        let observation = match obj.get("observation") {
            Some(Value::Object(o)) => o.clone(),
            Some(Value::Null) | None => Map::new(),
            Some(other) => {
                return Err(EnvError::Protocol(format!(
                    "field `observation` is not an object: {other}"
                )))
            }
        };
        let reward = parse_reward(obj.get("reward").unwrap_or(&Value::Null))
            .map_err(|e| EnvError::Protocol(format!("field `reward`: {e}")))?;
        let done = match obj.get("done") {
            Some(Value::Bool(b)) => *b,
            None | Some(Value::Null) => false,
            Some(other) => {
                return Err(EnvError::Protocol(format!(
                    "field `done` is not a bool: {other}"
                )))
            }
        };
        let feedback = observation
            .get("feedback")
            .and_then(Value::as_str)
            .map(str::to_string);
        let text = render_observation(&observation);
        Ok(StepResult {
            observation,
            text,
            reward,
            done,
            feedback,
        })
    }

    /// The OpenEnv wire form `{"observation", "reward", "done"}`.
    pub fn to_wire(&self) -> Value {
        serde_json::json!({
            "observation": self.observation,
            "reward": self.reward,
            "done": self.done,
        })
    }
}

/// Parses an OpenEnv reward: a number, a bool (WS sends rewards raw: `true` = 1) or null.
pub fn parse_reward(v: &Value) -> Result<Option<f64>, String> {
    match v {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(if *b { 1.0 } else { 0.0 })),
        Value::Number(n) => n
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("not an f64: {n}")),
        other => Err(format!("expected number, bool or null, got {other}")),
    }
}

/// Renders an observation as text for the model: the first present of the well-known text
/// fields (`prompt`, `text`, `feedback`, `echoed_message`, `message`, `output`, `stdout`),
/// else the only string field, else the compact JSON of the object.
pub fn render_observation(observation: &Map<String, Value>) -> String {
    const TEXT_FIELDS: [&str; 7] = [
        "prompt",
        "text",
        "feedback",
        "echoed_message",
        "message",
        "output",
        "stdout",
    ];
    for key in TEXT_FIELDS {
        if let Some(Value::String(s)) = observation.get(key) {
            return s.clone();
        }
    }
    let strings: Vec<&String> = observation
        .values()
        .filter_map(|v| match v {
            Value::String(s) => Some(s),
            _ => None,
        })
        .collect();
    if strings.len() == 1 {
        return strings[0].clone();
    }
    Value::Object(observation.clone()).to_string()
}

/// Failure causes, for counting (see [`crate::FailureCounts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// A call or an episode ran past its timeout.
    Timeout,
    /// Connection reset/closed, or another transport failure (server restarting).
    Connection,
    /// Nothing listens at the server's address (connection refused): the server is down,
    /// not slow, so this is never counted as a timeout.
    Refused,
    /// The server refused the session (`CAPACITY_REACHED`), retries exhausted.
    Capacity,
    /// The server or env failed (`EXECUTION_ERROR`, `FACTORY_ERROR`, `SESSION_ERROR`, 5xx).
    Server,
    /// The action did not fit the schema (`VALIDATION_ERROR`) or could not be parsed.
    InvalidAction,
    /// The peer broke the protocol (unexpected frame, `INVALID_JSON`, `UNKNOWN_TYPE`...).
    Protocol,
}

/// An environment error; [`EnvError::kind`] says which failure counter it belongs to.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EnvError {
    /// A call or episode timed out.
    #[error("timed out after {seconds:.1} s during {during}")]
    Timeout {
        /// The timeout that elapsed.
        seconds: f64,
        /// What was being waited for.
        during: String,
    },
    /// Could not connect, or the connection broke.
    #[error("connection error: {0}")]
    Connection(String),
    /// The server's address refused the connection: nothing listens there (server down).
    #[error("connection refused: {0}")]
    Refused(String),
    /// The server is at capacity (`CAPACITY_REACHED`).
    #[error("server at capacity: {0}")]
    Capacity(String),
    /// The server reported an error frame (or HTTP 5xx).
    #[error("server error {code}: {message}")]
    Server {
        /// The OpenEnv error code (`EXECUTION_ERROR`, `FACTORY_ERROR`...) or `HTTP <status>`.
        code: String,
        /// The server's message.
        message: String,
    },
    /// The action was rejected (`VALIDATION_ERROR` or not parseable).
    #[error("invalid action: {message}")]
    InvalidAction {
        /// What is wrong.
        message: String,
        /// Structured errors (pydantic style) when the server sent them.
        errors: Value,
    },
    /// The episode state is gone (the session closed); call `reset` again.
    #[error("no session: {0}")]
    NoSession(String),
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl EnvError {
    /// The failure counter this error belongs to.
    pub fn kind(&self) -> FailureKind {
        match self {
            EnvError::Timeout { .. } => FailureKind::Timeout,
            EnvError::Connection(_) | EnvError::NoSession(_) => FailureKind::Connection,
            EnvError::Refused(_) => FailureKind::Refused,
            EnvError::Capacity(_) => FailureKind::Capacity,
            EnvError::Server { code, .. } => match code.as_str() {
                "INVALID_JSON" | "UNKNOWN_TYPE" => FailureKind::Protocol,
                _ => FailureKind::Server,
            },
            EnvError::InvalidAction { .. } => FailureKind::InvalidAction,
            EnvError::Protocol(_) => FailureKind::Protocol,
        }
    }

    /// An invalid-action error without structured details.
    pub fn invalid_action(message: impl Into<String>) -> Self {
        EnvError::InvalidAction {
            message: message.into(),
            errors: Value::Null,
        }
    }
}

/// An environment: one episode at a time, reset then steps.
#[async_trait]
pub trait Env: Send {
    /// Starts a new episode; the result's observation is the task / first observation.
    async fn reset(&mut self, opts: ResetOptions) -> Result<StepResult, EnvError>;
    /// Applies one action (a JSON object in [`Env::action_schema`]).
    async fn step(&mut self, action: Action) -> Result<StepResult, EnvError>;
    /// The env's state as JSON (OpenEnv: at least `episode_id` and `step_count`).
    async fn state(&mut self) -> Result<Value, EnvError> {
        Ok(Value::Object(Map::new()))
    }
    /// Releases the env's resources (remote: sends `{"type":"close"}`).
    async fn close(&mut self) -> Result<(), EnvError>;
    /// Called once when [`crate::run_episode`] cuts an episode short (turn limit or token
    /// budget) without `done`. An env that grades its episodes grades it now (`REPO_ENV.md`:
    /// an episode ends at submit, a turn limit or a token budget, and is graded); the
    /// result's reward, feedback and observation fields become the last turn's. Default:
    /// nothing to grade (`Ok(None)`).
    async fn end_truncated(&mut self) -> Result<Option<StepResult>, EnvError> {
        Ok(None)
    }
    /// JSON Schema of actions, when known (remote envs: read from `/schema`).
    fn action_schema(&self) -> Option<Value>;
    /// Whether the env takes the model's whole turn as it is, instead of an action parsed
    /// from it: then [`crate::run_episode`] sends `{"text": <the turn's text>, "stopped":
    /// <it ended at a stop token>}` (e.g. an env that parses tool calls itself).
    fn takes_turn_text(&self) -> bool {
        false
    }
    /// JSON Schema of observations (served on `/schema`).
    fn observation_schema(&self) -> Value {
        serde_json::json!({"type": "object", "additionalProperties": true})
    }
    /// JSON Schema of states (served on `/schema`).
    fn state_schema(&self) -> Value {
        serde_json::json!({
            "type": "object",
            "additionalProperties": true,
            "properties": {
                "episode_id": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null},
                "step_count": {"type": "integer", "minimum": 0, "default": 0}
            }
        })
    }
    /// The MCP tools this env serves (`{name, description, input_schema}` each), or `None`
    /// when it speaks no MCP. An env that has tools takes the steps `{"type":"list_tools"}`
    /// and `{"type":"call_tool","tool_name","arguments"}` and answers a call with the
    /// observation `{tool_name, result, error}`; the server maps JSON-RPC `tools/list` and
    /// `tools/call` onto these (see `REPO_ENV.md`).
    fn mcp_tools(&self) -> Option<Vec<Value>> {
        None
    }
    /// Failures this env retried past on its own since the last call (e.g. refused
    /// connections while its server restarts): the pool counts and logs them even though
    /// the call then succeeded, so an outage that was ridden out still shows in the metrics.
    fn take_retried_failures(&mut self) -> Vec<EnvError> {
        Vec::new()
    }
    /// Metadata served on `/metadata` (name, description, version...).
    fn metadata(&self) -> Value {
        serde_json::json!({"name": "Environment", "description": "Environment", "readme_content": null,
            "version": "1.0.0", "author": null, "documentation_url": null})
    }
}

/// Makes envs: one per episode (pool) or per session (server).
pub type EnvFactory = Arc<dyn Fn() -> anyhow::Result<Box<dyn Env>> + Send + Sync>;
