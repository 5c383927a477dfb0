//! The agent's tools over a sandboxed working copy, and the episode that owns it.

use std::time::Duration;

use composer_sandbox::{sandbox_capabilities, Outcome, Sandbox, SandboxLimits};
use serde::Serialize;
use serde_json::{json, Value};

use super::grade::{grade_working_copy, walk_files, RepoGrade};
use super::task::RepoTask;

/// Refuses repository tasks on a host whose sandbox has no private root: the task's files
/// (hidden tests included) are on this host's disk, and without a private root an agent
/// command, whatever its uid, could read world-readable paths such as `hidden_tests` by
/// absolute path. `hidden_tests` names the directory at risk in the error.
pub fn require_private_root(hidden_tests: &std::path::Path) -> anyhow::Result<()> {
    let caps = sandbox_capabilities();
    anyhow::ensure!(
        caps.private_root,
        "repository tasks need the sandbox capability `private_root` (user + mount \
         namespaces), which this host lacks, so agent commands could read the hidden tests \
         at {}; sandbox notes: {:?}",
        hidden_tests.display(),
        caps.notes
    );
    Ok(())
}

/// Longest text a tool returns before it is cut (with a note).
const MAX_TOOL_OUTPUT: usize = 16 << 10;

/// Longest path a tool takes (Linux's `PATH_MAX`); longer ones are refused up front, so no
/// later message repeats a huge path.
const MAX_PATH_BYTES: usize = 4096;

/// Most characters of an agent-supplied string (a path, a tool or argument name) an error
/// message repeats.
const MAX_SHOWN_CHARS: usize = 120;

/// `s` for an error message: `{:?}`-quoted and cut to [`MAX_SHOWN_CHARS`] characters, so a
/// reply never grows with (or amplifies, through escapes) the agent's input.
pub(crate) fn shown(s: &str) -> String {
    let n = s.chars().count();
    if n <= MAX_SHOWN_CHARS {
        return format!("{s:?}");
    }
    let head: String = s.chars().take(MAX_SHOWN_CHARS).collect();
    format!("{head:?}... ({n} characters)")
}

/// A tool's name, description and JSON schema of its arguments (MCP `inputSchema`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolSpec {
    /// Tool name.
    pub name: &'static str,
    /// What it does.
    pub description: &'static str,
    /// JSON schema of the arguments object.
    pub input_schema: Value,
}

/// The error classes of a failed tool call (REPO_ENV.md `error_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolErrorKind {
    /// No tool of that name.
    ToolNotFound,
    /// Missing or ill-typed arguments, bad paths.
    InvalidArgs,
    /// The tool ran and failed (missing file, 0 or 2+ matches, episode over...).
    ExecutionError,
    /// The command ran past its time limit.
    Timeout,
}

/// A failed tool call: an observation for the agent, never the end of the episode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolError {
    /// Its class.
    pub error_type: ToolErrorKind,
    /// What went wrong.
    pub message: String,
}

/// A successful tool call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolOutput {
    /// The text result.
    pub text: String,
    /// Whether the episode is over (after `submit`, or the turn limit).
    pub done: bool,
    /// The grade, once the episode is over.
    pub grade: Option<RepoGrade>,
}

fn err(error_type: ToolErrorKind, message: impl Into<String>) -> ToolError {
    ToolError {
        error_type,
        message: message.into(),
    }
}

/// The seven tools of REPO_ENV.md with their argument schemas.
pub fn tool_specs() -> Vec<ToolSpec> {
    let path = json!({"type": "string", "description": "path relative to the repository root"});
    vec![
        ToolSpec { name: "list_files", description: "List every file under `path` (default \".\"), recursively, one repo-relative path per line.",
            input_schema: json!({"type": "object", "properties": {"path": path}, "additionalProperties": false}) },
        ToolSpec { name: "read_file", description: "Read a text file, or the 1-based inclusive line range start_line..end_line.",
            input_schema: json!({"type": "object", "properties": {"path": path, "start_line": {"type": "integer", "minimum": 1}, "end_line": {"type": "integer", "minimum": 1}}, "required": ["path"], "additionalProperties": false}) },
        ToolSpec { name: "write_file", description: "Create or overwrite a file with `content`.",
            input_schema: json!({"type": "object", "properties": {"path": path, "content": {"type": "string"}}, "required": ["path", "content"], "additionalProperties": false}) },
        ToolSpec { name: "replace_in_file", description: "Replace the single occurrence of old_str with new_str; 0 or several occurrences is an error.",
            input_schema: json!({"type": "object", "properties": {"path": path, "old_str": {"type": "string"}, "new_str": {"type": "string"}}, "required": ["path", "old_str", "new_str"], "additionalProperties": false}) },
        ToolSpec { name: "run_shell", description: "Run a shell command at the repository root in the sandbox; returns the exit code and output (truncated with a note).",
            input_schema: json!({"type": "object", "properties": {"command": {"type": "string"}, "timeout_s": {"type": "number", "exclusiveMinimum": 0}}, "required": ["command"], "additionalProperties": false}) },
        ToolSpec { name: "run_tests", description: "Run the visible tests; returns the exit code and output.",
            input_schema: json!({"type": "object", "properties": {}, "additionalProperties": false}) },
        ToolSpec { name: "submit", description: "End the episode and grade the working copy against the hidden tests.",
            input_schema: json!({"type": "object", "properties": {}, "additionalProperties": false}) },
    ]
}

