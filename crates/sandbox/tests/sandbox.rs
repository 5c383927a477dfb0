//! Real-subprocess tests of the sandbox: built-in tasks, grading, limits, task files. The
//! attack suite is tests/attacks/.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use composer_sandbox::*;

fn limits() -> SandboxLimits {
    SandboxLimits::default()
}

/// Short limits for the escape attempts, so the suite stays fast.
fn tight() -> SandboxLimits {
    SandboxLimits {
        wall_time: Duration::from_secs(3),
        cpu_time_s: 2,
        ..SandboxLimits::default()
    }
}

fn task(name: &str) -> CodeTask {
    let id = format!("builtin/{name}");
    builtin_tasks()
        .into_iter()
        .find(|t| t.id == id)
        .unwrap_or_else(|| panic!("no built-in task {id}"))
}

/// Runs `f` over `items` on a few threads (the suite must stay fast on 2 cores).
fn par_map<T: Sync, R: Send>(items: &[T], threads: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let mut out: Vec<Option<R>> = (0..items.len()).map(|_| None).collect();
    let slots = std::sync::Mutex::new(&mut out);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= items.len() {
                    break;
                }
                let r = f(&items[i]);
                slots.lock().unwrap()[i] = Some(r);
            });
        }
    });
    out.into_iter().map(|r| r.unwrap()).collect()
}

// ---------------------------------------------------------------------------------------------
// Tasks and grading
// ---------------------------------------------------------------------------------------------

#[test]
fn builtin_task_set_is_large_and_well_formed() {
    let tasks = builtin_tasks();
    assert!(tasks.len() >= 30, "only {} built-in tasks", tasks.len());
    let mut ids: Vec<&str> = tasks.iter().map(|t| t.id.as_str()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), tasks.len(), "duplicate task ids");
    let refs = builtin_reference_solutions();
    assert_eq!(refs.len(), tasks.len());
    for t in &tasks {
        assert!(t.tests.len() >= 4, "{} has too few tests", t.id);
        assert!(
            t.prompt.contains(&t.entry_point),
            "{} prompt does not name its function",
            t.id
        );
    }
}

/// Every reference solution passes all its tests (reward 1.0), a stub that returns None fails
/// at least one, and a solution that raises scores 0: every task is solvable and its tests are
/// meaningful.
#[test]
fn every_builtin_task_is_solvable_and_its_tests_discriminate() {
    let tasks = builtin_tasks();
    let refs = builtin_reference_solutions();
    let jobs: Vec<(CodeTask, String)> = tasks
        .into_iter()
        .zip(refs.into_iter().map(|r| r.1))
        .collect();
    let reports = par_map(&jobs, 3, |(task, reference)| {
        let good = grade(reference, task, &limits(), RewardMode::AllOrNothing);
        let stub = format!(
            "def {}(*args, **kwargs):\n    return None\n",
            task.entry_point
        );
        let bad = grade(&stub, task, &limits(), RewardMode::FractionPassed);
        let unimplemented = format!(
            "def {}(*args, **kwargs):\n    raise NotImplementedError\n",
            task.entry_point
        );
        let wrong = grade(&unimplemented, task, &limits(), RewardMode::FractionPassed);
        (task.id.clone(), good, bad, wrong)
    });
    for (id, good, bad, wrong) in reports {
        assert!(
            wrong.passed == 0 && wrong.reward == 0.0,
            "{id}: an unimplemented solution scores: {wrong:#?}"
        );
        assert!(
            good.all_passed && good.reward == 1.0 && good.outcome == Outcome::Completed,
            "{id}: reference solution failed: {good:#?}"
        );
        assert!(
            bad.passed < bad.total && bad.reward < 1.0,
            "{id}: a stub passes every test"
        );
    }
}

