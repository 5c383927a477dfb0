//! Built-in environments: [`CodeEnv`] (sandboxed unit-test grading) and [`EchoEnv`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::bail;
use async_trait::async_trait;
use composer_sandbox::{CodeTask, RewardMode, SandboxLimits};
use serde_json::{json, Map, Value};

use crate::env::{render_observation, Action, Env, EnvError, EnvFactory, ResetOptions, StepResult};

/// A fresh random id (episodes, server sessions).
pub(crate) fn new_episode_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// The map of a JSON object (empty for anything else).
pub(crate) fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// The echo env of openenv (`openenv init echo_env`): action `{message}`, observation
/// `{echoed_message, message_length}`, reward `0.1 * len(message)`, never done.
#[derive(Debug, Default)]
pub struct EchoEnv {
    episode_id: Option<String>,
    step_count: u64,
}

impl EchoEnv {
    /// A fresh echo env.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl Env for EchoEnv {
    async fn reset(&mut self, opts: ResetOptions) -> Result<StepResult, EnvError> {
        // Like openenv's echo env, a reset always gets a new id (caller ids are ignored there;
        // we honour them, which is what an env accepting `episode_id` does).
        self.episode_id = Some(opts.episode_id.unwrap_or_else(new_episode_id));
        self.step_count = 0;
        let observation =
            object(json!({"echoed_message": "Echo Env environment ready!", "message_length": 0}));
        let text = render_observation(&observation);
        Ok(StepResult {
            observation,
            text,
            reward: Some(0.0),
            done: false,
            feedback: None,
        })
    }

    async fn step(&mut self, action: Action) -> Result<StepResult, EnvError> {
        let message = action
            .get("message")
            .and_then(Value::as_str)
            .ok_or_else(|| EnvError::invalid_action("field `message` (string) is required"))?;
        self.step_count += 1;
        let length = message.chars().count();
        let observation = object(json!({"echoed_message": message, "message_length": length}));
        Ok(StepResult {
            text: message.to_string(),
            observation,
            reward: Some(0.1 * length as f64),
            done: false,
            feedback: None,
        })
    }

    async fn state(&mut self) -> Result<Value, EnvError> {
        Ok(json!({"episode_id": self.episode_id, "step_count": self.step_count}))
    }

    async fn close(&mut self) -> Result<(), EnvError> {
        Ok(())
    }

    fn action_schema(&self) -> Option<Value> {
        Some(json!({
            "title": "EchoAction", "type": "object", "additionalProperties": false,
            "description": "Action for the Echo environment - just a message to echo.",
            "properties": {
                "metadata": {"type": "object", "additionalProperties": true,
                    "description": "Additional metadata for the action", "title": "Metadata"},
                "message": {"type": "string", "description": "Message to echo back", "title": "Message"}
            },
            "required": ["message"]
        }))
    }

    fn observation_schema(&self) -> Value {
        json!({
            "title": "EchoObservation", "type": "object", "additionalProperties": false,
            "properties": {
                "done": {"type": "boolean", "default": false},
                "reward": {"anyOf": [{"type": "boolean"}, {"type": "integer"}, {"type": "number"}, {"type": "null"}], "default": null},
                "metadata": {"type": "object", "additionalProperties": true},
                "echoed_message": {"type": "string", "description": "The echoed message"},
                "message_length": {"type": "integer", "default": 0, "description": "Length of the echoed message"}
            },
            "required": ["echoed_message"]
        })
    }

    fn metadata(&self) -> Value {
        json!({"name": "EchoEnvironment", "description": "EchoEnvironment environment",
            "readme_content": null, "version": "1.0.0", "author": null, "documentation_url": null})
    }
}

/// How [`CodeEnv::reset`] picks a task when the reset names none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TaskSelection {
    /// `seed % n_tasks` when a seed is given, else uniformly at random.
    #[default]
    SeedOrRandom,
    /// `seed % n_tasks` when a seed is given, else the next task in order (shared counter).
    SeedOrRoundRobin,
}

