//! Grading a repository episode so that the candidate's code cannot game it.
//!
//! ```text
//! parent (trusted, Rust): forwards each line, never runs Python itself
//!  ├─ judge sandbox: empty; python3 -I -S -B -c JUDGE (the sandbox's interpreter), hidden test modules on stdin
//!  │     runs every `test_*` function with repository imports replaced by stand-ins
//!  └─ grading sandbox: a fresh copy of the task's repo/ + the working copy's source_files
//!        one python3 -I -S -B -c COMPUTE per hidden test (a fresh import, a fresh state):
//!        imports the candidate's modules and serves the judge's requests
//! ```
//!
//! The judge never loads candidate code: `import pkg.mod` in a hidden test gives a stand-in
//! (`Remote`), and each attribute read, call or operator on it is a request the parent forwards
//! to the candidate's process of that test; the reply is a plain value (exact built-in types)
//! or a reference to an object that stays in the candidate's process (instances, iterators,
//! bound methods), which the test can use in turn. Repository classes become local classes (so
//! `isinstance` and `except pkg.Error` work) and the repository's exceptions are raised in the
//! judge as instances of them; the test's own callables (`key=lambda ...`) are called back. So
//! tests of classes, stateful objects, generators and exceptions grade like plain functions.
//! What keeps it honest:
//! - hidden tests and expected values never exist in a sandbox where candidate code runs (the
//!   judge's sandbox gets them on stdin; the candidate's process only sees the requests:
//!   call arguments, attribute names, and the operands of operators on its own objects);
//! - the verdict comes from the judge's fd 3, a process the candidate never runs in; whatever
//!   the candidate writes is at most a claim about what its code returned (a malformed or
//!   unexpected message fails the test);
//! - a reference is never equal to, unequal to or ordered against a plain value (the judge does
//!   not ask the code), and an operator between a reference and a plain value (`f(x) - y`), or
//!   a unary numeric one (`abs`, `-`, `round`), counts only when it answers another reference,
//!   so an object whose `__eq__`/`__lt__` answers True or whose `__sub__` answers 0.0 cannot
//!   pass `assert f(x) == y` or `assert abs(f(x) - y) < eps`; a `__exit__` cannot swallow a
//!   failed assert;
//! - the tests are the `test*` functions the hidden files define, read from their source and
//!   announced to this process before the code answers anything; each gets exactly one verdict
//!   (none given is a failure), so a star import cannot add, replace or shadow tests,
//!   built-ins or the file's own names (`import math`, helpers), a failing module top fails
//!   every test of its file instead of counting once, and a generator or coroutine test (which
//!   would pass unrun) fails;
//! - each test gets a share of the budget (`per_test`), so many short turns (an endless
//!   generator) fail that test, not the rest; a reply the judge cannot read fails its test;
//! - messages travel between the judge and the code as their own bytes (never re-serialised:
//!   serde_json's `Value` would turn integers past u64 into floats and move some floats by an
//!   ulp, failing honest code and passing wrong code);
//! - a failure of the candidate's process (no answer, a crash, an exit, SystemExit, a time-out,
//!   StopIteration/AttributeError where they would steer the test's control flow) fails the test
//!   even when the test catches exceptions;
//! - the grading copy holds only the files matching `[grade] source_files`, never runner
//!   configuration (`conftest.py`, `sitecustomize.py`, `*.pth`, ...), and Python runs with
//!   `-I -S` (no site, no user site, no environment).
//!
//! Each test runs against a fresh process of the code, in a fresh copy of the grading sandbox
//! (so nothing a test's process was sent and wrote down — an operand like `y` of `f(x) - y` —
//! is there for the next test's): the requests the test module made at its top are made again
//! there first, in order, so module-level objects exist (fresh) in every test, as if the module
//! had just been imported; changes a test makes to them are not seen by the next test (under
//! pytest they would be).
//!
//! Limits: the test's own non-callable objects cannot be passed to the code; two of the code's
//! objects compare by the code's own `__eq__` (a candidate may rewrite it, as it may rewrite any
//! graded file); module-level requests must be deterministic to be replayed. What a test asks
//! of an object the code returned — `x in obj`, `len(obj)`, `obj.startswith(...)`, `bool(obj)`
//! — is the code's answer: where a function should return a plain value, a test that checks it
//! by `==` against a plain value is immune, one that only probes it this way is not (a
//! repository class's objects are probed this way legitimately, so the judge cannot refuse it).
//! An operator with a plain operand whose honest answer is plain (`Fraction(1, 2) + 0.5`) fails
//! its test: compare such results through plain values (`float(...)`).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use composer_sandbox::{with_plain_values, NetworkPolicy, Sandbox, SandboxLimits, Session};
use serde::Serialize;
use serde_json::{json, Value};

