//! [`ToolChatEnv`]: an MCP-tool environment ([`ToolEnv`]: an OpenEnv server's
//! `list_tools` / `call_tool`) played as a chat with tools, behind composer-env's [`Env`], so
//! that [`composer_env::run_episode`] and the env pool drive it like any other env.
//!
//! - reset: the server's reset (the task statement) and its tool listing, rendered into the
//!   prompt by the chat template with `tools=` ([`ToolChat::prompt`]);
//! - step: the model's whole turn (`takes_turn_text`): every tool call in it is parsed
//!   ([`parse_tool_calls`]), checked (known tool, arguments fit its schema) and sent; the
//!   results come back as `tool` messages, rendered as the template renders them. The
//!   appended text is the observation, whose tokens the episode masks out of the loss. A
//!   malformed call gets an error message in place of a result and is counted; a turn
//!   without any call gets a user message asking for one. Neither ends the episode.
//! - the episode ends when a call's reply says `done` (e.g. `submit`), with that reply's
//!   reward; the turn limit and token budget are the episode runner's.
//!
//! Each step's observation carries the episode's running [`ToolEpisodeStats`] under
//! [`STATS_KEY`], so the trainer reads them from the last turn.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use composer_env::{
    validate_action, Action, Env, EnvError, ResetOptions, StepResult, ToolDef, ToolEnv,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::tool_calls::{parse_tool_calls, ToolChat};

/// Observation key of the running [`ToolEpisodeStats`].
pub const STATS_KEY: &str = "composer_tool_stats";

/// What a tool episode did so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolEpisodeStats {
    /// Calls sent, by tool name.
    pub tool_calls: BTreeMap<String, u64>,
    /// Malformed calls: unparseable, unknown tool, arguments that do not fit the schema
    /// (found here or reported by the server as `tool_not_found` / `invalid_args`).
    pub malformed_calls: u64,
    /// Model turns without any tool call.
    pub turns_without_call: u64,
    /// Hidden tests passed and total, once graded.
    pub tests: Option<(u64, u64)>,
    /// Seconds spent in tool calls (the sandbox), grading included.
    pub tool_s: f64,
    /// Seconds of the call that ended the episode (grading: the verifier wall).
    pub verifier_s: Option<f64>,
    /// Whether the episode was graded by the runner's `submit` at the turn limit or token
    /// budget (the agent never submitted).
    #[serde(default)]
    pub graded_at_limit: bool,
}

impl ToolEpisodeStats {
    /// The stats recorded in a step's observation, if any.
    pub fn from_observation(obs: &Map<String, Value>) -> Option<ToolEpisodeStats> {
        serde_json::from_value(obs.get(STATS_KEY)?.clone()).ok()
    }
}

/// The tool that ends and grades an episode (`REPO_ENV.md`).
const SUBMIT_TOOL: &str = "submit";

/// Error classes a server reports for a call the agent got wrong.
const AGENT_ERRORS: [&str; 2] = ["tool_not_found", "invalid_args"];

/// The user message after a turn without a tool call.
const NO_CALL_NUDGE: &str = "No tool call found. Call a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; call `submit` when you are done.";

/// An MCP-tool env as a chat-with-tools [`Env`] (see the module docs).
pub struct ToolChatEnv<E: ToolEnv> {
    inner: E,
    chat: Arc<ToolChat>,
    tools: Vec<ToolDef>,
    chat_tools: Vec<Value>,
    stats: ToolEpisodeStats,
}

impl<E: ToolEnv> ToolChatEnv<E> {
    /// Plays `inner` with the chat format of `chat`.
    pub fn new(inner: E, chat: Arc<ToolChat>) -> Self {
        ToolChatEnv {
            inner,
            chat,
            tools: Vec::new(),
            chat_tools: Vec::new(),
            stats: ToolEpisodeStats::default(),
        }
    }