/// Checks a tool path: relative, no `..`, no NUL, not empty. `.` is the root.
pub fn check_path(p: &str) -> Result<String, ToolError> {
    let bad = |why: &str| {
        Err(err(
            ToolErrorKind::InvalidArgs,
            format!("path {}: {why}", shown(p)),
        ))
    };
    if p.len() > MAX_PATH_BYTES {
        return bad(&format!("longer than {MAX_PATH_BYTES} bytes"));
    }
    if p.contains('\0') || p.contains('\\') {
        return bad("invalid characters");
    }
    if p.starts_with('/') {
        return bad("absolute paths are not allowed; use a path relative to the repository root");
    }
    let parts: Vec<&str> = p
        .split('/')
        .filter(|s| !s.is_empty() && *s != ".")
        .collect();
    if parts.contains(&"..") {
        return bad("`..` is not allowed");
    }
    Ok(parts.join("/"))
}

/// Cuts `text` to [`MAX_TOOL_OUTPUT`] bytes with a note.
fn cut(text: &str) -> String {
    if text.len() <= MAX_TOOL_OUTPUT {
        return text.to_string();
    }
    let mut end = MAX_TOOL_OUTPUT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}\n[output truncated: {} of {} bytes shown]",
        &text[..end],
        end,
        text.len()
    )
}

/// Episode budgets beyond the task's `max_turns`.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeBudget {
    /// Total seconds of `run_shell` / `run_tests` time; when spent, the episode ends (graded).
    pub command_seconds: f64,
}

impl Default for EpisodeBudget {
    fn default() -> Self {
        EpisodeBudget {
            command_seconds: 600.0,
        }
    }
}

/// One episode of a repository task: a sandbox holding the working copy (`repo/` +
/// `visible_tests/`; never `hidden_tests/`), the tools, and grading at the end. A server
/// wraps it with [`tool_specs`] and [`RepoEpisode::call_tool`].
pub struct RepoEpisode {
    task: RepoTask,
    sandbox: Sandbox,
    turns: u32,
    command_seconds: f64,
    budget: EpisodeBudget,
    grade: Option<RepoGrade>,
}

impl RepoEpisode {
    /// Starts an episode of `task` in a fresh sandbox.
    /// Errs when the sandbox has no private root ([`require_private_root`]).
    pub fn new(task: &RepoTask, budget: EpisodeBudget) -> anyhow::Result<RepoEpisode> {
        require_private_root(&task.hidden_tests_dir())?;
        let limits = SandboxLimits {
            wall_time: Duration::from_secs(task.spec.limits.shell_timeout_s),
            cpu_time_s: task.spec.limits.shell_timeout_s,
            max_output_bytes: 64 << 10,
            ..SandboxLimits::default()
        };
        let sandbox = Sandbox::new(limits)?;
        sandbox.copy_tree_from(&task.repo_dir(), "")?;
        sandbox.copy_tree_from(&task.visible_tests_dir(), "visible_tests")?;
        Ok(RepoEpisode {
            task: task.clone(),
            sandbox,
            turns: 0,
            command_seconds: 0.0,
            budget,
            grade: None,
        })
    }

    /// The task.
    pub fn task(&self) -> &RepoTask {
        &self.task
    }
    /// Tool calls made so far.
    pub fn turns(&self) -> u32 {
        self.turns
    }
    /// Whether the episode is over.
    pub fn done(&self) -> bool {
        self.grade.is_some()
    }
    /// The grade once the episode is over.
    pub fn grade(&self) -> Option<&RepoGrade> {
        self.grade.as_ref()
    }