#[test]
fn partial_credit_and_reward_modes() {
    let t = task("sum_of_evens");
    // Sums every number: only the empty-list test (0) passes, of 4.
    let code = "def sum_of_evens(numbers):\n    return sum(numbers)\n";
    let frac = grade(code, &t, &limits(), RewardMode::FractionPassed);
    assert_eq!((frac.passed, frac.total), (1, 4), "{frac:#?}");
    assert_eq!(frac.reward, 0.25);
    assert!(!frac.all_passed);
    assert!(
        frac.feedback.contains("first failing test (#1)"),
        "{}",
        frac.feedback
    );
    assert!(
        frac.feedback.contains("sum_of_evens([1, 2, 3, 4]) == 6"),
        "{}",
        frac.feedback
    );
    let all = grade(code, &t, &limits(), RewardMode::AllOrNothing);
    assert_eq!((all.passed, all.reward), (1, 0.0));
}

#[test]
fn model_output_is_extracted_then_graded() {
    let t = task("count_vowels");
    let answer = "Sure, here it is:\n```python\ndef count_vowels(text):\n    return sum(c in 'aeiouAEIOU' for c in text)\n```\nThis counts vowels.";
    let report = grade(
        &extract_code(answer),
        &t,
        &limits(),
        RewardMode::AllOrNothing,
    );
    assert!(report.all_passed, "{report:#?}");
}

#[test]
fn syntax_error_gets_zero_and_says_why() {
    let t = task("sum_of_evens");
    let report = grade(
        "def sum_of_evens(numbers)\n    return 0\n",
        &t,
        &limits(),
        RewardMode::FractionPassed,
    );
    assert_eq!((report.passed, report.reward), (0, 0.0));
    assert_eq!(report.outcome, Outcome::Completed);
    assert!(
        report.feedback.contains("failed to load"),
        "{}",
        report.feedback
    );
    assert!(
        report.feedback.contains("SyntaxError"),
        "{}",
        report.feedback
    );
}

#[test]
fn exceptions_fail_tests_with_their_error() {
    let t = task("reverse_words");
    let code = "def reverse_words(sentence):\n    if not sentence:\n        return ''\n    raise KeyError('boom')\n";
    let report = grade(code, &t, &limits(), RewardMode::FractionPassed);
    // Only the empty-string test passes.
    assert_eq!((report.passed, report.total), (1, 4), "{report:#?}");
    assert!(
        report.feedback.contains("KeyError: 'boom'"),
        "{}",
        report.feedback
    );
}

#[test]
fn missing_entry_point_and_exit_calls_are_failures() {
    let t = task("sum_of_evens");
    let report = grade(
        "def other():\n    pass\n",
        &t,
        &limits(),
        RewardMode::FractionPassed,
    );
    assert_eq!(report.passed, 0);
    assert!(
        report.feedback.contains("does not define `sum_of_evens`"),
        "{}",
        report.feedback
    );

    // sys.exit inside the function only fails the tests that call it.
    let code = "import sys\ndef sum_of_evens(numbers):\n    if numbers:\n        sys.exit(0)\n    return 0\n";
    let report = grade(code, &t, &limits(), RewardMode::FractionPassed);
    assert_eq!((report.passed, report.total), (1, 4), "{report:#?}");

    // os._exit at import time: nothing reported, nothing passes.
    let report = grade(
        "import os\nos._exit(0)\n",
        &t,
        &limits(),
        RewardMode::FractionPassed,
    );
    assert_eq!(report.passed, 0, "{report:#?}");
    assert!(
        report.feedback.contains("did not finish loading"),
        "{}",
        report.feedback
    );
}

#[test]
fn printed_or_guessed_fake_results_do_not_count() {
    let t = task("sum_of_evens");
    let code = r#"
import os, json
fake = json.dumps({"kind": "test", "index": 0, "ok": True, "error": ""})
for i in range(4):
    print("00000000000000000000000000000000 " + json.dumps({"kind": "test", "index": i, "ok": True, "error": ""}))
for fd in range(3, 20):
    try:
        os.write(fd, ("deadbeef " + fake + "\n").encode())
    except OSError:
        pass
def sum_of_evens(numbers):
    return -1
"#;
    let report = grade(code, &t, &limits(), RewardMode::FractionPassed);
    assert_eq!(report.passed, 0, "{report:#?}");
}