    /// The statement of a reset observation: `statement` (or `metadata.statement`), else
    /// the observation's text.
    fn statement(r: &StepResult) -> String {
        r.observation
            .get("statement")
            .or_else(|| {
                r.observation
                    .get("metadata")
                    .and_then(|m| m.get("statement"))
            })
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| r.text.clone())
    }

    /// Checks a parsed call against the listing: the error message for the agent, or None.
    fn check_call(&self, name: &str, arguments: &Value) -> Option<String> {
        let Some(tool) = self.tools.iter().find(|t| t.name == name) else {
            let names: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
            return Some(format!(
                "Error (tool_not_found): no tool {name:?}; tools: {}",
                names.join(", ")
            ));
        };
        let issues = validate_action(&tool.input_schema, arguments);
        if issues.is_empty() {
            return None;
        }
        let what: Vec<String> = issues
            .iter()
            .map(|i| {
                let at: Vec<String> = i.loc.iter().map(|l| l.to_string()).collect();
                format!("{} at [{}]", i.msg, at.join(", "))
            })
            .collect();
        Some(format!(
            "Error (invalid_args): arguments of `{name}` do not fit its schema: {}",
            what.join("; ")
        ))
    }
}

#[async_trait]
impl<E: ToolEnv> Env for ToolChatEnv<E> {
    async fn reset(&mut self, opts: ResetOptions) -> Result<StepResult, EnvError> {
        self.stats = ToolEpisodeStats::default();
        let first = self.inner.reset(opts).await?;
        self.tools = self.inner.list_tools().await?;
        if self.tools.is_empty() {
            return Err(EnvError::Protocol("the server lists no tools".into()));
        }
        self.chat_tools = self.tools.iter().map(ToolDef::as_chat_tool).collect();
        let statement = Self::statement(&first);
        let text = self
            .chat
            .prompt(&statement, &self.chat_tools)
            .map_err(|e| EnvError::Protocol(format!("rendering the prompt: {e:#}")))?;
        let mut observation = first.observation;
        observation.insert("statement".into(), Value::String(statement));
        Ok(StepResult {
            observation,
            text,
            reward: None,
            done: false,
            feedback: None,
        })
    }

    async fn step(&mut self, action: Action) -> Result<StepResult, EnvError> {
        let text = action.get("text").and_then(Value::as_str).unwrap_or("");
        let stopped = action
            .get("stopped")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let calls = parse_tool_calls(text);
        let mut results: Vec<String> = Vec::with_capacity(calls.len());
        let mut end: Option<(Option<f64>, String)> = None;
        for call in calls {
            let call = match call {
                Ok(c) => c,
                Err(why) => {
                    self.stats.malformed_calls += 1;
                    results.push(format!("Error (malformed_call): {why}"));
                    continue;
                }
            };
            if let Some(err) = self.check_call(&call.name, &call.arguments) {
                self.stats.malformed_calls += 1;
                results.push(err);
                continue;
            }
            *self.stats.tool_calls.entry(call.name.clone()).or_default() += 1;
            let t0 = Instant::now();
            let out = self.inner.call_tool(&call.name, call.arguments).await?;
            let wall = t0.elapsed().as_secs_f64();
            self.stats.tool_s += wall;
            if out
                .error_type
                .as_deref()
                .is_some_and(|e| AGENT_ERRORS.contains(&e))
            {
                self.stats.malformed_calls += 1;
            }
            if out.done {
                self.stats.verifier_s = Some(wall);
                self.stats.tests = out.tests_passed();
                end = Some((out.reward, out.text));
                break;
            }
            results.push(out.text);
        }
        let mut observation = Map::new();
        if let Some((reward, report)) = end {
            observation.insert(STATS_KEY.into(), json!(self.stats));
            return Ok(StepResult {
                observation,
                text: report.clone(),
                reward,
                done: true,
                feedback: Some(report),
            });
        }
        let (contents, role) = if results.is_empty() {
            self.stats.turns_without_call += 1;
            (vec![NO_CALL_NUDGE.to_string()], "user")
        } else {
            (results, "tool")
        };
        let text = self
            .chat
            .after_turn(&contents, stopped, role, &self.chat_tools)
            .map_err(|e| EnvError::Protocol(format!("rendering tool results: {e:#}")))?;
        observation.insert(STATS_KEY.into(), json!(self.stats));
        Ok(StepResult {
            observation,
            text,
            reward: None,
            done: false,
            feedback: None,
        })
    }

