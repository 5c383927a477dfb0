//! composer-sandbox: runs untrusted, model-written code in a sandbox and grades
//! function-writing tasks in a way the code cannot game, plus a built-in set of such tasks.
//!
//! Grading ([`grade`]) splits the work between two sandboxed processes: the candidate's
//! process only *computes* (loads the solution, calls the entry point on inputs it is sent,
//! returns plain values of exact built-in types), and a separate trusted judge process runs the
//! tests with the entry point replaced by a proxy that forwards each call through this process.
//! The tests and expected values never enter the candidate's process or file system, and the
//! verdicts come only from the judge. [`Sandbox`] is the reusable sandbox underneath (private
//! read-only root, working copy, no network, pid namespace, cgroup memory/process caps). See
//! the crate README for what is enforced where, and [`sandbox_capabilities`] for this machine.

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

mod cgroup;
mod exec;
mod grading;
mod sandbox;
mod seccomp;
mod session;
mod tasks;

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

pub use exec::{sandbox_capabilities, Capabilities};
pub use grading::grade;
pub use sandbox::Sandbox;
pub use session::Session;

use exec::RawRun;
pub use tasks::{builtin_reference_solutions, builtin_tasks};

/// Whether the sandboxed code may use the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NetworkPolicy {
    /// An empty network namespace (where the kernel allows it; see [`Capabilities`]).
    #[default]
    Isolated,
    /// The host network.
    Allowed,
}

/// Resource limits of one sandboxed run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxLimits {
    /// Wall-clock limit; at the deadline every process of the run is killed.
    pub wall_time: Duration,
    /// CPU-time limit in seconds of the command (scheduler time, all its threads; the
    /// supervisor kills it at the limit). Each process it starts is held by RLIMIT_CPU at
    /// `2 × cpu_time_s + 1` (the kernel's tick-sampled count runs ahead on a busy machine).
    pub cpu_time_s: u64,
    /// Address-space limit per process in bytes (RLIMIT_AS; Python raises MemoryError).
    pub address_space_bytes: u64,
    /// Maximum number of processes of the run (cgroup `pids.max` for the whole tree where
    /// available, and RLIMIT_NPROC under a uid of its own).
    pub max_processes: u64,
    /// Memory cap for the whole process tree of a run in bytes (cgroup memory limit, where
    /// available: see [`Capabilities::cgroup`]; the OOM killer ends the run).
    #[serde(default = "default_memory_bytes")]
    pub memory_bytes: u64,
    /// Maximum size of any file written (RLIMIT_FSIZE; writes beyond fail with EFBIG).
    pub max_file_bytes: u64,
    /// Cap on the working copy's total size in bytes (file contents, directories and
    /// symlinks together), whoever writes it: runs get `ENOSPC` beyond it and end as
    /// [`Outcome::WorkdirLimit`]; [`Sandbox::write_file`] fails. Enforced by the kernel where
    /// the working copy is a size-capped tmpfs (see [`Capabilities::workdir_cap`]); that is
    /// memory, so a host needs up to (sandboxes alive at once) × this of RAM. Must be > 0.
    #[serde(default = "default_workdir_bytes")]
    pub max_workdir_bytes: u64,
    /// Cap on the number of entries (files, directories, symlinks...) in the working copy, the
    /// same way as [`SandboxLimits::max_workdir_bytes`] (millions of empty files exhaust a
    /// host's inodes without using bytes). Must be > 0.
    #[serde(default = "default_workdir_entries")]
    pub max_workdir_entries: u64,
    /// Captured stdout and stderr are each cut to this many bytes.
    pub max_output_bytes: usize,
    /// Network access.
    pub network: NetworkPolicy,
}

fn default_memory_bytes() -> u64 {
    1 << 30
}

fn default_workdir_bytes() -> u64 {
    128 << 20
}

fn default_workdir_entries() -> u64 {
    65_536
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            wall_time: Duration::from_secs(10),
            cpu_time_s: 5,
            address_space_bytes: 1 << 30,
            memory_bytes: default_memory_bytes(),
            max_processes: 32,
            max_file_bytes: 16 << 20,
            max_workdir_bytes: default_workdir_bytes(),
            max_workdir_entries: default_workdir_entries(),
            max_output_bytes: 8 << 10,
            network: NetworkPolicy::Isolated,
        }
    }
}