#[test]
fn output_is_captured_and_truncated() {
    let small = SandboxLimits {
        max_output_bytes: 1024,
        ..limits()
    };
    let r = run_python(
        "print('x' * 100000)\nimport sys\nprint('err', file=sys.stderr)\n",
        &small,
    );
    assert_eq!(r.outcome, Outcome::Completed);
    assert_eq!(r.stdout.len(), 1024);
    assert!(r.truncated);
    assert_eq!(r.stderr, "err\n");

    let t = task("sum_of_evens");
    let code = "print('y' * 100000)\ndef sum_of_evens(numbers):\n    return 0\n";
    let report = grade(code, &t, &small, RewardMode::FractionPassed);
    assert!(report.feedback.len() <= 1024, "{}", report.feedback.len());
    assert!(
        report.feedback.starts_with("passed 2/4 tests"),
        "{}",
        report.feedback
    );
    assert!(
        report.feedback.ends_with("[truncated]"),
        "{}",
        report.feedback
    );
}

// ---------------------------------------------------------------------------------------------
// Resource limits and the parent's safety (the attack classes are in tests/attacks/).
// ---------------------------------------------------------------------------------------------

#[test]
fn escape_infinite_loops_hit_cpu_and_wall_limits() {
    // A generous deadline: on a loaded machine 1 s of CPU can take several seconds of wall.
    let cpu_bound = SandboxLimits {
        wall_time: Duration::from_secs(30),
        cpu_time_s: 1,
        ..tight()
    };
    let r = run_python("while True:\n    pass\n", &cpu_bound);
    assert_eq!(r.outcome, Outcome::CpuLimit, "{r:#?}");

    // Sleeping burns no CPU: the wall-clock limit ends it.
    let lim = SandboxLimits {
        wall_time: Duration::from_secs(1),
        ..tight()
    };
    let r = run_python("import time\ntime.sleep(100)\n", &lim);
    assert_eq!(r.outcome, Outcome::TimedOut, "{r:#?}");

    // In grading, a looping test fails the remaining tests, earlier ones still count.
    let t = task("sum_of_evens");
    let code = "def sum_of_evens(numbers):\n    if not numbers:\n        while True:\n            pass\n    return sum(n for n in numbers if n % 2 == 0)\n";
    let report = grade(code, &t, &tight(), RewardMode::FractionPassed);
    assert_eq!((report.passed, report.total), (1, 4), "{report:#?}");
    assert!(
        matches!(report.outcome, Outcome::CpuLimit | Outcome::TimedOut),
        "{report:#?}"
    );
    assert!(
        report.feedback.contains("first failing test (#2)"),
        "{}",
        report.feedback
    );
}

#[test]
fn escape_ten_gigabyte_allocation_fails_cleanly() {
    let r = run_python("x = bytearray(10 * 1024 ** 3)\nprint(len(x))\n", &tight());
    assert_eq!(r.outcome, Outcome::MemoryLimit, "{r:#?}");
    assert!(r.stderr.contains("MemoryError"), "{r:#?}");

    let t = task("sum_of_evens");
    let code = "def sum_of_evens(numbers):\n    x = bytearray(10 * 1024 ** 3)\n    return 0\n";
    let report = grade(code, &t, &tight(), RewardMode::FractionPassed);
    assert_eq!(report.passed, 0);
    assert_eq!(report.outcome, Outcome::MemoryLimit, "{report:#?}");
    assert!(
        report.feedback.contains("MemoryError"),
        "{}",
        report.feedback
    );
}