    async fn close(&mut self) -> Result<(), EnvError> {
        self.inner.close().await
    }

    /// An episode cut short by the turn limit or token budget is graded as `REPO_ENV.md`
    /// says: when the server lists a `submit` tool that takes no required arguments, it is
    /// called (not counted as the agent's call); its reward and report end the episode.
    async fn end_truncated(&mut self) -> Result<Option<StepResult>, EnvError> {
        let submit = self.tools.iter().find(|t| t.name == SUBMIT_TOOL);
        let Some(submit) = submit else {
            return Ok(None);
        };
        if !validate_action(&submit.input_schema, &json!({})).is_empty() {
            return Ok(None);
        }
        let t0 = Instant::now();
        let out = self.inner.call_tool(SUBMIT_TOOL, json!({})).await?;
        let wall = t0.elapsed().as_secs_f64();
        self.stats.tool_s += wall;
        if !out.done {
            return Ok(None);
        }
        self.stats.verifier_s = Some(wall);
        self.stats.tests = out.tests_passed();
        self.stats.graded_at_limit = true;
        let mut observation = Map::new();
        observation.insert(STATS_KEY.into(), json!(self.stats));
        Ok(Some(StepResult {
            observation,
            text: out.text.clone(),
            reward: out.reward,
            done: true,
            feedback: Some(out.text),
        }))
    }

    fn action_schema(&self) -> Option<Value> {
        Some(
            json!({"type": "object", "properties": {"text": {"type": "string"},
            "stopped": {"type": "boolean"}}, "required": ["text"]}),
        )
    }

    fn takes_turn_text(&self) -> bool {
        true
    }
}

/// The per-step tool-episode metrics of `episodes` (those with [`ToolEpisodeStats`]; empty
/// when none has any): turns, calls by tool, malformed calls, turns without a call, tests
/// passed / run of graded episodes, sandbox and verifier wall.
pub fn step_metrics(episodes: &[composer_env::Episode]) -> Map<String, Value> {
    use composer_telemetry::keys;
    let mut out = Map::new();
    let with_stats: Vec<(usize, ToolEpisodeStats)> = episodes
        .iter()
        .filter_map(|ep| {
            let last = ep.turns.last()?;
            Some((
                ep.turns.len(),
                ToolEpisodeStats::from_observation(&last.observation)?,
            ))
        })
        .collect();
    if with_stats.is_empty() {
        return out;
    }
    let mut by_tool: BTreeMap<String, u64> = BTreeMap::new();
    for (_, s) in &with_stats {
        for (k, v) in &s.tool_calls {
            *by_tool.entry(k.clone()).or_default() += v;
        }
    }
    out.insert(
        keys::ENV_TURNS.into(),
        Value::Array(with_stats.iter().map(|(t, _)| json!(t)).collect()),
    );
    out.insert(keys::ENV_TOOL_CALLS.into(), json!(by_tool));
    out.insert(
        keys::ENV_MALFORMED_CALLS.into(),
        Value::Array(
            with_stats
                .iter()
                .map(|(_, s)| json!(s.malformed_calls))
                .collect(),
        ),
    );
    out.insert(
        keys::ENV_TURNS_WITHOUT_CALL.into(),
        Value::Array(
            with_stats
                .iter()
                .map(|(_, s)| json!(s.turns_without_call))
                .collect(),
        ),
    );
    out.insert(
        keys::ENV_TESTS_PASSED.into(),
        Value::Array(
            with_stats
                .iter()
                .filter_map(|(_, s)| s.tests.map(|(p, _)| json!(p)))
                .collect(),
        ),
    );
    out.insert(
        keys::ENV_TESTS_TOTAL.into(),
        Value::Array(
            with_stats
                .iter()
                .filter_map(|(_, s)| s.tests.map(|(_, t)| json!(t)))
                .collect(),
        ),
    );
    out.insert(
        keys::ENV_SANDBOX_S.into(),
        Value::Array(with_stats.iter().map(|(_, s)| json!(s.tool_s)).collect()),
    );
    out.insert(
        keys::ENV_VERIFIER_S.into(),
        Value::Array(
            with_stats
                .iter()
                .filter_map(|(_, s)| s.verifier_s.map(|v| json!(v)))
                .collect(),
        ),
    );
    out
}

