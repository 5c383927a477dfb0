//! Two-process grading ([`grade`]): the candidate's process only computes, a trusted judge
//! runs the tests against a proxy of the entry point that forwards each call through this
//! process (see the crate docs).
use std::time::{Duration, Instant};

use crate::exec::{self, RawRun};
use crate::{
    with_plain_values, CodeTask, GradeReport, NetworkPolicy, Outcome, RewardMode, SandboxLimits,
};
use serde::Deserialize;

/// The candidate-side harness (untrusted once the candidate is loaded: it only computes).
const COMPUTE_PY: &str = include_str!("compute.py");
/// The trusted judge: runs the tests against a proxy of the entry point.
const JUDGE_PY: &str = include_str!("judge.py");
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
    let cand_dirs = match exec::SandboxDirs::new(mode, limits) {
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
        let judge = exec::SandboxDirs::new(mode, &judge_limits).and_then(|d| {
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
                        // Only a whole line of the judge's, an object as it writes them (serde
                        // would also read a struct from an array): a line cut at the length
                        // limit may end in text the code chose.
                        if !(line.starts_with(b"{") && line.ends_with(b"\n")) {
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
        Outcome::WorkdirLimit => feedback.push_str(&format!(
            "; the working copy reached its cap ({} bytes, {} entries)",
            limits.max_workdir_bytes, limits.max_workdir_entries
        )),
        Outcome::Killed { signal } => feedback.push_str(&format!("; killed by signal {signal}")),
        Outcome::SandboxError(reason) => feedback.push_str(&format!("; sandbox error: {reason}")),
    }
    feedback.push('\n');
    // What the model may see before another attempt: the failing test's number and error, not
    // its source (it holds the expected values, which a next attempt could hard-code).
    let mut attempt_feedback = feedback.clone();
    let load_failure = match &load {
        Some((false, error)) => Some(format!("the solution failed to load:\n{error}\n")),
        None if !matches!(outcome, Outcome::SandboxError(_)) => {
            Some("the solution did not finish loading\n".to_string())
        }
        _ => None,
    };
    match load_failure {
        // The candidate's own load error: both forms show it.
        Some(line) => {
            feedback.push_str(&line);
            attempt_feedback.push_str(&line);
        }
        None => {
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
                attempt_feedback.push_str(&format!(
                    "first failing test: #{}\n{}\n",
                    i + 1,
                    without_assertion_message(&error)
                ));
            }
        }
    }
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    // The candidate's own output (it never holds an expected value): both forms show it.
    let mut output = String::new();
    if !stdout.trim().is_empty() {
        output.push_str(&format!("--- stdout ---\n{}\n", stdout.trim_end()));
    }
    if !stderr.trim().is_empty() {
        output.push_str(&format!("--- stderr ---\n{}\n", stderr.trim_end()));
    }
    feedback.push_str(&output);
    attempt_feedback.push_str(&output);
    GradeReport {
        passed,
        total,
        reward,
        all_passed,
        feedback: truncate_text(&feedback, limits.max_output_bytes.max(256)),
        attempt_feedback: truncate_text(&attempt_feedback, limits.max_output_bytes.max(256)),
        outcome,
        wall_s: run.wall_s,
    }
}

/// A failing test's error without an assertion's message: a test's `assert ..., msg` may
/// spell out the expected value (`AssertionError: expected 5`), so only the type is kept.
/// Other errors are the candidate's own exceptions, whose messages it wrote itself.
fn without_assertion_message(error: &str) -> &str {
    if error.starts_with("AssertionError") {
        "AssertionError"
    } else {
        error
    }
}

/// Cuts `text` to at most `max` bytes on a char boundary, marking the cut.
pub(crate) fn truncate_text(text: &str, max: usize) -> String {
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