/// Configuration of [`CodeEnv`].
#[derive(Debug, Clone)]
pub struct CodeEnvConfig {
    /// The task set.
    pub tasks: Arc<Vec<CodeTask>>,
    /// Sandbox limits of each grading run.
    pub limits: SandboxLimits,
    /// How test results become a reward.
    pub reward_mode: RewardMode,
    /// Attempts per episode: the episode is done when all tests pass or after this many steps.
    pub max_attempts: u32,
    /// Task choice when the reset names no task.
    pub selection: TaskSelection,
}

impl Default for CodeEnvConfig {
    fn default() -> Self {
        CodeEnvConfig {
            tasks: Arc::new(composer_sandbox::builtin_tasks()),
            limits: SandboxLimits::default(),
            reward_mode: RewardMode::FractionPassed,
            max_attempts: 1,
            selection: TaskSelection::SeedOrRandom,
        }
    }
}

/// A code-writing env: reset shows a task prompt; a step with `{"code": "..."}` (or
/// `{"message": "..."}`: model text from which the code is extracted) runs the task's unit tests
/// in the sandbox; reward per [`RewardMode`], feedback = the failing test's output.
pub struct CodeEnv {
    config: CodeEnvConfig,
    round_robin: Arc<AtomicU64>,
    task: Option<CodeTask>,
    episode_id: Option<String>,
    step_count: u64,
    last_reward: Option<f64>,
}

impl CodeEnv {
    /// A code env over `config.tasks` (must be non-empty).
    pub fn new(config: CodeEnvConfig) -> anyhow::Result<Self> {
        Self::with_counter(config, Arc::new(AtomicU64::new(0)))
    }

    fn with_counter(config: CodeEnvConfig, round_robin: Arc<AtomicU64>) -> anyhow::Result<Self> {
        if config.tasks.is_empty() {
            bail!("CodeEnv: the task set is empty");
        }
        if config.max_attempts == 0 {
            bail!("CodeEnv: max_attempts must be at least 1");
        }
        Ok(CodeEnv {
            config,
            round_robin,
            task: None,
            episode_id: None,
            step_count: 0,
            last_reward: None,
        })
    }

    /// A factory of code envs sharing `config` (and one round-robin counter).
    pub fn factory(config: CodeEnvConfig) -> anyhow::Result<EnvFactory> {
        if config.tasks.is_empty() {
            bail!("CodeEnv: the task set is empty");
        }
        let counter = Arc::new(AtomicU64::new(0));
        Ok(Arc::new(move || {
            Ok(Box::new(CodeEnv::with_counter(config.clone(), counter.clone())?) as Box<dyn Env>)
        }))
    }

    /// The current task, after a reset.
    pub fn task(&self) -> Option<&CodeTask> {
        self.task.as_ref()
    }
}

#[async_trait]
impl Env for CodeEnv {
    async fn reset(&mut self, opts: ResetOptions) -> Result<StepResult, EnvError> {
        let tasks = &self.config.tasks;
        let index = if let Some(id) = &opts.task_id {
            tasks
                .iter()
                .position(|t| &t.id == id)
                .ok_or_else(|| EnvError::Server {
                    code: "EXECUTION_ERROR".into(),
                    message: format!("unknown task_id `{id}` ({} tasks)", tasks.len()),
                })?
        } else if let Some(seed) = opts.seed {
            (seed % tasks.len() as u64) as usize
        } else {
            match self.config.selection {
                TaskSelection::SeedOrRandom => rand::random_range(0..tasks.len()),
                TaskSelection::SeedOrRoundRobin => {
                    (self.round_robin.fetch_add(1, Ordering::Relaxed) % tasks.len() as u64) as usize
                }
            }
        };
        let task = tasks[index].clone();
        self.episode_id = Some(opts.episode_id.unwrap_or_else(new_episode_id));
        self.step_count = 0;
        self.last_reward = None;
        let observation = object(json!({
            "prompt": task.prompt,
            "task_id": task.id,
            "entry_point": task.entry_point,
        }));
        self.task = Some(task);
        Ok(StepResult {
            text: render_observation(&observation),
            observation,
            reward: None,
            done: false,
            feedback: None,
        })
    }