use super::task::{RepoRewardMode, RepoTask};

/// The judge and compute harnesses; each runs after composer-sandbox's plain-value prelude
/// (one encoding for both graders).
const JUDGE_PY: &str = include_str!("judge.py");
const COMPUTE_PY: &str = include_str!("compute.py");
/// Names never taken from the working copy, whatever the globs say.
const FORBIDDEN: &[&str] = &[
    "conftest.py",
    "sitecustomize.py",
    "usercustomize.py",
    "pytest.ini",
    "setup.cfg",
    "tox.ini",
    "pyproject.toml",
];

/// The result of grading one submission.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RepoGrade {
    /// Hidden test functions passed.
    pub passed: usize,
    /// Hidden test functions in the task.
    pub total: usize,
    /// The reward in [0, 1].
    pub reward: f64,
    /// `module::test` names of the failed tests with their errors (never their source).
    pub failed: Vec<(String, String)>,
    /// Set when grading itself failed (the reward is then 0).
    pub error: Option<String>,
}

impl RepoGrade {
    /// A zero grade for a grading failure.
    pub fn failure(reason: String) -> RepoGrade {
        RepoGrade {
            passed: 0,
            total: 0,
            reward: 0.0,
            failed: Vec::new(),
            error: Some(reason),
        }
    }

    /// Text feedback for the agent: the counts, then the failed tests and their errors.
    pub fn feedback(&self) -> String {
        let mut s = format!("passed {}/{} hidden tests", self.passed, self.total);
        if let Some(e) = &self.error {
            s.push_str(&format!("; grading error: {e}"));
        }
        for (name, err) in self.failed.iter().take(20) {
            s.push_str(&format!("\nFAILED {name}: {err}"));
        }
        s
    }
}

/// Whether `glob` is a plain repo-relative glob (no absolute path, no `..`, not empty).
pub fn valid_glob(glob: &str) -> bool {
    !glob.is_empty()
        && !glob.starts_with('/')
        && !glob.contains('\\')
        && glob
            .split('/')
            .all(|s| !s.is_empty() && s != ".." && s != ".")
}

/// Matches one path segment against a pattern with `*` and `?`.
fn match_segment(pat: &[u8], s: &[u8]) -> bool {
    match (pat.first(), s.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            match_segment(&pat[1..], s) || (!s.is_empty() && match_segment(pat, &s[1..]))
        }
        (Some(b'?'), Some(_)) => match_segment(&pat[1..], &s[1..]),
        (Some(p), Some(c)) if p == c => match_segment(&pat[1..], &s[1..]),
        _ => false,
    }
}

/// Whether the repo-relative `path` matches `glob` (`*`/`?` within a segment, `**` any
/// number of segments).
pub fn glob_match(glob: &str, path: &str) -> bool {
    fn rec(g: &[&str], p: &[&str]) -> bool {
        match g.first() {
            None => p.is_empty(),
            Some(&"**") => rec(&g[1..], p) || (!p.is_empty() && rec(g, &p[1..])),
            Some(seg) => {
                !p.is_empty()
                    && match_segment(seg.as_bytes(), p[0].as_bytes())
                    && rec(&g[1..], &p[1..])
            }
        }
    }
    let g: Vec<&str> = glob.split('/').collect();
    let p: Vec<&str> = path.split('/').collect();
    rec(&g, &p)
}