/// Env factories for `[env] kind = "openenv_tools"`: one per server URL, each making
/// [`ToolChatEnv`] sessions over [`composer_env::OpenEnvClient::tool_session`].
pub fn tool_server_factories(
    clients: Vec<(String, composer_env::OpenEnvClient)>,
    chat: Arc<ToolChat>,
) -> Vec<(String, composer_env::EnvFactory)> {
    clients
        .into_iter()
        .map(|(name, client)| {
            let chat = chat.clone();
            let factory: composer_env::EnvFactory = Arc::new(move || {
                Ok(Box::new(ToolChatEnv::new(client.tool_session(), chat.clone())) as Box<dyn Env>)
            });
            (name, factory)
        })
        .collect()
}

/// The chat format of `[env] kind = "openenv_tools"`: `[env] chat_template` (a Jinja file)
/// when set, else the checkpoint's template; an error names which one cannot render tools.
pub fn tool_chat_for(
    section: &crate::recipe::EnvSection,
    checkpoint_template: Option<&composer_model::ChatTemplate>,
) -> anyhow::Result<Arc<ToolChat>> {
    use anyhow::Context;
    let (template, origin) = match &section.chat_template {
        Some(path) => {
            let source = std::fs::read_to_string(path).with_context(|| {
                format!("key `[env] chat_template`: reading {}", path.display())
            })?;
            let eos = checkpoint_template.map(|t| t.eos_token.clone()).unwrap_or_default();
            let bos = checkpoint_template.map(|t| t.bos_token.clone()).unwrap_or_default();
            (
                composer_model::ChatTemplate {
                    source,
                    bos_token: bos,
                    eos_token: eos,
                },
                format!("key `[env] chat_template` ({})", path.display()),
            )
        }
        None => (
            checkpoint_template.cloned().context(
                "key `[env] kind = \"openenv_tools\"`: the checkpoint has no chat template; set `[env] chat_template`",
            )?,
            "the checkpoint's chat template (set `[env] chat_template` to use another)".to_string(),
        ),
    };
    Ok(Arc::new(ToolChat::new(
        template,
        section.system_prompt.clone(),
        &origin,
    )?))
}

