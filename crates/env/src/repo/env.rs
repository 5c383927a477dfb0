//! [`RepoEnv`]: repository tasks as an [`Env`] with MCP tools, what `composer-rl serve-env
//! repo` serves (REPO_ENV.md): `reset` starts a [`RepoEpisode`] of a task, steps are
//! `{"type":"list_tools"}` and `{"type":"call_tool","tool_name","arguments"}`, and `submit`
//! ends the episode with the graded reward.

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{json, Map, Value};

use super::task::{load_tasks, RepoTask};
use super::tools::{
    require_private_root, tool_specs, EpisodeBudget, RepoEpisode, ToolError, ToolErrorKind,
    ToolOutput,
};
use super::{pick_task, RepoGrade};
use crate::builtin::{new_episode_id, object};
use crate::env::{
    render_observation, Action, Env, EnvError, EnvFactory, ResetOptions, StepResult,
    STEP_TIME_LIMIT_KEY,
};

/// A tool call (or grading) running on a blocking thread, which owns the episode meanwhile;
/// it hands the episode back with the call's output (`None` for grading).
type InFlight = tokio::task::JoinHandle<(RepoEpisode, Option<Result<ToolOutput, ToolError>>)>;

/// One session's env over a shared task set: at most one [`RepoEpisode`] at a time.
pub struct RepoEnv {
    tasks: Arc<Vec<RepoTask>>,
    budget: EpisodeBudget,
    episode: Option<RepoEpisode>,
    /// The call whose caller stopped waiting (a step timeout, a client gone mid-request): the
    /// episode comes back from it before anything else touches the env, so a step that
    /// outlasts its caller's timeout does not lose the episode (and its grade).
    in_flight: Option<InFlight>,
    episode_id: Option<String>,
    step_count: u64,
}

/// The tools as `{name, description, input_schema}` objects.
fn tool_list() -> Vec<Value> {
    tool_specs()
        .into_iter()
        .map(|t| json!({"name": t.name, "description": t.description, "input_schema": t.input_schema}))
        .collect()
}

/// An MCP `CallToolResult` holding `text`.
fn call_tool_result(text: &str, is_error: bool) -> Value {
    json!({
        "content": [{"type": "text", "text": text}],
        "structured_content": {"result": text},
        "data": text,
        "is_error": is_error,
    })
}

fn grade_json(g: &RepoGrade) -> Value {
    json!({
        "passed": g.passed,
        "total": g.total,
        "reward": g.reward,
        "failed": g.failed.iter().map(|(name, error)| json!({"test": name, "error": error})).collect::<Vec<_>>(),
        "error": g.error,
    })
}

/// Most bytes of an agent's input (as JSON) a reply repeats.
const MAX_ECHO_BYTES: usize = 1024;

/// `input` for an error reply: as is when small, else the start of its JSON text with a note,
/// so a reply never grows with (or amplifies, through escapes) what the agent sent.
fn echo(input: &Value) -> Value {
    let text = input.to_string();
    if text.len() <= MAX_ECHO_BYTES {
        return input.clone();
    }
    let mut end = MAX_ECHO_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    json!(format!("{}... ({} bytes)", &text[..end], text.len()))
}

fn invalid(loc: &str, msg: String, input: &Value) -> EnvError {
    EnvError::InvalidAction {
        errors: json!([{"type": "value_error", "loc": [loc], "msg": msg, "input": echo(input)}]),
        message: msg,
    }
}

impl RepoEnv {
    /// A factory of envs over the tasks in `tasks_dir` (loaded once, here: a bad task
    /// directory is an error now, naming the task at fault; so is a sandbox without a
    /// private root, see [`require_private_root`]).
    pub fn factory(tasks_dir: &Path, budget: EpisodeBudget) -> anyhow::Result<EnvFactory> {
        let tasks = load_tasks(tasks_dir)?;
        anyhow::ensure!(
            !tasks.is_empty(),
            "no tasks in {} (expected <id>/task.toml directories)",
            tasks_dir.display()
        );
        require_private_root(&tasks[0].hidden_tests_dir())?;
        let tasks = Arc::new(tasks);
        Ok(Arc::new(move || {
            Ok(Box::new(RepoEnv {
                tasks: Arc::clone(&tasks),
                budget: budget.clone(),
                episode: None,
                in_flight: None,
                episode_id: None,
                step_count: 0,
            }) as Box<dyn Env>)
        }))
    }

    fn reward(&self) -> f64 {
        self.episode
            .as_ref()
            .and_then(|e| e.grade())
            .map_or(0.0, |g| g.reward)
    }

    fn result(&self, observation: Value, done: bool) -> StepResult {
        let observation = object(observation);
        StepResult {
            text: render_observation(&observation),
            feedback: None,
            reward: Some(self.reward()),
            done,
            observation,
        }
    }