    async fn step(&mut self, action: Action) -> Result<StepResult, EnvError> {
        let Some(task) = self.task.clone() else {
            return Err(EnvError::NoSession(
                "CodeEnv: call reset before step".into(),
            ));
        };
        let text = ["code", "message"]
            .iter()
            .find_map(|k| action.get(*k).and_then(Value::as_str))
            .ok_or_else(|| {
                EnvError::invalid_action("CodeEnv: the action needs a string field `code`")
            })?;
        let code = composer_sandbox::extract_code(text);
        let limits = self.config.limits.clone();
        let mode = self.config.reward_mode;
        let report = tokio::task::spawn_blocking(move || {
            composer_sandbox::grade(&code, &task, &limits, mode)
        })
        .await
        .map_err(|e| EnvError::Server {
            code: "EXECUTION_ERROR".into(),
            message: format!("grading task panicked: {e}"),
        })?;
        self.step_count += 1;
        self.last_reward = Some(report.reward);
        let done = report.all_passed || self.step_count >= u64::from(self.config.max_attempts);
        // Before another attempt the model sees the attempt's feedback without the failing
        // test's source (its expected values could be hard-coded next); the full report is the
        // step's `feedback`, read after the episode (the hint channel's teacher). A remote
        // client renders the observation's `feedback`, so it carries the shown form too.
        let shown = if done {
            report.feedback.clone()
        } else {
            report.attempt_feedback.clone()
        };
        let observation = object(json!({
            "feedback": shown,
            "passed": report.passed,
            "total": report.total,
            "all_passed": report.all_passed,
            "outcome": format!("{:?}", report.outcome),
            "wall_s": report.wall_s,
        }));
        Ok(StepResult {
            text: shown,
            feedback: Some(report.feedback),
            observation,
            reward: Some(report.reward),
            done,
        })
    }

    async fn state(&mut self) -> Result<Value, EnvError> {
        Ok(json!({
            "episode_id": self.episode_id,
            "step_count": self.step_count,
            "task_id": self.task.as_ref().map(|t| t.id.clone()),
            "last_reward": self.last_reward,
        }))
    }

    async fn close(&mut self) -> Result<(), EnvError> {
        Ok(())
    }

    fn action_schema(&self) -> Option<Value> {
        Some(json!({
            "title": "CodeAction", "type": "object", "additionalProperties": false,
            "description": "Python code defining the task's entry point (a fenced block is extracted).",
            "properties": {
                "metadata": {"type": "object", "additionalProperties": true},
                "code": {"type": "string", "description": "The solution (or model text containing it)", "title": "Code"}
            },
            "required": ["code"]
        }))
    }

    fn observation_schema(&self) -> Value {
        json!({
            "title": "CodeObservation", "type": "object",
            "properties": {
                "prompt": {"type": "string"}, "task_id": {"type": "string"},
                "entry_point": {"type": "string"}, "feedback": {"type": "string"},
                "passed": {"type": "integer"}, "total": {"type": "integer"},
                "all_passed": {"type": "boolean"}, "outcome": {"type": "string"},
                "wall_s": {"type": "number"}
            }
        })
    }

    fn metadata(&self) -> Value {
        json!({"name": "CodeEnvironment",
            "description": format!("Sandboxed Python code tasks graded by unit tests ({} tasks)", self.config.tasks.len()),
            "readme_content": null, "version": env!("CARGO_PKG_VERSION"), "author": null, "documentation_url": null})
    }
}

/// The factory of a built-in env by name: `code` (built-in code tasks) or `echo`.
pub fn builtin_env_factory(name: &str) -> anyhow::Result<EnvFactory> {
    match name {
        "code" => CodeEnv::factory(CodeEnvConfig::default()),
        "echo" => Ok(Arc::new(|| Ok(Box::new(EchoEnv::new()) as Box<dyn Env>))),
        other => bail!("unknown built-in env `{other}` (known: code, echo)"),
    }
}