/// A recorded teacher episode in the replay channel's trace format: prompt = the episode's
/// rendered prompt tokens, completion = everything after it (the teacher's turns and the
/// tool results between them), with the episode's loss mask (tool results 0: replay never
/// fits the environment's tokens), each position's top-1 = the recorded token with log-prob
/// 0 (a scripted or greedy teacher, certain of its tokens), reward = the episode's final
/// reward. None for an episode without a completion (failed before the first turn).
pub fn episode_trace(
    ep: &composer_env::Episode,
    teacher: &str,
    pass_reward: f64,
) -> Option<crate::replay::TeacherTrace> {
    let p = ep.prompt_len;
    if p == 0 || ep.token_ids.len() <= p {
        return None;
    }
    let completion: Vec<u32> = ep.token_ids[p..].to_vec();
    let mask: Vec<u8> = ep.loss_mask[p..].to_vec();
    Some(crate::replay::TeacherTrace {
        teacher: teacher.to_string(),
        prompt_ids: ep.token_ids[..p].to_vec(),
        topk_ids: completion.iter().map(|&id| vec![id]).collect(),
        topk_logprobs: vec![vec![0.0]; completion.len()],
        completion_ids: completion,
        reward: ep.final_reward,
        passed: ep.final_reward >= pass_reward - 1e-9,
        loss_mask: mask.contains(&0).then_some(mask),
        tokenizer: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use composer_env::{Episode, EpisodeEnd, Turn, TurnEnd};

    fn episode(stats: Option<ToolEpisodeStats>, turns: usize) -> Episode {
        let turn = |i: usize| Turn {
            model_tokens: 3 + 2 * i..4 + 2 * i,
            action_text: String::new(),
            finish_reason: TurnEnd::Stop,
            policy_version: 0,
            action: None,
            invalid_action: None,
            observation_tokens: 4 + 2 * i..5 + 2 * i,
            observation_text: String::new(),
            observation: match (&stats, i + 1 == turns) {
                (Some(s), true) => [(STATS_KEY.to_string(), json!(s))].into_iter().collect(),
                _ => Map::new(),
            },
            reward: 0.0,
            done: false,
            feedback: None,
        };
        let n = 3 + 2 * turns;
        Episode {
            token_ids: (0..n as u32).collect(),
            loss_mask: (0..n)
                .map(|i| u8::from(i >= 3 && (i - 3) % 2 == 0))
                .collect(),
            sampler_logprobs: vec![0.0; n],
            policy_versions: vec![0; n],
            prompt_len: 3,
            initial_observation: String::new(),
            initial_observation_fields: Map::new(),
            turns: (0..turns).map(turn).collect(),
            final_reward: 0.5,
            total_reward: 0.5,
            done: true,
            truncated: false,
            end: EpisodeEnd::Done,
        }
    }

    #[test]
    fn step_metrics_aggregate_the_last_turns_stats() {
        let graded = ToolEpisodeStats {
            tool_calls: [("read_file".to_string(), 2), ("submit".to_string(), 1)].into(),
            malformed_calls: 1,
            turns_without_call: 0,
            tests: Some((3, 4)),
            tool_s: 1.5,
            verifier_s: Some(1.0),
            graded_at_limit: false,
        };
        let ungraded = ToolEpisodeStats {
            tool_calls: [("read_file".to_string(), 1)].into(),
            malformed_calls: 2,
            turns_without_call: 1,
            ..Default::default()
        };
        let m = step_metrics(&[
            episode(Some(graded), 2),
            episode(Some(ungraded), 3),
            episode(None, 1),
        ]);
        use composer_telemetry::keys;
        assert_eq!(m[keys::ENV_TURNS], json!([2, 3]));
        assert_eq!(
            m[keys::ENV_TOOL_CALLS],
            json!({"read_file": 3, "submit": 1})
        );
        assert_eq!(m[keys::ENV_MALFORMED_CALLS], json!([1, 2]));
        assert_eq!(m[keys::ENV_TURNS_WITHOUT_CALL], json!([0, 1]));
        assert_eq!(m[keys::ENV_TESTS_PASSED], json!([3]));
        assert_eq!(m[keys::ENV_TESTS_TOTAL], json!([4]));
        assert_eq!(m[keys::ENV_SANDBOX_S], json!([1.5, 0.0]));
        assert_eq!(m[keys::ENV_VERIFIER_S], json!([1.0]));
        // Episodes of text-action envs carry no stats: no tool keys at all.
        assert!(step_metrics(&[episode(None, 2)]).is_empty());
    }

    #[test]
    fn teacher_episodes_become_valid_traces() {
        let ep = episode(None, 2);
        let t = episode_trace(&ep, "scripted", 1.0).unwrap();
        t.validate().unwrap();
        assert_eq!(t.prompt_ids, vec![0, 1, 2]);
        assert_eq!(t.completion_ids, vec![3, 4, 5, 6]);
        assert_eq!(t.recorded_token_logprobs(), Some(vec![0.0; 4]));
        // The tool results (observation tokens) are masked out of replay.
        assert_eq!(t.loss_mask, Some(vec![1, 0, 1, 0]));
        assert!(!t.passed && t.reward == 0.5);
        let mut empty = ep.clone();
        empty.token_ids.truncate(3);
        assert!(episode_trace(&empty, "scripted", 1.0).is_none());
    }
}