    /// The observation of one tool call: `{tool_name, result, error, metadata}`.
    fn tool_observation(&self, name: &str, out: Result<ToolOutput, ToolError>) -> StepResult {
        let mut metadata = json!({"turns": self.episode.as_ref().map_or(0, |e| e.turns())});
        let (text, error) = match &out {
            Ok(o) => (o.text.clone(), Value::Null),
            Err(e) => (
                format!("error ({}): {}", kind_name(e.error_type), e.message),
                json!({"error_type": kind_name(e.error_type), "message": e.message}),
            ),
        };
        if let Ok(ToolOutput { grade: Some(g), .. }) = &out {
            metadata["grade"] = grade_json(g);
        }
        let done = self.episode.as_ref().is_some_and(RepoEpisode::done);
        let mut r = self.result(
            json!({
                "tool_name": echo(&json!(name)),
                "result": call_tool_result(&text, out.is_err()),
                "error": error,
                "metadata": metadata,
            }),
            done,
        );
        r.text = text;
        if let Ok(ToolOutput { grade: Some(g), .. }) = &out {
            r.feedback = Some(g.feedback());
        }
        r
    }

    /// Runs `work` on the episode on a blocking thread (tools run commands and grading, for
    /// seconds) and gives the episode back. Cancel-safe: if this future is dropped, the
    /// running call is kept in `in_flight` and [`RepoEnv::settle`] takes the episode back.
    async fn on_episode(
        &mut self,
        work: impl FnOnce(&mut RepoEpisode) -> Option<Result<ToolOutput, ToolError>> + Send + 'static,
    ) -> Result<Option<Result<ToolOutput, ToolError>>, String> {
        self.settle().await;
        let Some(mut episode) = self.episode.take() else {
            return Err("no episode: send reset first".into());
        };
        let handle = self.in_flight.insert(tokio::task::spawn_blocking(move || {
            let out = work(&mut episode);
            (episode, out)
        }));
        let joined = handle.await;
        self.in_flight = None;
        match joined {
            Ok((episode, out)) => {
                self.episode = Some(episode);
                Ok(out)
            }
            Err(e) => Err(format!(
                "the tool call failed: {e}; the episode is lost, reset"
            )),
        }
    }

    /// Takes back the episode of a call whose caller stopped waiting (waits for it to end).
    async fn settle(&mut self) {
        if let Some(handle) = self.in_flight.as_mut() {
            let joined = handle.await;
            self.in_flight = None;
            if let Ok((episode, _)) = joined {
                self.episode = Some(episode);
            }
        }
    }

    async fn call_tool(&mut self, name: &str, arguments: Value) -> StepResult {
        let tool = name.to_string();
        let out = self
            .on_episode(move |episode| Some(episode.call_tool(&tool, &arguments)))
            .await;
        let out = out
            .and_then(|o| o.ok_or_else(|| "the tool call gave no output".to_string()))
            .unwrap_or_else(|message| {
                Err(ToolError {
                    error_type: ToolErrorKind::ExecutionError,
                    message,
                })
            });
        self.tool_observation(name, out)
    }

    /// Ends the current episode (its sandbox is removed off the async workers).
    async fn end_episode(&mut self) {
        self.settle().await;
        if let Some(ep) = self.episode.take() {
            let _ = tokio::task::spawn_blocking(move || drop(ep)).await;
        }
    }
}

fn kind_name(k: ToolErrorKind) -> &'static str {
    match k {
        ToolErrorKind::ToolNotFound => "tool_not_found",
        ToolErrorKind::InvalidArgs => "invalid_args",
        ToolErrorKind::ExecutionError => "execution_error",
        ToolErrorKind::Timeout => "timeout",
    }
}

#[async_trait]
impl Env for RepoEnv {
    async fn reset(&mut self, opts: ResetOptions) -> Result<StepResult, EnvError> {
        let task = pick_task(&self.tasks, opts.task_id.as_deref(), opts.seed)
            .map_err(|e| invalid("task_id", e.to_string(), &json!(opts.task_id)))?
            .clone();
        self.end_episode().await;
        let budget = self.budget.clone();
        let started = tokio::task::spawn_blocking(move || RepoEpisode::new(&task, budget))
            .await
            .map_err(|e| EnvError::Server {
                code: "EXECUTION_ERROR".into(),
                message: format!("starting the episode panicked: {e}"),
            })?
            .map_err(|e| EnvError::Server {
                code: "EXECUTION_ERROR".into(),
                message: format!("starting the episode: {e:#}"),
            })?;
        let spec = &started.task().spec;
        let observation = json!({
            "task_id": spec.id,
            "title": spec.title,
            "statement": spec.statement,
            "prompt": spec.statement,
            "visible_test_command": spec.visible_test_command,
            "max_turns": spec.limits.max_turns,
            "metadata": {"task_id": spec.id, "statement": spec.statement},
        });
        self.episode = Some(started);
        self.episode_id = Some(opts.episode_id.unwrap_or_else(new_episode_id));
        self.step_count = 0;
        Ok(self.result(observation, false))
    }