/// Whether a file name may never be taken from the working copy.
pub fn forbidden_source_file(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    FORBIDDEN.contains(&name) || name.ends_with(".pth")
}

/// Deepest directory nesting [`walk_files`] reads: a working copy is the candidate's, and one
/// nested 40,000 levels deep must be an error, not a walk that exhausts a stack or the
/// descriptors (the sandbox removes such a tree itself: composer-sandbox's `exec/tree.rs`).
const MAX_WALK_DEPTH: usize = 64;

/// Every regular file under `root` (not following symlinks), as sorted repo-relative paths;
/// an error past [`MAX_WALK_DEPTH`] levels. Iterative: one directory open at a time.
pub fn walk_files(root: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut pending: Vec<(String, usize)> = vec![(String::new(), 0)];
    while let Some((rel, depth)) = pending.pop() {
        if depth > MAX_WALK_DEPTH {
            bail!(
                "{} nests directories deeper than {MAX_WALK_DEPTH} levels (at {rel})",
                root.display()
            );
        }
        let dir = if rel.is_empty() {
            root.to_path_buf()
        } else {
            root.join(&rel)
        };
        for e in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let e = e?;
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let child = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let meta = std::fs::symlink_metadata(e.path())?;
            if meta.is_dir() {
                pending.push((child, depth + 1));
            } else if meta.is_file() {
                out.push(child);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The working copy's files the grader takes: matching a glob, regular, not forbidden.
pub fn select_source_files(working: &Path, globs: &[String]) -> Result<Vec<String>> {
    Ok(walk_files(working)?
        .into_iter()
        .filter(|p| !forbidden_source_file(p) && globs.iter().any(|g| glob_match(g, p)))
        .filter(|p| !p.split('/').any(|s| s.starts_with('.')))
        .collect())
}

/// Top-level importable names of a repository: `*.py` files and directories holding Python.
pub fn repo_modules(repo: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = walk_files(repo)?
        .iter()
        .filter(|p| p.ends_with(".py"))
        .map(|p| {
            let top = p.split('/').next().unwrap_or(p);
            top.strip_suffix(".py").unwrap_or(top).to_string()
        })
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// The repository modules of a task: those of its `repo/` plus the top-level names of files
/// it deleted whole (`kind = "file"`), which the candidate restores. Only names the trusted
/// task file gives count: a module the candidate adds under another name (say `math.py`)
/// never stands in for a standard library module the hidden tests use.
pub fn task_modules(task: &RepoTask) -> Result<Vec<String>> {
    let mut names = repo_modules(&task.repo_dir())?;
    for r in task.spec.removed.iter().filter(|r| r.kind == "file") {
        let top = r.file.split('/').next().unwrap_or(&r.file);
        names.push(top.strip_suffix(".py").unwrap_or(top).to_string());
    }
    names.sort();
    names.dedup();
    Ok(names)
}

/// The `*.py` files of a hidden-test directory as `(name, source)`, sorted.
pub fn read_test_files(dir: &Path) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for rel in walk_files(dir)? {
        if rel.ends_with(".py") && !rel.contains('/') {
            let text = std::fs::read_to_string(dir.join(&rel))
                .with_context(|| format!("reading {}", dir.join(&rel).display()))?;
            out.push((rel, text));
        }
    }
    Ok(out)
}

fn limits(wall: Duration) -> SandboxLimits {
    SandboxLimits {
        wall_time: wall,
        cpu_time_s: wall.as_secs().max(1),
        max_output_bytes: 4 << 20,
        network: NetworkPolicy::Isolated,
        ..SandboxLimits::default()
    }
}

/// The interpreter of every Python process of repository grading: the sandbox's own
/// ([`composer_sandbox::python_interpreter`]), the one the built-in grader runs.
pub(crate) fn sandbox_python() -> Result<&'static str> {
    composer_sandbox::python_interpreter()
        .and_then(|p| p.to_str())
        .context("no python3 for the sandbox (install python3 or set COMPOSER_SANDBOX_PYTHON)")
}

/// Runs the hidden tests `files` against the code in `code` (a sandbox holding the repository
/// to test) through the judge/compute protocol of this module. Returns `(test, passed, error)`
/// per test function in file order. Errs only when the judge itself fails (or the grading
/// runs out of `budget`).
pub fn run_hidden_tests(
    code: &Sandbox,
    modules: &[String],
    files: &[(String, String)],
    budget: Duration,
) -> Result<Vec<(String, bool, String)>> {
    let deadline = Instant::now() + budget;
    let python = sandbox_python()?;
    let judge_box = Sandbox::new(limits(budget + JUDGE_GRACE))?;
    let judge_py = with_plain_values(JUDGE_PY);
    let judge = judge_box.start(
        &[python, "-I", "-S", "-B", "-c", &judge_py],
        budget + JUDGE_GRACE,
    )?;
    let spec = json!({"modules": modules, "files": files});
    judge.send_line(spec.to_string().as_bytes());
    let per_test = (budget / 4).max(3 * PER_CALL);
    let mut candidate = Candidate::new(code, deadline, per_test);
    let mut verdicts: Vec<(String, bool, String)> = Vec::new();
    let mut plan: Option<Vec<String>> = None;
    let mut done = false;
    while let Some(line) = judge.recv_line(deadline + JUDGE_GRACE) {
        let Ok(msg) = serde_json::from_slice::<Value>(&line) else {
            // Never skipped: the judge would wait for an answer to it forever. (A string the
            // code returned with a lone surrogate is valid to Python's json, not to serde's.)
            bail!(
                "the judge sent a line that is not JSON: {}",
                String::from_utf8_lossy(&line)
                    .chars()
                    .take(200)
                    .collect::<String>()
            );
        };
        if msg["done"] == true {
            done = true;
            break;
        } else if msg.get("begin").is_some() {
            candidate.restart();
        } else if let Some(why) = msg.get("kill") {
            candidate.kill(format!("the judge stopped the code's process: {why}"));
        } else if msg.get("rpc").is_some() {
            // The request's own bytes, not a re-serialised `Value`: serde_json's `Value` turns
            // integers past u64 into floats and may move a float by an ulp.
            let reply = match serde_json::from_slice::<JudgeRpc>(&line) {
                Ok(m) => candidate.forward(m.rpc.get()),
                Err(_) => bail!("the judge sent a malformed request"),
            };
            judge.send_line(reply.as_bytes());
        } else if let Some(keys) = msg.get("plan") {
            // The tests, announced before the code answered anything: the verdicts are these,
            // whatever else arrives.
            if plan.is_some() {
                bail!("the judge announced its tests twice");
            }
            let keys: Option<Vec<String>> = keys
                .as_array()
                .and_then(|a| a.iter().map(|k| k.as_str().map(str::to_string)).collect());
            plan = Some(keys.context("the judge's plan is not a list of test names")?);
        } else if let Some(file) = msg["file"].as_str() {
            let err = msg["error"].as_str().unwrap_or("").to_string();
            verdicts.push((format!("{file}::<module>"), false, err));
        } else if let Some(test) = msg["test"].as_str() {
            let passed = msg["status"] == "pass";
            let err = if passed {
                String::new()
            } else {
                msg["error"].as_str().unwrap_or("failed").to_string()
            };
            verdicts.push((test.to_string(), passed, err));
        }
    }
    drop(candidate);
    if !done {
        let run = judge.finish();
        let why = if Instant::now() >= deadline {
            "grading ran out of time".to_string()
        } else {
            format!("{:?}", run.outcome)
        };
        bail!(
            "the judge did not finish ({why}): {}",
            run.stderr.chars().take(2000).collect::<String>()
        );
    }
    let Some(plan) = plan else {
        bail!("the judge did not announce its tests");
    };
    Ok(planned_verdicts(&plan, verdicts))
}

/// The judge's request line `{"rpc": <request>}`, the request kept as its bytes.
#[derive(serde::Deserialize)]
struct JudgeRpc<'a> {
    #[serde(borrow)]
    rpc: &'a serde_json::value::RawValue,
}

/// One verdict per planned test, in the plan's order: the first verdict the judge gave for
/// it, or a failure where it gave none; verdicts for tests outside the plan are dropped.
fn planned_verdicts(
    plan: &[String],
    verdicts: Vec<(String, bool, String)>,
) -> Vec<(String, bool, String)> {
    let mut out: Vec<(String, bool, String)> = Vec::with_capacity(plan.len());
    for key in plan {
        if out.iter().any(|v| &v.0 == key) {
            continue;
        }
        let v = verdicts.iter().find(|v| &v.0 == key).cloned();
        out.push(v.unwrap_or_else(|| (key.clone(), false, "no verdict from the judge".into())));
    }
    out
}

/// Longest the code's process may stay silent when it has the turn (one call, with its
/// nested callbacks).
const PER_CALL: Duration = Duration::from_secs(10);
/// The judge's time beyond the grading budget (it reports the last verdicts).
const JUDGE_GRACE: Duration = Duration::from_secs(5);

/// The candidate's process of the current hidden test: started at the test's first request,
/// killed when the next test begins (every test gets a fresh process, like a fresh import), in
/// a fresh copy of the code's sandbox: nothing a test's process writes — say an operand it was
/// sent, `y` of `f(x) - y` or `"n=5"` of `"n=5" in f(5)` — is there for the next test's.
struct Candidate<'a> {
    /// The code to test; never run itself, copied for each test.
    template: &'a Sandbox,
    deadline: Instant,
    /// Longest one test may take, all its turns together (an endless generator is many short
    /// turns: without it, one test would spend the whole budget and fail the rest).
    per_test: Duration,
    test_deadline: Instant,
    /// Declared before `copy`: the process goes before its sandbox's files.
    session: Option<Session>,
    copy: Option<Sandbox>,
    dead: Option<String>,
    compute_py: String,
}

