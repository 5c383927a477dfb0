//! Tool calling in the model's own chat format: the tools rendered into the prompt by the
//! checkpoint's chat template (`tools=` as transformers' `apply_chat_template` does), the
//! model's tool calls parsed in the format that template defines, and tool results rendered
//! back as `tool` messages.
//!
//! Supported call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
//! number per turn (Qwen2.5, Qwen3, Hermes and the templates that copy them). A template
//! whose source has no `<tool_call>` is refused up front, naming the template.
//!
//! The text after a model turn is what the template renders after that turn (the rest of
//! the assistant message, the tool messages, the next assistant header): the suffix of
//! rendering the conversation with the tool messages over rendering it without them, with
//! a placeholder assistant turn. So templates must be prefix-preserving for appended tool
//! messages (checked; the error names the template).

use anyhow::{bail, Context, Result};
use composer_model::{ChatMessage, ChatTemplate};
use serde_json::Value;

/// Where the tool-call format comes from: the template's source must show it.
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// Stands for a model turn when rendering the text that follows one.
const TURN_PLACEHOLDER: &str = "\u{1}composer-model-turn\u{1}";

/// One tool call as the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// Tool name.
    pub name: String,
    /// Arguments (a JSON object).
    pub arguments: Value,
}

/// A tool call as a model writes it (`<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`),
/// the form [`parse_tool_calls`] reads back (scripted teachers write their turns with it).
/// `<` is written `\u003c` (the same JSON string), so an argument holding `</tool_call>`
/// (say, a file that mentions the format) cannot end the call early.
pub fn format_tool_call(name: &str, arguments: &Value) -> String {
    // Outside strings JSON has no `<`, so this only rewrites string contents.
    let body = serde_json::json!({"name": name, "arguments": arguments})
        .to_string()
        .replace('<', "\\u003c");
    format!("{CALL_OPEN}\n{body}\n{CALL_CLOSE}")
}

/// Parses every `<tool_call>…</tool_call>` block of a model turn, in order. Each is a call
/// or the reason it is malformed (not JSON, no `name`, `arguments` not an object, no closing
/// tag). A turn without blocks gives an empty list.
pub fn parse_tool_calls(text: &str) -> Vec<Result<ToolCall, String>> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(CALL_OPEN) {
        let body_start = open + CALL_OPEN.len();
        let (body, next) = match rest[body_start..].find(CALL_CLOSE) {
            Some(close) => (
                &rest[body_start..body_start + close],
                &rest[body_start + close + CALL_CLOSE.len()..],
            ),
            None => {
                out.push(Err(format!(
                    "{CALL_OPEN} without {CALL_CLOSE} (the turn ended inside the call)"
                )));
                break;
            }
        };
        out.push(parse_call_body(body.trim()));
        rest = next;
    }
    out
}

fn parse_call_body(body: &str) -> Result<ToolCall, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| {
        format!(
            "the tool call is not JSON ({e}): {}",
            body.chars().take(200).collect::<String>()
        )
    })?;
    let obj = v
        .as_object()
        .ok_or_else(|| format!("the tool call is not a JSON object: {v:.200}"))?;
    let name = obj
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or("the tool call has no string `name`")?;
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::Object(m)) => Value::Object(m.clone()),
        // Some models write the arguments as a JSON string (OpenAI's wire form).
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                return Err(format!(
                    "`arguments` of `{name}` is not a JSON object: {s:.200}"
                ))
            }
        },
        Some(other) => {
            return Err(format!(
                "`arguments` of `{name}` is not a JSON object: {other:.200}"
            ))
        }
    };
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

/// A chat template that renders tools and tool results, with its tool-call format checked.
#[derive(Debug, Clone)]
pub struct ToolChat {
    template: ChatTemplate,
    /// A system message put before the task (None: the template's default).
    system: Option<String>,
}

impl ToolChat {
    /// Wraps `template` (`origin` names it in errors): its source must define the
    /// `<tool_call>` format and use the `tools` variable, and appending tool messages must
    /// keep the rendered prefix (checked by rendering a sample conversation).
    pub fn new(template: ChatTemplate, system: Option<String>, origin: &str) -> Result<ToolChat> {
        if !template.source.contains(CALL_OPEN) || !template.source.contains("tools") {
            bail!(
                "{origin}: the chat template does not render tools in a format the trainer parses \
                 (it needs `tools` and `{CALL_OPEN}...{CALL_CLOSE}`, as Qwen2.5/Qwen3/Hermes \
                 templates have); set `[env] chat_template` to such a template"
            );
        }
        let chat = ToolChat { template, system };
        chat.after_turn(&["probe".to_string()], true, "tool", &[])
            .with_context(|| format!("{origin}: checking the chat template with tool messages"))?;
        Ok(chat)
    }