    /// Calls tool `name` with `arguments` (a JSON object). A bad call is a [`ToolError`] and
    /// the episode goes on; the call that reaches the turn limit or the command budget also
    /// ends the episode and grades it (`done` with the grade in the output or error message).
    pub fn call_tool(&mut self, name: &str, arguments: &Value) -> Result<ToolOutput, ToolError> {
        if self.grade.is_some() {
            return Err(err(ToolErrorKind::ExecutionError, "the episode is over"));
        }
        self.turns += 1;
        let result = self.dispatch(name, arguments);
        let over_budget = self.command_seconds >= self.budget.command_seconds;
        match result {
            Ok(out) if out.done => Ok(out),
            _ if self.turns >= self.task.spec.limits.max_turns || over_budget => {
                let why = if over_budget {
                    "command-time budget"
                } else {
                    "turn limit"
                };
                let grade = self.finish();
                let text = match &result {
                    Ok(o) => o.text.clone(),
                    Err(e) => format!("error ({:?}): {}", e.error_type, e.message),
                };
                Ok(ToolOutput {
                    text: format!(
                        "{text}\n\nepisode over ({why} reached): {}",
                        grade.feedback()
                    ),
                    done: true,
                    grade: Some(grade),
                })
            }
            other => other,
        }
    }

    /// Ends the episode now and grades the working copy (idempotent).
    pub fn finish(&mut self) -> RepoGrade {
        if let Some(g) = &self.grade {
            return g.clone();
        }
        let g = grade_working_copy(&self.task, self.sandbox.host_workdir());
        self.grade = Some(g.clone());
        g
    }