impl<'a> Candidate<'a> {
    fn new(template: &'a Sandbox, deadline: Instant, per_test: Duration) -> Self {
        Candidate {
            template,
            deadline,
            per_test,
            test_deadline: deadline,
            session: None,
            copy: None,
            dead: None,
            compute_py: with_plain_values(COMPUTE_PY),
        }
    }

    fn restart(&mut self) {
        self.session = None;
        self.copy = None;
        self.dead = None;
        self.test_deadline = self.deadline.min(Instant::now() + self.per_test);
    }

    fn kill(&mut self, why: String) {
        self.session = None;
        self.copy = None;
        self.dead = Some(why);
    }

    /// A fresh sandbox holding the template's files, and the code's process started in it.
    fn start(&mut self) -> Result<Session> {
        let copy = Sandbox::new(self.template.limits().clone())?;
        copy.copy_tree_from(self.template.host_workdir(), "")?;
        let remaining = self.test_deadline.saturating_duration_since(Instant::now());
        let python = sandbox_python()?;
        let argv = [python, "-I", "-S", "-B", "-c", self.compute_py.as_str()];
        let session = copy.start(&argv, remaining.max(Duration::from_millis(1)))?;
        self.copy = Some(copy);
        Ok(session)
    }

    /// Sends the judge's request (its JSON text) to the code's process and returns the line
    /// that goes back to the judge: `{"code": message}` (the process's next JSON object line,
    /// its bytes as they came; anything else it writes is dropped) or `{"dead": why}`.
    fn forward(&mut self, request: &str) -> String {
        if self.session.is_none() && self.dead.is_none() {
            match self.start() {
                Ok(s) => self.session = Some(s),
                Err(e) => self.dead = Some(format!("the code's process did not start: {e:#}")),
            }
        }
        if let Some(why) = &self.dead {
            return json!({ "dead": why }).to_string();
        }
        let session = self.session.as_ref().expect("started above");
        let turn_deadline = self.test_deadline.min(Instant::now() + PER_CALL);
        if session.send_line(request.as_bytes()) {
            while let Some(line) = session.recv_line(turn_deadline) {
                if let Ok(raw) = serde_json::from_slice::<&serde_json::value::RawValue>(&line) {
                    if raw.get().starts_with('{') {
                        return format!("{{\"code\":{}}}", raw.get());
                    }
                }
            }
        }
        let why = if Instant::now() >= self.deadline {
            "grading ran out of time"
        } else if Instant::now() >= self.test_deadline {
            "the test ran out of its share of the grading time"
        } else if Instant::now() >= turn_deadline {
            "the code took too long to answer"
        } else {
            "the code's process ended before answering (crashed or exited)"
        };
        self.kill(why.to_string());
        json!({ "dead": why }).to_string()
    }
}