    async fn step(&mut self, action: Action) -> Result<StepResult, EnvError> {
        self.settle().await;
        let kind = action.get("type").and_then(Value::as_str).unwrap_or("");
        let r = match kind {
            "list_tools" => {
                let done = self.episode.as_ref().is_some_and(RepoEpisode::done);
                self.result(json!({"tools": tool_list()}), done)
            }
            "call_tool" => {
                let Some(name) = action.get("tool_name").and_then(Value::as_str) else {
                    return Err(invalid(
                        "tool_name",
                        "call_tool needs a string `tool_name`".into(),
                        &action,
                    ));
                };
                let arguments = match action.get("arguments") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(a @ Value::Object(_)) => a.clone(),
                    Some(other) => {
                        return Err(invalid(
                            "arguments",
                            "`arguments` must be a JSON object".into(),
                            other,
                        ))
                    }
                };
                self.call_tool(name, arguments).await
            }
            _ => {
                return Err(invalid(
                    "type",
                    "the action `type` must be \"list_tools\" or \"call_tool\"".into(),
                    &action,
                ))
            }
        };
        self.step_count += 1;
        Ok(r)
    }

    async fn state(&mut self) -> Result<Value, EnvError> {
        self.settle().await;
        let ep = self.episode.as_ref();
        Ok(json!({
            "episode_id": self.episode_id,
            "step_count": self.step_count,
            "task_id": ep.map(|e| e.task().id().to_string()),
            "turns": ep.map_or(0, |e| e.turns()),
            "done": ep.is_some_and(RepoEpisode::done),
            "reward": ep.and_then(|e| e.grade()).map(|g| g.reward),
        }))
    }

    /// An episode the trainer cut short (its turn limit or token budget, before `submit`) is
    /// graded now, as `submit` would grade it (REPO_ENV.md: an episode ends at submit, a turn
    /// limit or a token budget, and is graded); the grade is not counted as a tool call.
    /// `None` without an episode; an episode that already ended gives its grade again.
    async fn end_truncated(&mut self) -> Result<Option<StepResult>, EnvError> {
        self.settle().await;
        if self.episode.is_none() {
            return Ok(None);
        }
        // Grading runs the hidden tests (seconds): off the async workers.
        let graded = self
            .on_episode(|episode| {
                episode.finish();
                None
            })
            .await;
        if let Err(message) = graded {
            return Err(EnvError::Server {
                code: "EXECUTION_ERROR".into(),
                message: format!("grading the cut-short episode: {message}"),
            });
        }
        let Some(grade) = self.episode.as_ref().and_then(|e| e.grade()).cloned() else {
            return Ok(None);
        };
        let mut r = self.result(
            json!({"metadata": {"grade": grade_json(&grade), "truncated": true}}),
            true,
        );
        r.text = format!("episode cut short: {}", grade.feedback());
        r.feedback = Some(grade.feedback());
        Ok(Some(r))
    }

    async fn close(&mut self) -> Result<(), EnvError> {
        self.end_episode().await;
        Ok(())
    }

    fn action_schema(&self) -> Option<Value> {
        Some(json!({
            "type": "object",
            "title": "RepoAction",
            "properties": {
                "type": {"enum": ["list_tools", "call_tool"]},
                "tool_name": {"type": "string"},
                "arguments": {"type": "object"},
                "metadata": {"type": "object"},
            },
            "required": ["type"],
            "additionalProperties": false,
        }))
    }

    fn mcp_tools(&self) -> Option<Vec<Value>> {
        Some(tool_list())
    }

    fn metadata(&self) -> Value {
        json!({"name": "RepoEnv", "description": "Repository feature-deletion tasks: restore the deleted code with tools; hidden tests grade it (REPO_ENV.md)",
            "readme_content": null, "version": "1.0.0", "author": null, "documentation_url": null,
            STEP_TIME_LIMIT_KEY: step_time_limit_s(&self.tasks)})
    }
}

/// Slack on top of a step's command and grading time (process start, copying the working copy).
const STEP_SLACK_S: u64 = 5;

/// The longest step over `tasks`: a command to its timeout, then the grading when that command
/// ends the episode (its turn or command budget spent).
fn step_time_limit_s(tasks: &[RepoTask]) -> u64 {
    tasks
        .iter()
        .map(|t| t.spec.limits.shell_timeout_s + t.spec.limits.grade_timeout_s)
        .max()
        .unwrap_or(0)
        + STEP_SLACK_S
}