/// A function-writing task: the model writes `entry_point`, the tests check it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeTask {
    /// Unique id, e.g. `builtin/two_sum`.
    pub id: String,
    /// The instruction shown to the model.
    pub prompt: String,
    /// Name of the function the solution must define.
    pub entry_point: String,
    /// Tests, each one Python statement or block (typically an `assert`), run separately.
    pub tests: Vec<String>,
}

/// How a sandboxed run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The process exited by itself (whatever its exit code).
    Completed,
    /// Killed at the wall-clock limit.
    TimedOut,
    /// Killed at the CPU-time limit (by the supervisor, or RLIMIT_CPU's backstop).
    CpuLimit,
    /// Ran out of address space (an uncaught MemoryError, or a test failing with one).
    MemoryLimit,
    /// The working copy reached its cap ([`SandboxLimits::max_workdir_bytes`] or
    /// [`SandboxLimits::max_workdir_entries`]): writes beyond it failed with `ENOSPC`.
    WorkdirLimit,
    /// Killed by a signal other than the limits'.
    Killed {
        /// The signal number.
        signal: i32,
    },
    /// The sandbox itself failed (no interpreter, spawn error...); the reason says why.
    SandboxError(String),
}

/// Result of [`run_python`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecResult {
    /// Captured stdout, cut to `max_output_bytes` (lossy UTF-8).
    pub stdout: String,
    /// Captured stderr, cut to `max_output_bytes` (lossy UTF-8).
    pub stderr: String,
    /// Whether stdout or stderr was cut.
    pub truncated: bool,
    /// Exit code when the process exited normally.
    pub exit_code: Option<i32>,
    /// How the run ended.
    pub outcome: Outcome,
    /// Wall-clock seconds of the whole run (setup and cleanup included).
    pub wall_s: f64,
}

/// How test results become a reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RewardMode {
    /// reward = passed / total.
    #[default]
    FractionPassed,
    /// reward = 1 when every test passed, else 0.
    AllOrNothing,
}

/// Result of [`grade`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GradeReport {
    /// Tests passed.
    pub passed: usize,
    /// Tests in the task.
    pub total: usize,
    /// Reward in [0, 1] according to the [`RewardMode`].
    pub reward: f64,
    /// Every test passed.
    pub all_passed: bool,
    /// Feedback on the attempt: pass count, the first failing test (its source) and its error,
    /// then the captured output, cut to `max_output_bytes`. It shows expected values: for after
    /// the episode (a hint teacher, a report), never for a model that may attempt again.
    pub feedback: String,
    /// `feedback` for a model that may attempt again: the first failing test by number and its
    /// error (an assertion's by type only), no test source — else the next attempt could
    /// hard-code the expected values the source spells out.
    pub attempt_feedback: String,
    /// How the run ended.
    pub outcome: Outcome,
    /// Wall-clock seconds of the run.
    pub wall_s: f64,
}

/// The Python interpreter every sandboxed Python run uses (`$COMPOSER_SANDBOX_PYTHON`, else
/// the first system `python3`), so the built-in grader, the repository grader and anything
/// else that starts Python in a sandbox run the same one; `None` when there is none.
pub fn python_interpreter() -> Option<&'static Path> {
    exec::python_path().map(|p| p.as_path())
}

/// Runs `code` as a Python script in a fresh sandbox (stdin empty).
pub fn run_python(code: &str, limits: &SandboxLimits) -> ExecResult {
    let Some(python) = exec::python_path() else {
        return exec_result(RawRun::sandbox_error(
            "no python3 interpreter found".into(),
            0.0,
        ));
    };
    let sandbox = match Sandbox::new(limits.clone()) {
        Ok(s) => s,
        Err(e) => return exec_result(RawRun::sandbox_error(format!("{e:#}"), 0.0)),
    };
    if let Err(e) = sandbox.write_file("main.py", code.as_bytes()) {
        return exec_result(RawRun::sandbox_error(format!("{e:#}"), 0.0));
    }
    let python = python.display().to_string();
    sandbox.run(
        &[&python, "-I", "-S", "-B", "main.py"],
        b"",
        limits.wall_time,
    )
}