    fn head(&self, task: &str) -> Vec<ChatMessage> {
        let mut m = Vec::new();
        if let Some(s) = &self.system {
            m.push(ChatMessage::new("system", s));
        }
        m.push(ChatMessage::new("user", task));
        m
    }

    /// The template's end-of-turn token (the stop token a model's turn ends with).
    pub fn eos_token(&self) -> &str {
        &self.template.eos_token
    }

    /// The episode's prompt: the system message, the tools and the task as the user
    /// message, then the assistant header.
    pub fn prompt(&self, task: &str, tools: &[Value]) -> Result<String> {
        self.template
            .render_with_tools(&self.head(task), Some(tools), true)
    }

    /// The text after a model turn: the end of the assistant message (less the stop token
    /// the model already produced when `stopped`), one `role` message per entry of
    /// `contents` (`tool` results, or a `user` nudge), and the next assistant header.
    pub fn after_turn(
        &self,
        contents: &[String],
        stopped: bool,
        role: &str,
        tools: &[Value],
    ) -> Result<String> {
        let mut base = self.head("task");
        base.push(ChatMessage::new("assistant", TURN_PLACEHOLDER));
        let prefix = self.template.render_with_tools(&base, Some(tools), false)?;
        let mut full_msgs = base;
        full_msgs.extend(contents.iter().map(|c| ChatMessage::new(role, c)));
        let full = self
            .template
            .render_with_tools(&full_msgs, Some(tools), true)?;
        let Some(suffix) = full.strip_prefix(prefix.as_str()) else {
            bail!(
                "the chat template renders earlier messages differently once `{role}` messages \
                 follow (not prefix-preserving), so tool results cannot be appended"
            );
        };
        let at = prefix
            .rfind(TURN_PLACEHOLDER)
            .context("the chat template drops the assistant message's content")?;
        let mut end_of_turn = &prefix[at + TURN_PLACEHOLDER.len()..];
        let eos = self.template.eos_token.as_str();
        if stopped && !eos.is_empty() {
            end_of_turn = end_of_turn.strip_prefix(eos).unwrap_or(end_of_turn);
        }
        Ok(format!("{end_of_turn}{suffix}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn formatted_calls_parse_back() {
        // Content with the closing tag's characters, quotes and newlines survives (JSON-escaped).
        let args = json!({"path": "a.py", "content": "x = \"</tool\"\n# </tool_call>?\n"});
        let text = format!(
            "{}\n{}",
            format_tool_call("write_file", &args),
            format_tool_call("submit", &json!({}))
        );
        let calls = parse_tool_calls(&text);
        assert_eq!(
            calls,
            vec![
                Ok(ToolCall {
                    name: "write_file".into(),
                    arguments: args
                }),
                Ok(ToolCall {
                    name: "submit".into(),
                    arguments: json!({})
                })
            ]
        );
    }

    #[test]
    fn parses_several_calls_and_reports_malformed_ones() {
        let text = "I'll look.\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.py\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"run_tests\"}\n</tool_call><tool_call>{\"name\": \"x\", \"arguments\": \"{\\\"k\\\": 1}\"}</tool_call>";
        let calls = parse_tool_calls(text);
        assert_eq!(calls.len(), 3);
        assert_eq!(
            calls[0],
            Ok(ToolCall {
                name: "read_file".into(),
                arguments: json!({"path": "a.py"})
            })
        );
        assert_eq!(calls[1].as_ref().unwrap().arguments, json!({}));
        assert_eq!(calls[2].as_ref().unwrap().arguments, json!({"k": 1}));
        assert!(parse_tool_calls("no calls here").is_empty());
        let bad = parse_tool_calls(
            "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{\"arguments\": {}}</tool_call><tool_call>{\"name\": \"a\", \"arguments\": 3}</tool_call><tool_call>{\"name\": \"a\"",
        );
        assert_eq!(bad.len(), 5);
        assert!(bad[0].as_ref().unwrap_err().contains("not JSON"));
        assert!(bad[1].as_ref().unwrap_err().contains("not a JSON object"));
        assert!(bad[2].as_ref().unwrap_err().contains("no string `name`"));
        assert!(bad[3].as_ref().unwrap_err().contains("`arguments` of `a`"));
        assert!(bad[4]
            .as_ref()
            .unwrap_err()
            .contains("without </tool_call>"));
    }

    #[test]
    fn templates_without_tool_calls_are_refused() {
        let plain = ChatTemplate {
            source: "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}".into(),
            bos_token: String::new(),
            eos_token: "<|im_end|>".into(),
        };
        let e = ToolChat::new(plain, None, "checkpoint X").unwrap_err();
        assert!(format!("{e:#}").contains("checkpoint X"), "{e:#}");
    }
}
