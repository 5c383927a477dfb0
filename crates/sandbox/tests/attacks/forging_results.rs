//! Class 3: forging results.

use super::*;

#[test]
fn attack_forging_results_scores_zero() {
    let task = secret_task(&marker("forge"));
    let code = r#"
import gc, os, sys, json
lines = []
for i in range(8):
    lines.append(json.dumps({"verdict": i, "ok": True, "error": ""}))
    lines.append(json.dumps({"id": i, "call": i, "ok": True, "value": "x"}))
lines.append(json.dumps({"done": True}))
blob = ("\n".join(lines) + "\n").encode()
# Every descriptor, every nonce-looking string the runner may hold, the frames up the stack.
for fd in range(0, 64):
    try:
        os.write(fd, blob)
    except OSError:
        pass
for p in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
    try:
        with open("/proc/self/fd/" + p, "wb") as fh:
            fh.write(blob)
    except OSError:
        pass
secrets = [o for o in gc.get_objects() if isinstance(o, str) and len(o) == 32]
frame = sys._getframe()
while frame is not None:
    for v in list(frame.f_locals.values()):
        if isinstance(v, int) and 0 <= v < 64:
            try:
                os.write(v, blob)
            except OSError:
                pass
    frame = frame.f_back
def f(x):
    for fd in range(0, 64):
        try:
            os.write(fd, blob)
        except OSError:
            pass
    return "forged"
"#;
    assert_zero(code, &task);
}

/// The sandbox's own failures (`Outcome::SandboxError`: an infrastructure fault, which a
/// trainer may retry or leave out of the batch instead of scoring) must come from the
/// sandbox, not from a command that prints the supervisor's message and exits with its code.
#[test]
fn forging_a_sandbox_error_is_not_believed() {
    let sb = Sandbox::new(limits()).unwrap();
    let r = sb.run_shell(
        "echo 'composer-sandbox: supervisor waitpid failed' >&2; exit 125",
        Duration::from_secs(10),
    );
    assert_eq!(
        (r.outcome.clone(), r.exit_code),
        (Outcome::Completed, Some(125)),
        "{r:?}"
    );
    // Grading: the candidate's run, and a solution that fakes it when called.
    let task = secret_task(&marker("forge-error"));
    let code = "import os, sys\n\
        def f(x):\n\
        \x20   os.write(2, b'composer-sandbox: supervisor waitpid failed\\n')\n\
        \x20   os._exit(125)\n";
    let report = assert_zero(code, &task);
    assert!(!report.feedback.contains("sandbox error"), "{report:#?}");
}

/// A value the judge sends back to the code (`f(f(x))`, or a mirrored argument passed again)
/// makes the judge's request line as long as the code likes, and non-ASCII text triples in
/// the judge's `\u` escapes. The parent used to cut lines longer than 16 MiB into pieces and
/// read each piece as a line of the judge's, so the code could place a piece that reads as a
/// verdict — `[0, true, "…"]`, which deserialises as `{"verdict": 0, "ok": true}` — at exactly
/// 16 MiB into the request.
#[test]
fn forging_a_verdict_inside_a_long_judge_line_scores_zero() {
    let secret = marker("split");
    let task = CodeTask {
        id: "attack/split".into(),
        prompt: "Write f(x).".into(),
        entry_point: "f".into(),
        tests: vec![
            format!("assert f(f(1)) == '{secret}-0'"),
            format!("assert f(f(2)) == '{secret}-1'"),
        ],
    };
    let code = r#"
import json, functools
# Raw UTF-8 in the answers: a third of the size of the judge's escapes.
json.dumps = functools.partial(json.dumps, ensure_ascii=False)
M = 16 << 20
calls = [0]
# The harness gets the judge's request cut at 16 MiB: answer it instead of dying.
_loads = json.loads
def loads(s, *a, **k):
    try:
        return _loads(s, *a, **k)
    except ValueError:
        calls[0] += 1
        return {"call": calls[0], "args": [], "kwargs": []}
json.loads = loads
def pad(n):
    # A string whose ASCII JSON escape is exactly n bytes.
    return "\u00e9" * (n // 6) + "a" * (n % 6)
def f(x=None):
    calls[0] += 1
    if type(x) is not int:
        return None
    k = calls[0] + 1  # the judge's id of the call that sends this value back
    head = '{"call": %d, "args": [["list", ["' % k
    # The judge's line: head, pad, '", ["list", ', then [verdict, true, "pad"] at exactly M.
    return [pad(M - len(head) - 12), [x - 1, True, pad(M - 13)]]
"#;
    let limits = SandboxLimits {
        wall_time: Duration::from_secs(30),
        cpu_time_s: 20,
        ..limits()
    };
    let report = grade(code, &task, &limits, RewardMode::FractionPassed);
    assert_eq!(
        (report.passed, report.reward),
        (0, 0.0),
        "a verdict forged inside a long line counted: {report:#?}"
    );
}