pub(crate) fn exec_result(run: RawRun) -> ExecResult {
    ExecResult {
        stdout: String::from_utf8_lossy(&run.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&run.stderr).into_owned(),
        truncated: run.stdout_truncated || run.stderr_truncated,
        exit_code: run.exit_code,
        outcome: run.outcome,
        wall_s: run.wall_s,
    }
}

/// The plain-value encoding shared by every judge and compute harness (this crate's and the
/// repository grader's in composer-env): exact built-in types only, fresh objects on decode,
/// the judge-side re-raise of a call's exception. Prepend it with [`with_plain_values`].
pub const PLAIN_VALUES_PY: &str = include_str!("plain_values.py");
/// A harness script: [`PLAIN_VALUES_PY`] followed by `script` (which sets `OUT`).
pub fn with_plain_values(script: &str) -> String {
    format!("{PLAIN_VALUES_PY}\n{script}")
}
/// The code in a model's answer: the first ```python (or ```py / ```python3) fenced block,
/// else the first fenced block of any language, else the whole text. An unclosed fence runs
/// to the end of the text.
pub fn extract_code(model_output: &str) -> String {
    let blocks = fenced_blocks(model_output);
    let is_python = |lang: &str| {
        let lang = lang.trim().to_ascii_lowercase();
        lang == "python" || lang == "py" || lang == "python3"
    };
    if let Some((_, body)) = blocks.iter().find(|(lang, _)| is_python(lang)) {
        return body.clone();
    }
    if let Some((_, body)) = blocks.first() {
        return body.clone();
    }
    model_output.to_string()
}

/// `(language, body)` of every ``` fenced block.
fn fenced_blocks(text: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(String, Vec<&str>)> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        match current.take() {
            None => {
                if let Some(lang) = trimmed.strip_prefix("```") {
                    current = Some((lang.trim().to_string(), Vec::new()));
                }
            }
            Some((lang, mut body)) => {
                if trimmed.trim_end() == "```" {
                    blocks.push((lang, body.join("\n") + "\n"));
                } else {
                    body.push(line);
                    current = Some((lang, body));
                }
            }
        }
    }
    if let Some((lang, body)) = current {
        blocks.push((lang, body.join("\n") + "\n"));
    }
    blocks
}

/// Reads tasks from a JSON Lines file, one [`CodeTask`] object per line (blank lines and lines
/// starting with `//` or `#` skipped; extra fields ignored). Errors name the file and line.
pub fn load_tasks_jsonl(path: &Path) -> Result<Vec<CodeTask>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading task file {}", path.display()))?;
    let mut tasks: Vec<CodeTask> = Vec::new();
    let mut seen = std::collections::HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let lineno = i + 1;
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with("//") || trimmed.starts_with('#') {
            continue;
        }
        let at = || format!("{}:{lineno}", path.display());
        let task: CodeTask = serde_json::from_str(trimmed)
            .with_context(|| format!("{}: not a valid task object", at()))?;
        if task.id.trim().is_empty() {
            bail!("{}: field `id` is empty", at());
        }
        if task.prompt.trim().is_empty() {
            bail!("{}: task `{}`: field `prompt` is empty", at(), task.id);
        }
        if !is_python_identifier(&task.entry_point) {
            bail!(
                "{}: task `{}`: field `entry_point` ({:?}) is not a Python identifier",
                at(),
                task.id,
                task.entry_point
            );
        }
        if task.tests.is_empty() {
            bail!("{}: task `{}`: field `tests` is empty", at(), task.id);
        }
        if let Some(j) = task.tests.iter().position(|t| t.trim().is_empty()) {
            bail!("{}: task `{}`: tests[{j}] is empty", at(), task.id);
        }
        if let Some(first) = seen.insert(task.id.clone(), lineno) {
            bail!(
                "{}: duplicate task id `{}` (first on line {first})",
                at(),
                task.id
            );
        }
        tasks.push(task);
    }
    if tasks.is_empty() {
        bail!("task file {} holds no tasks", path.display());
    }
    Ok(tasks)
}

fn is_python_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_alphabetic())
        && chars.all(|c| c == '_' || c.is_alphanumeric())
}

#[cfg(test)]
mod tests;