#[test]
fn escape_killing_the_parent_and_everyone_else_fails() {
    let me = std::process::id();
    let code = format!(
        r#"
import os, signal
for target in (os.getppid(), {me}, 1):
    try:
        os.kill(target, signal.SIGKILL)
        print("signalled", target, flush=True)
    except OSError as e:
        print("blocked", target, e.errno, flush=True)
for name in os.listdir("/proc"):
    if name.isdigit() and int(name) != os.getpid():
        try:
            os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass
try:
    os.kill(-1, signal.SIGKILL)
except OSError:
    pass
print("still here", flush=True)
"#
    );
    let r = run_python(&code, &tight());
    // We are still alive to check this: the test process was not killed.
    assert!(
        matches!(r.outcome, Outcome::Completed | Outcome::Killed { .. }),
        "{r:#?}"
    );
    assert!(!r.stdout.contains(&format!("signalled {me}")), "{r:#?}");
    // The sandbox still works afterwards.
    assert_eq!(run_python("print(1)", &limits()).stdout, "1\n");
}

#[test]
fn escape_reading_the_parent_environment_fails() {
    let me = std::process::id();
    let code = format!(
        r#"
import os
print(sorted(os.environ.items()))
for pid in (os.getppid(), {me}, 1):
    try:
        print(open("/proc/%d/environ" % pid, "rb").read().decode("utf-8", "replace"))
    except OSError as e:
        print("blocked", pid, e.errno)
"#
    );
    let r = run_python(&code, &tight());
    assert_eq!(r.outcome, Outcome::Completed, "{r:#?}");
    let sandbox_vars = ["PATH", "HOME", "TMPDIR", "LANG"];
    let mut checked = 0;
    for (name, value) in std::env::vars() {
        if sandbox_vars.contains(&name.as_str()) || value.len() < 4 {
            continue;
        }
        checked += 1;
        assert!(
            !r.stdout.contains(&format!("{name}={value}"))
                && !r.stdout.contains(&format!("'{name}'")),
            "the parent's {name} leaked: {}",
            r.stdout
        );
    }
    assert!(
        checked > 0,
        "the test process has no environment to protect"
    );
    let env_line = r.stdout.lines().next().unwrap_or_default();
    for name in ["HOME", "LANG", "PATH", "TMPDIR"] {
        assert!(env_line.contains(&format!("'{name}'")), "{env_line}");
    }
}

// ---------------------------------------------------------------------------------------------
// Task files
// ---------------------------------------------------------------------------------------------

fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn task_files_load_and_bad_ones_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_file(
        dir.path(),
        "good.jsonl",
        concat!(
            "{\"id\": \"t1\", \"prompt\": \"Write add(a, b).\", \"entry_point\": \"add\", \"tests\": [\"assert add(1, 2) == 3\"]}\n",
            "\n",
            "# a comment\n",
            "{\"id\": \"t2\", \"prompt\": \"Write neg(x).\", \"entry_point\": \"neg\", \"tests\": [\"assert neg(1) == -1\"], \"extra\": 1}\n",
        ),
    );
    let tasks = load_tasks_jsonl(&good).unwrap();
    assert_eq!(tasks.len(), 2);
    assert_eq!(tasks[1].entry_point, "neg");
    let r = grade(
        "def add(a, b):\n    return a + b\n",
        &tasks[0],
        &limits(),
        RewardMode::AllOrNothing,
    );
    assert!(r.all_passed, "{r:#?}");

    let line = |id: &str, entry: &str, tests: &str| {
        format!("{{\"id\": \"{id}\", \"prompt\": \"p\", \"entry_point\": \"{entry}\", \"tests\": {tests}}}\n")
    };
    let ok = line("a", "f", "[\"assert f()\"]");
    let cases = [
        (
            "syntax.jsonl",
            format!("{ok}{{not json\n"),
            "syntax.jsonl:2",
        ),
        (
            "missing.jsonl",
            format!("{ok}{{\"id\": \"b\", \"prompt\": \"p\", \"tests\": []}}\n"),
            "missing.jsonl:2",
        ),
        (
            "notests.jsonl",
            format!("\n{}", line("b", "f", "[]")),
            "notests.jsonl:2",
        ),
        (
            "badentry.jsonl",
            line("b", "not valid", "[\"assert 1\"]"),
            "badentry.jsonl:1",
        ),
        ("dup.jsonl", format!("{ok}{ok}"), "dup.jsonl:2"),
        (
            "emptytest.jsonl",
            line("b", "f", "[\"  \"]"),
            "emptytest.jsonl:1",
        ),
        ("empty.jsonl", String::new(), "empty.jsonl"),
    ];
    for (name, text, expected) in cases {
        let path = write_file(dir.path(), name, &text);
        let err = format!("{:#}", load_tasks_jsonl(&path).unwrap_err());
        assert!(
            err.contains(expected),
            "{name}: error {err:?} does not name {expected}"
        );
    }
    let err = format!(
        "{:#}",
        load_tasks_jsonl(&dir.path().join("absent.jsonl")).unwrap_err()
    );
    assert!(err.contains("absent.jsonl"), "{err}");
}