    fn dispatch(&mut self, name: &str, a: &Value) -> Result<ToolOutput, ToolError> {
        let allowed: &[&str] = match name {
            "list_files" => &["path"],
            "read_file" => &["path", "start_line", "end_line"],
            "write_file" => &["path", "content"],
            "replace_in_file" => &["path", "old_str", "new_str"],
            "run_shell" => &["command", "timeout_s"],
            "run_tests" | "submit" => &[],
            _ => {
                let names: Vec<&str> = tool_specs().iter().map(|t| t.name).collect();
                return Err(err(
                    ToolErrorKind::ToolNotFound,
                    format!("no tool {}; tools: {}", shown(name), names.join(", ")),
                ));
            }
        };
        let obj = match a {
            Value::Object(m) => m.clone(),
            Value::Null => Default::default(),
            _ => {
                return Err(err(
                    ToolErrorKind::InvalidArgs,
                    "arguments must be a JSON object",
                ))
            }
        };
        if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(err(
                ToolErrorKind::InvalidArgs,
                format!("{name}: unknown argument {}", shown(k)),
            ));
        }
        let text = match name {
            "list_files" => self.list_files(opt_str(&obj, "path")?.unwrap_or("."))?,
            "read_file" => self.read_file(
                req_str(&obj, "path")?,
                opt_line(&obj, "start_line")?,
                opt_line(&obj, "end_line")?,
            )?,
            "write_file" => {
                let p = check_path(req_str(&obj, "path")?)?;
                let content = req_str(&obj, "content")?;
                self.write(&p, content)?;
                format!("wrote {} bytes to {p}", content.len())
            }
            "replace_in_file" => self.replace(
                req_str(&obj, "path")?,
                req_str(&obj, "old_str")?,
                req_str(&obj, "new_str")?,
            )?,
            "run_shell" => {
                let t = match obj.get("timeout_s") {
                    None | Some(Value::Null) => None,
                    Some(v) => match v.as_f64() {
                        Some(t) if t > 0.0 && t.is_finite() => Some(t),
                        _ => {
                            return Err(err(
                                ToolErrorKind::InvalidArgs,
                                "timeout_s must be a positive number",
                            ))
                        }
                    },
                };
                self.shell(req_str(&obj, "command")?, t)?
            }
            "run_tests" => self.shell(&self.task.spec.visible_test_command.clone(), None)?,
            _ => {
                let g = self.finish();
                return Ok(ToolOutput {
                    text: g.feedback(),
                    done: true,
                    grade: Some(g),
                });
            }
        };
        Ok(ToolOutput {
            text,
            done: false,
            grade: None,
        })
    }

    fn list_files(&self, path: &str) -> Result<String, ToolError> {
        let p = check_path(path)?;
        let root = self.sandbox.host_workdir();
        let files =
            walk_files(root).map_err(|e| err(ToolErrorKind::ExecutionError, format!("{e:#}")))?;
        let prefix = format!("{p}/");
        let hits: Vec<&String> = files
            .iter()
            .filter(|f| p.is_empty() || **f == p || f.starts_with(&prefix))
            .collect();
        if hits.is_empty() {
            return Err(err(
                ToolErrorKind::ExecutionError,
                format!("no files under {}", shown(path)),
            ));
        }
        Ok(cut(&hits
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")))
    }

    fn read_text(&self, p: &str) -> Result<String, ToolError> {
        let bytes = self.sandbox.read_file(p).map_err(|e| fs_error(p, &e))?;
        String::from_utf8(bytes).map_err(|_| {
            err(
                ToolErrorKind::ExecutionError,
                format!("{p}: not UTF-8 text"),
            )
        })
    }

    /// Writes a file of the working copy. Held to the file size the sandbox allows commands
    /// (RLIMIT_FSIZE): this write runs on the trusted side, where no rlimit applies.
    fn write(&self, p: &str, content: &str) -> Result<(), ToolError> {
        if p.is_empty() {
            return Err(err(ToolErrorKind::InvalidArgs, "path is empty"));
        }
        let max = self.sandbox.limits().max_file_bytes;
        if content.len() as u64 > max {
            return Err(err(
                ToolErrorKind::InvalidArgs,
                format!(
                    "{p}: the new content is {} bytes, over the {max}-byte file size limit",
                    content.len()
                ),
            ));
        }
        self.sandbox
            .write_file(p, content.as_bytes())
            .map_err(|e| fs_error(p, &e))
    }

    fn read_file(
        &self,
        path: &str,
        start: Option<usize>,
        end: Option<usize>,
    ) -> Result<String, ToolError> {
        let p = check_path(path)?;
        let text = self.read_text(&p)?;
        if start.is_none() && end.is_none() {
            return Ok(cut(&text));
        }
        let lines: Vec<&str> = text.lines().collect();
        let s = start.unwrap_or(1);
        let e = end.unwrap_or(lines.len()).min(lines.len());
        if s > e || s > lines.len() {
            return Err(err(
                ToolErrorKind::InvalidArgs,
                format!(
                    "line range {s}..{e} is outside the file ({} lines)",
                    lines.len()
                ),
            ));
        }
        Ok(cut(&lines[s - 1..e].join("\n")))
    }

    fn replace(&self, path: &str, old: &str, new: &str) -> Result<String, ToolError> {
        let p = check_path(path)?;
        if old.is_empty() {
            return Err(err(ToolErrorKind::InvalidArgs, "old_str is empty"));
        }
        let text = self.read_text(&p)?;
        match text.matches(old).count() {
            1 => {
                self.write(&p, &text.replacen(old, new, 1))?;
                Ok(format!("replaced 1 occurrence in {p}"))
            }
            n => Err(err(
                ToolErrorKind::ExecutionError,
                format!("{p}: old_str occurs {n} times; it must occur exactly once"),
            )),
        }
    }

    fn shell(&mut self, command: &str, timeout_s: Option<f64>) -> Result<String, ToolError> {
        let max = self.task.spec.limits.shell_timeout_s as f64;
        let t = timeout_s.unwrap_or(max).min(max);
        let run = self.sandbox.run_shell(command, Duration::from_secs_f64(t));
        self.command_seconds += run.wall_s;
        let mut text = match run.exit_code {
            Some(c) => format!("exit code: {c}\n"),
            None => String::new(),
        };
        text.push_str(&run.stdout);
        if !run.stderr.is_empty() {
            text.push_str(&format!("\n--- stderr ---\n{}", run.stderr));
        }
        if run.truncated {
            text.push_str("\n[output truncated]");
        }
        let text = cut(&text);
        match run.outcome {
            Outcome::Completed => Ok(text),
            Outcome::TimedOut => Err(err(
                ToolErrorKind::Timeout,
                format!("timed out after {t:.1} s\n{text}"),
            )),
            Outcome::SandboxError(e) => Err(err(
                ToolErrorKind::ExecutionError,
                format!("sandbox error: {e}"),
            )),
            other => Ok(format!("{text}\n[ended: {other:?}]")),
        }
    }
}

/// A failed read or write of `p`: the sandbox's reason names the path again, so a long path
/// is shown (cut) once and stands as `<path>` in the reason.
fn fs_error(p: &str, e: &anyhow::Error) -> ToolError {
    let reason = format!("{e:#}");
    let message = if p.chars().count() > MAX_SHOWN_CHARS {
        format!("{}: {}", shown(p), reason.replace(p, "<path>"))
    } else {
        format!("{p}: {reason}")
    };
    err(ToolErrorKind::ExecutionError, message)
}

fn req_str<'a>(o: &'a serde_json::Map<String, Value>, k: &str) -> Result<&'a str, ToolError> {
    match o.get(k) {
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(err(
            ToolErrorKind::InvalidArgs,
            format!("argument {k:?} must be a string"),
        )),
        None => Err(err(
            ToolErrorKind::InvalidArgs,
            format!("missing required argument {k:?}"),
        )),
    }
}

fn opt_str<'a>(
    o: &'a serde_json::Map<String, Value>,
    k: &str,
) -> Result<Option<&'a str>, ToolError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        _ => req_str(o, k).map(Some),
    }
}

fn opt_line(o: &serde_json::Map<String, Value>, k: &str) -> Result<Option<usize>, ToolError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(Some(n as usize)),
            _ => Err(err(
                ToolErrorKind::InvalidArgs,
                format!("argument {k:?} must be an integer >= 1"),
            )),
        },
    }
}
