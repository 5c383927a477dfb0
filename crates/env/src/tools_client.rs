//! The client side of OpenEnv's MCP tool interface: [`ToolEnv`] (reset, list the tools, call
//! one), implemented by [`RemoteEnv`] over WebSocket `/ws` with openenv 0.10's gym-style
//! actions (`{"type":"list_tools"}`, `{"type":"call_tool","tool_name","arguments"}`), and the
//! parsing of what such a server answers ([`ToolDef`], [`ToolCallOutcome`]).
//!
//! A server whose action class is its own (openenv's `create_app` with an env-specific
//! action) refuses those steps; its tools are then listed and called over MCP JSON-RPC
//! (`{"type":"mcp"}` frames on the same session), which carries no reward and never ends the
//! episode. Checked against the `openenv` package's own server in
//! tests/openenv_mcp_client.rs.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::client::RemoteEnv;
use crate::env::{Env, EnvError, ResetOptions, StepResult};

/// A tool as the server lists it: name, description and the JSON schema of its arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDef {
    /// Tool name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// JSON schema of the arguments object.
    pub input_schema: Value,
}

impl ToolDef {
    /// Parses one entry of a tool listing; the schema key may be `input_schema` (openenv with
    /// mcp 2.x, gym-style `list_tools`) or `inputSchema` (JSON-RPC `tools/list`, mcp 1.x).
    pub fn from_listing(v: &Value) -> Result<ToolDef, EnvError> {
        let name = v
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                EnvError::Protocol(format!("tool listing entry without a name: {v:.200}"))
            })?;
        let input_schema = v
            .get("input_schema")
            .or_else(|| v.get("inputSchema"))
            .cloned()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        if !input_schema.is_object() {
            return Err(EnvError::Protocol(format!(
                "tool `{name}`: input schema is not an object: {input_schema:.200}"
            )));
        }
        Ok(ToolDef {
            name: name.to_string(),
            description: v
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            input_schema,
        })
    }

    /// The tool as transformers' `apply_chat_template(tools=...)` takes a JSON-schema tool:
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`.
    pub fn as_chat_tool(&self) -> Value {
        json!({"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.input_schema}})
    }
}

/// Parses a tool listing: `{"tools": [...]}` (an observation or a `tools/list` result).
pub fn parse_tool_listing(v: &Value) -> Result<Vec<ToolDef>, EnvError> {
    let tools = v
        .get("tools")
        .and_then(Value::as_array)
        .ok_or_else(|| EnvError::Protocol(format!("tool listing without `tools`: {v:.300}")))?;
    tools.iter().map(ToolDef::from_listing).collect()
}

/// The tools of a `list_tools` step's observation. openenv's `MCPEnvironment` reports a
/// listing that failed on its side as an empty `tools` with `metadata.error` and
/// `metadata.error_type` (`list_tools_failed`): that is an error naming the server's reason,
/// not an env without tools.
fn listing_from_observation(obs: &Map<String, Value>) -> Result<Vec<ToolDef>, EnvError> {
    let failure = obs
        .get("metadata")
        .and_then(|m| m.get("error"))
        .filter(|e| !e.is_null());
    let listed = obs
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    if let (Some(error), false) = (failure, listed) {
        let code = obs
            .get("metadata")
            .and_then(|m| m.get("error_type"))
            .and_then(Value::as_str)
            .unwrap_or("list_tools_failed");
        return Err(EnvError::Server {
            code: code.to_string(),
            message: format!(
                "the server's tool listing failed: {}",
                error
                    .as_str()
                    .map_or_else(|| error.to_string(), str::to_string)
            ),
        });
    }
    parse_tool_listing(&Value::Object(obs.clone()))
}

/// The error class of a JSON-RPC `tools/call` error, by openenv `MCPEnvironment`'s own rule
/// for tool exceptions (`_async_handle_call_tool`: "not found" / "unknown tool", then
/// "invalid" / "argument"), plus pydantic's "validation error" and JSON-RPC's invalid-params
/// code (-32602), so a call has the same class on both paths.
fn rpc_error_type(code: i64, message: &str) -> &'static str {
    let m = message.to_lowercase();
    if m.contains("not found") || m.contains("unknown tool") {
        "tool_not_found"
    } else if code == -32602
        || m.contains("invalid")
        || m.contains("argument")
        || m.contains("validation error")
    {
        "invalid_args"
    } else {
        "execution_error"
    }
}

/// What one tool call came back with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallOutcome {
    /// The text to show the agent (the result's text content, or the error).
    pub text: String,
    /// The server's error class (`tool_not_found`, `invalid_args`, `execution_error`,
    /// `timeout`), or `tool_error` for a result flagged `is_error`; None on success.
    pub error_type: Option<String>,
    /// The step's reward (None when the server sent null).
    pub reward: Option<f64>,
    /// Whether the episode is over (e.g. after `submit`).
    pub done: bool,
    /// The raw observation (for env-specific fields such as a grade).
    pub observation: Map<String, Value>,
}

impl ToolCallOutcome {
    /// Parses a `call_tool` step's result: `observation: {tool_name, result, error}` where
    /// `result` is an MCP `CallToolResult` (`content[].text`, `structured_content`, `data`,
    /// `is_error`) or a plain value, and `error` null or `{error_type, message}`.
    pub fn from_step(step: StepResult) -> ToolCallOutcome {
        let obs = &step.observation;
        let mut error_type = None;
        let mut text = String::new();
        if let Some(err) = obs.get("error").filter(|e| !e.is_null()) {
            let kind = err
                .get("error_type")
                .and_then(Value::as_str)
                .unwrap_or("error")
                .to_string();
            let message = err
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            text = format!("Error ({kind}): {message}");
            error_type = Some(kind);
        }
        if let Some(result) = obs.get("result").filter(|r| !r.is_null()) {
            let result_text = result_text(result);
            if result.get("is_error").or_else(|| result.get("isError")) == Some(&Value::Bool(true))
                && error_type.is_none()
            {
                error_type = Some("tool_error".into());
            }
            // With `error` set the result repeats it (openenv puts the message in both).
            if text.is_empty() {
                text = result_text;
            }
        }
        if text.is_empty() && error_type.is_none() && !obs.contains_key("result") {
            // Not the gym-style shape: show what the server sent.
            text = step.text.clone();
        }
        ToolCallOutcome {
            text,
            error_type,
            reward: step.reward,
            done: step.done,
            observation: step.observation,
        }
    }

    /// Parses a JSON-RPC `tools/call` response (`{result}`: a `CallToolResult`, or
    /// `{error: {code, message}}`) as the outcome of a gym-style step with the same result
    /// or error would be; JSON-RPC carries no reward and never ends the episode.
    pub fn from_rpc(tool_name: &str, reply: &Value) -> Result<ToolCallOutcome, EnvError> {
        let observation = if let Some(err) = reply.get("error").filter(|e| !e.is_null()) {
            let message = err
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| err.to_string(), str::to_string);
            let code = err.get("code").and_then(Value::as_i64).unwrap_or(0);
            json!({"tool_name": tool_name, "result": null, "error":
                {"error_type": rpc_error_type(code, &message), "message": message}})
        } else if let Some(result) = reply.get("result") {
            json!({"tool_name": tool_name, "result": result, "error": null})
        } else {
            return Err(EnvError::Protocol(format!(
                "tools/call `{tool_name}`: a JSON-RPC response without `result` or `error`: {reply:.300}"
            )));
        };
        let step = StepResult::from_wire(&json!({"observation": observation}))?;
        Ok(ToolCallOutcome::from_step(step))
    }

    /// Hidden tests passed and total, when the reply carries a grade: an object with numeric
    /// `passed` and `total` in the observation, its `metadata`, or the result's
    /// `structured_content` / `data`; else a `passed N/M` phrase in the text.
    pub fn tests_passed(&self) -> Option<(u64, u64)> {
        let obs = Value::Object(self.observation.clone());
        let places = [
            obs.get("metadata"),
            obs.pointer("/metadata/grade"),
            obs.get("grade"),
            obs.pointer("/result/structured_content"),
            obs.pointer("/result/structured_content/grade"),
            obs.pointer("/result/structuredContent"),
            obs.pointer("/result/data"),
            obs.pointer("/result/data/grade"),
            Some(&obs),
        ];
        for v in places.into_iter().flatten() {
            if let (Some(p), Some(t)) = (
                v.get("passed").and_then(Value::as_u64),
                v.get("total").and_then(Value::as_u64),
            ) {
                return Some((p, t));
            }
        }
        let at = self.text.find("passed ")?;
        let rest = &self.text[at + "passed ".len()..];
        let (p, rest) = rest.split_once('/')?;
        let t: String = rest.chars().take_while(char::is_ascii_digit).collect();
        Some((p.trim().parse().ok()?, t.parse().ok()?))
    }
}

/// The text of a tool result: an MCP `CallToolResult`'s text contents joined by newlines
/// (else its `data` / `structured_content` as JSON), or a plain string as is.
fn result_text(result: &Value) -> String {
    match result {
        Value::String(s) => s.clone(),
        Value::Object(o) => {
            if let Some(content) = o.get("content").and_then(Value::as_array) {
                let texts: Vec<&str> = content
                    .iter()
                    .filter_map(|c| c.get("text").and_then(Value::as_str))
                    .collect();
                if !texts.is_empty() {
                    return texts.join("\n");
                }
            }
            match o
                .get("data")
                .or_else(|| o.get("structured_content"))
                .filter(|v| !v.is_null())
            {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => String::new(),
            }
        }
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// An environment played through tools: reset to a task, list the tools, call them.
#[async_trait]
pub trait ToolEnv: Send {
    /// Starts an episode; the observation holds the task statement.
    async fn reset(&mut self, opts: ResetOptions) -> Result<StepResult, EnvError>;
    /// The tools of this episode.
    async fn list_tools(&mut self) -> Result<Vec<ToolDef>, EnvError>;
    /// Calls one tool. A bad call (unknown tool, bad arguments, a failing command) is an
    /// outcome with `error_type` set; `Err` means the session itself failed.
    async fn call_tool(
        &mut self,
        name: &str,
        arguments: Value,
    ) -> Result<ToolCallOutcome, EnvError>;
    /// Ends the session.
    async fn close(&mut self) -> Result<(), EnvError>;
}

#[async_trait]
impl ToolEnv for RemoteEnv {
    async fn reset(&mut self, opts: ResetOptions) -> Result<StepResult, EnvError> {
        Env::reset(self, opts).await
    }

    async fn list_tools(&mut self) -> Result<Vec<ToolDef>, EnvError> {
        if !self.tools_over_rpc {
            match Env::step(self, json!({"type": "list_tools"})).await {
                Ok(step) => return listing_from_observation(&step.observation),
                // A server whose action class is its own refuses the gym-style action
                // (VALIDATION_ERROR) but serves its tools over JSON-RPC: use that from now on.
                Err(EnvError::InvalidAction { .. }) => self.tools_over_rpc = true,
                Err(e) => return Err(e),
            }
        }
        let reply = self
            .mcp(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
            .await?;
        if let Some(err) = reply.get("error") {
            return Err(EnvError::Protocol(format!("tools/list: {err}")));
        }
        parse_tool_listing(reply.get("result").unwrap_or(&Value::Null))
    }

    async fn call_tool(
        &mut self,
        name: &str,
        arguments: Value,
    ) -> Result<ToolCallOutcome, EnvError> {
        if self.tools_over_rpc {
            let reply = self
                .mcp(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                             "params": {"name": name, "arguments": arguments}}))
                .await?;
            return ToolCallOutcome::from_rpc(name, &reply);
        }
        let action = json!({"type": "call_tool", "tool_name": name, "arguments": arguments});
        match Env::step(self, action).await {
            Ok(step) => Ok(ToolCallOutcome::from_step(step)),
            // A call the server's message validation refused (e.g. arguments not an object)
            // is the agent's mistake, not the session's.
            Err(EnvError::InvalidAction { message, .. }) => Ok(ToolCallOutcome {
                text: format!("Error (invalid_args): {message}"),
                error_type: Some("invalid_args".into()),
                reward: None,
                done: false,
                observation: Map::new(),
            }),
            Err(e) => Err(e),
        }
    }

    async fn close(&mut self) -> Result<(), EnvError> {
        Env::close(self).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(observation: Value, reward: Value, done: bool) -> StepResult {
        StepResult::from_wire(&json!({"observation": observation, "reward": reward, "done": done}))
            .unwrap()
    }

    #[test]
    fn listings_accept_both_schema_keys() {
        let tools = parse_tool_listing(&json!({"tools": [
            {"name": "a", "description": "A", "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}},
            {"name": "b", "inputSchema": {"type": "object"}},
        ]}))
        .unwrap();
        assert_eq!(tools[0].input_schema["properties"]["x"]["type"], "string");
        assert_eq!(tools[1].input_schema, json!({"type": "object"}));
        assert_eq!(tools[1].description, "");
        assert_eq!(
            tools[0].as_chat_tool()["function"]["parameters"],
            tools[0].input_schema
        );
        assert!(parse_tool_listing(&json!({"tools": [{"description": "no name"}]})).is_err());
        assert!(parse_tool_listing(&json!({"tools": [{"name": "a", "inputSchema": 3}]})).is_err());
        assert!(parse_tool_listing(&json!({})).is_err());
    }

    #[test]
    fn a_failed_listing_is_an_error_with_the_servers_reason() {
        // openenv MCPEnvironment's shape when its MCP client fails to list.
        let failed = json!({"tools": [], "metadata": {"error": "registry down", "error_type": "list_tools_failed"}});
        match listing_from_observation(failed.as_object().unwrap()) {
            Err(EnvError::Server { code, message }) => {
                assert_eq!(code, "list_tools_failed");
                assert!(message.contains("registry down"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let listed = json!({"tools": [{"name": "a"}], "metadata": {}});
        assert_eq!(
            listing_from_observation(listed.as_object().unwrap()).unwrap()[0].name,
            "a"
        );
    }

    #[test]
    fn json_rpc_results_and_errors_read_like_steps() {
        let ok = ToolCallOutcome::from_rpc(
            "add",
            &json!({"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": "7"}], "structured_content": {"result": 7}, "data": 7, "is_error": false}}),
        )
        .unwrap();
        assert_eq!(
            (ok.text.as_str(), ok.error_type, ok.done),
            ("7", None, false)
        );
        assert_eq!(ok.observation["tool_name"], "add");
        for (code, message, class) in [
            (-32603, "Unknown tool: 'nope'", "tool_not_found"),
            (-32603, "1 validation error for call[add]", "invalid_args"),
            (-32602, "Missing 'name' in params", "invalid_args"),
            (
                -32603,
                "Error calling tool 'divide': division by zero",
                "execution_error",
            ),
        ] {
            let bad = ToolCallOutcome::from_rpc(
                "t",
                &json!({"jsonrpc": "2.0", "id": 1, "error": {"code": code, "message": message, "data": null}}),
            )
            .unwrap();
            assert_eq!(bad.error_type.as_deref(), Some(class), "{message}");
            assert_eq!(bad.text, format!("Error ({class}): {message}"));
        }
        assert!(ToolCallOutcome::from_rpc("t", &json!({"jsonrpc": "2.0", "id": 1})).is_err());
    }

    #[test]
    fn call_results_errors_and_grades() {
        let ok = ToolCallOutcome::from_step(step(
            json!({"tool_name": "read_file", "result": {"content": [{"type": "text", "text": "line"}], "structured_content": null, "data": null, "is_error": false}, "error": null}),
            Value::Null,
            false,
        ));
        assert_eq!((ok.text.as_str(), ok.error_type.as_deref()), ("line", None));
        let bad = ToolCallOutcome::from_step(step(
            json!({"tool_name": "nope", "result": null, "error": {"error_type": "tool_not_found", "message": "no tool \"nope\""}}),
            json!(0.0),
            false,
        ));
        assert_eq!(bad.error_type.as_deref(), Some("tool_not_found"));
        assert!(bad.text.starts_with("Error (tool_not_found): no tool"));
        let flagged = ToolCallOutcome::from_step(step(
            json!({"tool_name": "run_shell", "result": {"content": [{"type": "text", "text": "boom"}], "is_error": true}, "error": null}),
            Value::Null,
            false,
        ));
        assert_eq!(flagged.error_type.as_deref(), Some("tool_error"));
        let plain = ToolCallOutcome::from_step(step(
            json!({"tool_name": "x", "result": "plain", "error": null}),
            Value::Null,
            false,
        ));
        assert_eq!(plain.text, "plain");
        // A grade in structured content, or only in the text.
        let graded = ToolCallOutcome::from_step(step(
            json!({"tool_name": "submit", "result": {"content": [{"type": "text", "text": "done"}], "structured_content": {"passed": 3, "total": 4, "reward": 0.75}}, "error": null}),
            json!(0.75),
            true,
        ));
        assert_eq!(graded.tests_passed(), Some((3, 4)));
        assert!(graded.done && graded.reward == Some(0.75));
        let text_only = ToolCallOutcome::from_step(step(
            json!({"tool_name": "submit", "result": "passed 1/5 hidden tests\nFAILED m::t: x", "error": null}),
            json!(0.2),
            true,
        ));
        assert_eq!(text_only.tests_passed(), Some((1, 5)));
        assert_eq!(ok.tests_passed(), None);
    }
}