#[test]
fn capabilities_are_reported() {
    let caps = sandbox_capabilities();
    eprintln!("sandbox capabilities: {caps:#?}");
    assert!(caps.python.is_some(), "no python3: {caps:?}");
    if !caps.user_namespace {
        eprintln!(
            "NOTE: namespaces unavailable, rlimit-only sandbox: {:?}",
            caps.notes
        );
    }
}

#[test]
fn plain_values_round_trip_and_subclasses_are_refused() {
    // The one encoding both graders use (src/plain_values.py): non-finite floats, sets, bytes,
    // nested containers and a raised exception's args reach the judge as genuine built-ins.
    let t = CodeTask {
        id: "plain/values".into(),
        prompt: "values".into(),
        entry_point: "f".into(),
        tests: vec![
            "import math\nassert math.isnan(f('nan')) and f('inf') == float('inf')".into(),
            "assert f('set') == {3, 1, 2} and type(f('set')) is set".into(),
            "assert f('nested') == {'k': (b'\\x00\\xff', frozenset({1}), [None, True])}".into(),
            "try:\n    f('raise')\nexcept KeyError as e:\n    assert e.args == ('missing', 7)\n\
             else:\n    assert False"
                .into(),
        ],
    };
    let honest = "def f(kind):\n    if kind in ('nan', 'inf'):\n        return float(kind)\n\
                  \x20   if kind == 'set':\n        return {1, 2, 3}\n\
                  \x20   if kind == 'nested':\n        return {'k': (b'\\x00\\xff', frozenset({1}), [None, True])}\n\
                  \x20   raise KeyError('missing', 7)\n";
    let r = grade(honest, &t, &limits(), RewardMode::FractionPassed);
    assert_eq!((r.passed, r.total), (4, 4), "{r:#?}");
    // An int subclass equal to everything is not a plain value: every call fails.
    let cheat = "class Any(int):\n    def __eq__(self, o):\n        return True\n\
                 \x20   __hash__ = int.__hash__\n\
                 def f(kind):\n    return Any(0)\n";
    let r = grade(cheat, &t, &limits(), RewardMode::FractionPassed);
    assert_eq!(r.passed, 0, "{r:#?}");
    assert!(
        r.feedback.contains("not a plain built-in value"),
        "{}",
        r.feedback
    );
}

/// A module rewritten with the same size within the same second runs its new code (Python
/// checks cached bytecode by mtime and size only; the sandbox writes none).
#[test]
fn a_rewritten_module_never_runs_stale_bytecode() {
    let sb = Sandbox::new(limits()).expect("sandbox");
    let run = |body: &str| {
        sb.write_file("m.py", format!("def f():\n    {body}\n").as_bytes())
            .unwrap();
        sb.run(
            &["python3", "-c", "import m; print(m.f())"],
            b"",
            Duration::from_secs(20),
        )
    };
    let before = run("return 'old value'");
    assert_eq!(before.stdout.trim(), "old value", "{before:?}");
    let after = run("return 'new value'");
    assert_eq!(after.stdout.trim(), "new value", "{after:?}");
}
