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
mod sandbox;
mod seccomp;
mod tasks;

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

pub use exec::{sandbox_capabilities, Capabilities};
pub use sandbox::Sandbox;

use exec::RawRun;
use std::time::Instant;
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
    /// Maximum number of processes of the run (cgroup `pids.max` for the whole tree where
    /// available, and RLIMIT_NPROC under a uid of its own).
    pub max_processes: u64,
    /// Memory cap for the whole process tree of a run in bytes (cgroup memory limit, where
    /// available: see [`Capabilities::cgroup`]; the OOM killer ends the run).
    #[serde(default = "default_memory_bytes")]
    pub memory_bytes: u64,
    /// Maximum size of any file written (RLIMIT_FSIZE; writes beyond fail with EFBIG).
    pub max_file_bytes: u64,
    /// Captured stdout and stderr are each cut to this many bytes.
    pub max_output_bytes: usize,
    /// Network access.
    pub network: NetworkPolicy,
}

fn default_memory_bytes() -> u64 {
    1 << 30
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
/// The candidate-side harness (untrusted once the candidate is loaded: it only computes).
const COMPUTE_PY: &str = include_str!("compute.py");
/// The trusted judge: runs the tests against a proxy of the entry point.
const JUDGE_PY: &str = include_str!("judge.py");

/// A harness script: [`PLAIN_VALUES_PY`] followed by `script` (which sets `OUT`).
pub fn with_plain_values(script: &str) -> String {
    format!("{PLAIN_VALUES_PY}\n{script}")
}
/// Extra wall-clock time of the judge over the candidate's limit (it outlives the candidate
/// so that it can record the failures after a timeout).
const JUDGE_EXTRA: Duration = Duration::from_secs(5);

/// The load report of the candidate's process (its first result-channel line). Untrusted: a
/// forged "loaded" only makes the later calls fail.
#[derive(Deserialize)]
struct LoadLine {
    load: bool,
    #[serde(default)]
    error: String,
}

/// A verdict line of the judge (trusted).
#[derive(Deserialize)]
struct JudgeLine {
    #[serde(default)]
    verdict: Option<usize>,
    #[serde(default)]
    ok: bool,
    #[serde(default)]
    error: String,
    #[serde(default)]
    done: bool,
}

/// Receives the next line before `deadline`; None at EOF or the deadline.
fn recv_line(rx: &std::sync::mpsc::Receiver<Vec<u8>>, deadline: Instant) -> Option<Vec<u8>> {
    let wait = deadline.saturating_duration_since(Instant::now());
    rx.recv_timeout(wait).ok()
}

fn write_line(to: &mut Option<std::process::ChildStdin>, line: &[u8]) -> bool {
    use std::io::Write;
    let Some(w) = to.as_mut() else {
        return false;
    };
    let ok = w.write_all(line).is_ok()
        && (line.ends_with(b"\n") || w.write_all(b"\n").is_ok())
        && w.flush().is_ok();
    if !ok {
        *to = None;
    }
    ok
}

/// Load status, per-test verdicts, and the candidate's run.
struct Grading {
    load: Option<(bool, String)>,
    verdicts: Vec<Option<(bool, String)>>,
    candidate: RawRun,
    judge_error: Option<String>,
}

/// Runs the candidate (computing only) and the judge (running the tests) in two sandboxes and
/// relays the judge's calls to the candidate. The tests reach only the judge.
fn run_grading(code: &str, task: &CodeTask, limits: &SandboxLimits) -> Grading {
    let total = task.tests.len();
    let mut g = Grading {
        load: None,
        verdicts: vec![None; total],
        candidate: RawRun::sandbox_error(String::new(), 0.0),
        judge_error: None,
    };
    let fail = |mut g: Grading, reason: String| {
        g.candidate = RawRun::sandbox_error(reason, 0.0);
        g
    };
    let Some(python) = exec::python_path() else {
        return fail(g, "no python3 interpreter found".into());
    };
    let python = python.display().to_string();
    let mode = exec::mode();

    // The candidate's sandbox: the harness and the solution, nothing else.
    let cand_dirs = match exec::SandboxDirs::new(mode) {
        Ok(d) => d,
        Err(e) => return fail(g, format!("{e:#}")),
    };
    let compute = with_plain_values(COMPUTE_PY);
    for (name, text) in [("compute.py", compute.as_str()), ("solution.py", code)] {
        if let Err(e) = cand_dirs.write_file(name, text.as_bytes()) {
            return fail(g, format!("{e:#}"));
        }
    }
    let argv = [
        python.as_str(),
        "-I",
        "-S",
        "-B",
        "compute.py",
        task.entry_point.as_str(),
    ];
    let mut cand = match exec::spawn(
        &cand_dirs,
        &argv,
        limits,
        limits.wall_time,
        limits.cpu_time_s,
        true,
        mode,
    ) {
        Ok(r) => r,
        Err(e) => return fail(g, e),
    };
    let Some(cand_lines) = cand.channel.take() else {
        return fail(g, "no result channel".into());
    };
    let cand_deadline = cand.deadline();
    if let Some(line) = recv_line(&cand_lines, cand_deadline) {
        g.load = Some(match serde_json::from_slice::<LoadLine>(&line) {
            Ok(l) => (l.load, l.error),
            Err(_) => (false, "the solution's process broke the protocol".into()),
        });
    }

    if matches!(g.load, Some((true, _))) {
        // The judge's sandbox: only the judge; the tests arrive on its stdin.
        let judge_limits = SandboxLimits {
            wall_time: limits.wall_time + JUDGE_EXTRA,
            memory_bytes: limits.memory_bytes.max(512 << 20),
            address_space_bytes: limits.address_space_bytes.max(1 << 30),
            network: NetworkPolicy::Isolated,
            ..limits.clone()
        };
        let judge = exec::SandboxDirs::new(mode).and_then(|d| {
            d.write_file("judge.py", with_plain_values(JUDGE_PY).as_bytes())?;
            Ok(d)
        });
        let spawned = judge.map_err(|e| format!("{e:#}")).and_then(|d| {
            let argv = [python.as_str(), "-I", "-S", "-B", "judge.py"];
            let r = exec::spawn(
                &d,
                &argv,
                &judge_limits,
                judge_limits.wall_time,
                judge_limits.cpu_time_s + JUDGE_EXTRA.as_secs(),
                true,
                mode,
            )?;
            Ok((d, r))
        });
        match spawned {
            Err(e) => g.judge_error = Some(e),
            Ok((_judge_dirs, mut judge)) => {
                let spec = serde_json::json!({
                    "entry_point": task.entry_point,
                    "tests": task.tests,
                });
                write_line(&mut judge.stdin, spec.to_string().as_bytes());
                let judge_deadline = judge.deadline();
                if let Some(judge_lines) = judge.channel.take() {
                    while let Some(line) = recv_line(&judge_lines, judge_deadline) {
                        if let Some(rest) = line.strip_prefix(b"{\"call\": ") {
                            // Forward the call verbatim; answer with the candidate's next line.
                            let id: String = rest
                                .iter()
                                .take_while(|b| b.is_ascii_digit())
                                .map(|&b| b as char)
                                .collect();
                            let reply = if write_line(&mut cand.stdin, &line) {
                                recv_line(&cand_lines, cand_deadline)
                            } else {
                                None
                            };
                            let reply = reply.unwrap_or_else(|| {
                                format!(
                                    "{{\"id\": {}, \"ok\": false, \"type\": \"\", \"error\": \
                                     \"the solution's process ended (crashed, was killed, or \
                                     timed out)\"}}\n",
                                    if id.is_empty() { "null" } else { &id }
                                )
                                .into_bytes()
                            });
                            write_line(&mut judge.stdin, &reply);
                            continue;
                        }
                        let Ok(v) = serde_json::from_slice::<JudgeLine>(&line) else {
                            continue;
                        };
                        if v.done {
                            break;
                        }
                        if let Some(i) = v.verdict.filter(|&i| i < total) {
                            if g.verdicts[i].is_none() {
                                g.verdicts[i] = Some((v.ok, v.error));
                            }
                        }
                    }
                }
                let judged = judge.finish();
                if let Outcome::SandboxError(e) = judged.outcome {
                    g.judge_error = Some(e);
                } else if g.verdicts.iter().any(Option::is_none)
                    && !matches!(judged.outcome, Outcome::Completed)
                {
                    g.judge_error =
                        Some(format!("the test judge ended early: {:?}", judged.outcome));
                }
            }
        }
    }
    drop(cand.stdin.take());
    g.candidate = cand.finish();
    drop(cand_dirs);
    g
}

/// Grades `code` against `task`'s tests. Blocking; never panics: a sandbox failure gives
/// reward 0 with the reason in `outcome` and `feedback`.
///
/// The candidate runs in a sandbox holding only the solution and a harness that calls the entry
/// point on the inputs it is sent and returns the results (exact built-in types only). The
/// tests run in a second sandbox, a trusted judge that never loads the candidate's code: each
/// call of the entry point in a test is forwarded through this process to the candidate, and
/// the decoded plain value comes back. So the tests and expected values never reach the
/// candidate, and whatever the candidate writes is at most a claim about a return value. Tests
/// may use the entry point, builtins and literals (not other names of the solution).
pub fn grade(code: &str, task: &CodeTask, limits: &SandboxLimits, mode: RewardMode) -> GradeReport {
    let total = task.tests.len();
    let g = run_grading(code, task, limits);
    let results = g.verdicts;
    let load = g.load;
    let run = g.candidate;
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
    if let (Some(e), Outcome::Completed) = (&g.judge_error, &outcome) {
        outcome = Outcome::SandboxError(e.clone());
    }
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
