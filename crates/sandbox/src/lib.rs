//! composer-sandbox: runs untrusted, model-written Python against unit tests and turns the
//! result into a reward, plus a built-in set of function-writing tasks.
//!
//! Each run is `python3 -I -S -B` in a private temporary working directory (removed
//! afterwards), with an empty environment, CPU/address-space/process/file-size rlimits, a
//! wall-clock deadline that kills everything the run started, and — where the kernel allows —
//! user, mount, pid and network namespaces (no network, private /tmp, read-only file system,
//! no view of other processes). When running as root every run also switches to its own
//! unprivileged uid. See the crate README for what is enforced where, and
//! [`sandbox_capabilities`] for what this machine allows.

// `!(x > 0.0)` is used on purpose in validation: it also rejects NaN.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

mod exec;
mod tasks;

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

pub use exec::{sandbox_capabilities, Capabilities};
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
    /// CPU-time limit in seconds per process (RLIMIT_CPU: SIGKILL at the limit).
    pub cpu_time_s: u64,
    /// Address-space limit per process in bytes (RLIMIT_AS; Python raises MemoryError).
    pub address_space_bytes: u64,
    /// Maximum number of processes of the run (RLIMIT_NPROC under a uid of its own).
    pub max_processes: u64,
    /// Maximum size of any file written (RLIMIT_FSIZE; writes beyond fail with EFBIG).
    pub max_file_bytes: u64,
    /// Captured stdout and stderr are each cut to this many bytes.
    pub max_output_bytes: usize,
    /// Network access.
    pub network: NetworkPolicy,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            wall_time: Duration::from_secs(10),
            cpu_time_s: 5,
            address_space_bytes: 1 << 30,
            max_processes: 32,
            max_file_bytes: 16 << 20,
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
    /// Killed by the CPU-time limit (RLIMIT_CPU).
    CpuLimit,
    /// Ran out of address space (an uncaught MemoryError, or a test failing with one).
    MemoryLimit,
    /// Killed by a signal (including SIGKILL at the hard CPU limit).
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
    /// Feedback for the model: pass count, the first failing test and its error, then the
    /// captured output, cut to `max_output_bytes`.
    pub feedback: String,
    /// How the run ended.
    pub outcome: Outcome,
    /// Wall-clock seconds of the run.
    pub wall_s: f64,
}

/// Runs `code` as a Python script in the sandbox (stdin empty).
pub fn run_python(code: &str, limits: &SandboxLimits) -> ExecResult {
    let run = exec::run_raw(&[("main.py", code.as_bytes())], "main.py", b"", limits);
    ExecResult {
        stdout: String::from_utf8_lossy(&run.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&run.stderr).into_owned(),
        truncated: run.stdout_truncated || run.stderr_truncated,
        exit_code: run.exit_code,
        outcome: run.outcome,
        wall_s: run.wall_s,
    }
}

/// One line of the runner's result channel.
#[derive(Deserialize)]
struct RunnerLine {
    kind: String,
    #[serde(default)]
    index: Option<usize>,
    #[serde(default)]
    ok: bool,
    #[serde(default)]
    error: String,
}