/// Grades the working copy at `working` (the episode's sandbox directory, read on the trusted
/// side) for `task`: fresh `repo/` + the selected source files, hidden tests via the judge.
pub fn grade_working_copy(task: &RepoTask, working: &Path) -> RepoGrade {
    match grade_inner(task, working) {
        Ok(g) => g,
        Err(e) => RepoGrade::failure(format!("{e:#}")),
    }
}

fn grade_inner(task: &RepoTask, working: &Path) -> Result<RepoGrade> {
    let budget = Duration::from_secs(task.spec.limits.grade_timeout_s.max(1));
    let selected = select_source_files(working, &task.spec.grade.source_files)?;
    let code = Sandbox::new(limits(budget))?;
    code.copy_tree_from(&task.repo_dir(), "")?;
    let refs: Vec<&str> = selected.iter().map(String::as_str).collect();
    code.copy_files_from(working, &refs)?;
    let modules = task_modules(task)?;
    let files = read_test_files(&task.hidden_tests_dir())?;
    let verdicts = run_hidden_tests(&code, &modules, &files, budget)?;
    Ok(score(&verdicts, task.spec.grade.reward))
}

/// Turns verdicts into a [`RepoGrade`].
pub fn score(verdicts: &[(String, bool, String)], mode: RepoRewardMode) -> RepoGrade {
    let total = verdicts.len();
    let passed = verdicts.iter().filter(|v| v.1).count();
    let reward = match mode {
        _ if total == 0 => 0.0,
        RepoRewardMode::Fraction => passed as f64 / total as f64,
        RepoRewardMode::All => f64::from(u8::from(passed == total)),
    };
    RepoGrade {
        passed,
        total,
        reward,
        failed: verdicts
            .iter()
            .filter(|v| !v.1)
            .map(|v| (v.0.clone(), v.2.clone()))
            .collect(),
        error: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(key: &str, ok: bool) -> (String, bool, String) {
        (key.to_string(), ok, String::new())
    }

    /// A working copy nested past the walk's depth is an error naming it, not a crash; one
    /// at the limit is read.
    #[test]
    fn a_deep_working_copy_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let at_limit = "d/".repeat(MAX_WALK_DEPTH);
        std::fs::create_dir_all(dir.path().join(&at_limit)).unwrap();
        std::fs::write(dir.path().join(&at_limit).join("x.py"), "").unwrap();
        let files = walk_files(dir.path()).unwrap();
        assert_eq!(files, vec![format!("{at_limit}x.py")]);
        std::fs::create_dir_all(dir.path().join(&at_limit).join("d")).unwrap();
        let e = walk_files(dir.path()).unwrap_err().to_string();
        assert!(e.contains("deeper than 64 levels"), "{e}");
    }

    /// The plan decides the tests: a missing verdict fails, an unplanned or repeated one is
    /// dropped, the plan's order is kept.
    #[test]
    fn verdicts_follow_the_plan() {
        let plan = ["m::test_a".to_string(), "m::test_b".to_string()];
        let got = planned_verdicts(
            &plan,
            vec![
                v("m::test_b", true),
                v("m::test_free", true),
                v("m::test_b", false),
            ],
        );
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].0.as_str(), got[0].1), ("m::test_a", false));
        assert_eq!(got[0].2, "no verdict from the judge");
        assert_eq!((got[1].0.as_str(), got[1].1), ("m::test_b", true));
    }
}