/// A fresh random nonce (128 bits from the OS, hex).
fn nonce() -> String {
    let mut bytes = [0u8; 16];
    let from_os = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    if from_os.is_err() {
        // Fallback: std's randomly keyed SipHash over time and a counter.
        use std::hash::{BuildHasher, Hasher};
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        for chunk in bytes.chunks_mut(8) {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0),
            );
            chunk.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Cuts `text` to at most `max` bytes on a char boundary, marking the cut.
fn truncate_text(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let marker = "\n...[truncated]";
    let mut end = max.saturating_sub(marker.len());
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{marker}", &text[..end])
}

/// Grades `code` against `task`'s tests in the sandbox. Blocking; never panics: a sandbox
/// failure gives reward 0 with the reason in `outcome` and `feedback`.
pub fn grade(code: &str, task: &CodeTask, limits: &SandboxLimits, mode: RewardMode) -> GradeReport {
    let total = task.tests.len();
    let spec = serde_json::json!({ "entry_point": task.entry_point, "tests": task.tests });
    let spec = spec.to_string();
    let nonce = nonce();
    let stdin = format!("{nonce}\n");
    let run = exec::run_raw(
        &[
            ("runner.py", include_str!("runner.py").as_bytes()),
            ("solution.py", code.as_bytes()),
            ("tests.json", spec.as_bytes()),
        ],
        "runner.py",
        stdin.as_bytes(),
        limits,
    );

    // Parse the result channel: only lines carrying this run's nonce count, first per test.
    let mut load: Option<(bool, String)> = None;
    let mut results: Vec<Option<(bool, String)>> = vec![None; total];
    let prefix = format!("{nonce} ");
    for line in String::from_utf8_lossy(&run.result_channel).lines() {
        let Some(json) = line.strip_prefix(&prefix) else {
            continue;
        };
        let Ok(parsed) = serde_json::from_str::<RunnerLine>(json) else {
            continue;
        };
        match (parsed.kind.as_str(), parsed.index) {
            ("load", _) if load.is_none() => load = Some((parsed.ok, parsed.error)),
            ("test", Some(i)) if i < total && results[i].is_none() => {
                results[i] = Some((parsed.ok, parsed.error))
            }
            _ => {}
        }
    }
    let passed = results
        .iter()
        .filter(|r| matches!(r, Some((true, _))))
        .count();
    let all_passed = total > 0 && passed == total;
    let reward = match mode {
        _ if total == 0 => 0.0,
        RewardMode::FractionPassed => passed as f64 / total as f64,
        RewardMode::AllOrNothing => f64::from(u8::from(all_passed)),
    };

    let mut outcome = run.outcome.clone();
    let memory_error = |e: &str| e.starts_with("MemoryError");
    if outcome == Outcome::Completed
        && (load.as_ref().is_some_and(|(_, e)| memory_error(e))
            || results.iter().flatten().any(|(_, e)| memory_error(e)))
    {
        outcome = Outcome::MemoryLimit;
    }

    // Feedback: what happened, the first failing test and its error, then captured output.
    let mut feedback = format!("passed {passed}/{total} tests");
    match &outcome {
        Outcome::Completed | Outcome::MemoryLimit => {}
        Outcome::TimedOut => feedback.push_str(&format!(
            "; timed out after {:.1} s (wall-clock limit)",
            limits.wall_time.as_secs_f64()
        )),
        Outcome::CpuLimit => feedback.push_str(&format!(
            "; killed at the CPU-time limit ({} s)",
            limits.cpu_time_s
        )),
        Outcome::Killed { signal } => feedback.push_str(&format!("; killed by signal {signal}")),
        Outcome::SandboxError(reason) => feedback.push_str(&format!("; sandbox error: {reason}")),
    }
    feedback.push('\n');
    match &load {
        Some((false, error)) => {
            feedback.push_str(&format!("the solution failed to load:\n{error}\n"));
        }
        None if !matches!(outcome, Outcome::SandboxError(_)) => {
            feedback.push_str("the solution did not finish loading\n");
        }
        _ => {
            if let Some(i) = results.iter().position(|r| !matches!(r, Some((true, _)))) {
                let error = match &results[i] {
                    Some((_, e)) => e.clone(),
                    None => "no result (the run ended before or during this test)".to_string(),
                };
                feedback.push_str(&format!(
                    "first failing test (#{}):\n{}\n{}\n",
                    i + 1,
                    task.tests[i].trim(),
                    error
                ));
            }
        }
    }
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    if !stdout.trim().is_empty() {
        feedback.push_str(&format!("--- stdout ---\n{}\n", stdout.trim_end()));
    }
    if !stderr.trim().is_empty() {
        feedback.push_str(&format!("--- stderr ---\n{}\n", stderr.trim_end()));
    }
    GradeReport {
        passed,
        total,
        reward,
        all_passed,
        feedback: truncate_text(&feedback, limits.max_output_bytes.max(256)),
        outcome,
        wall_s: run.wall_s,
    }
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
mod tests {
    use super::*;

    #[test]
    fn extract_code_prefers_python_fence() {
        let text = "Here:\n```text\nnot code\n```\n```python\ndef f():\n    return 1\n```\nDone";
        assert_eq!(extract_code(text), "def f():\n    return 1\n");
        assert_eq!(extract_code("```\nx = 1\n```"), "x = 1\n");
        assert_eq!(extract_code("x = 2"), "x = 2");
        assert_eq!(extract_code("```py\ny = 3\n"), "y = 3\n");
    }

    #[test]
    fn truncation_respects_limit_and_char_boundaries() {
        let long = "é".repeat(1000);
        let cut = truncate_text(&long, 100);
        assert!(cut.len() <= 100);
        assert!(cut.ends_with("[truncated]"));
        assert_eq!(truncate_text("short", 100), "short");
    }

    #[test]
    fn identifiers() {
        assert!(is_python_identifier("two_sum"));
        assert!(is_python_identifier("_f1"));
        assert!(!is_python_identifier("1f"));
        assert!(!is_python_identifier("f-g"));
        assert!(!is_python_identifier(""));
    }
}
