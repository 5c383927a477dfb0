//! Grading a repository episode so that the candidate's code cannot game it.
//!
//! ```text
//! parent (trusted, Rust)
//!  ├─ grading sandbox: a fresh copy of the task's repo/ + the working copy's source_files
//!  │     python3 -I -S -B -c COMPUTE: imports the candidate's modules, calls the requested
//!  │     functions on decoded plain arguments, answers with exact-type encoded values
//!  └─ judge sandbox: empty; python3 -I -S -B -c JUDGE, hidden test modules on stdin
//!        runs every `test_*` function with repository imports replaced by proxies
//! ```
//!
//! The judge never loads candidate code: an `import pkg.mod` in a hidden test gives a proxy,
//! and a call through it is answered from a per-test memo of the candidate's earlier answers
//! (in call order). A call not answered yet ends that test as *pending* with the request (the
//! arguments only). The parent gathers the pending requests of all tests, has the grading
//! sandbox compute them in one fresh process, adds the answers to the memo and runs the judge
//! again, until no test is pending (tests are deterministic; a changed call fails the test).
//! So:
//! - hidden tests and expected values never exist in a sandbox where candidate code runs (the
//!   judge's sandbox gets them on stdin; the grading sandbox only sees call arguments);
//! - the verdict comes from the judge's stdout, a process the candidate never runs in; the
//!   candidate's output is only parsed as id-tagged answers, so `os._exit(0)`, patched
//!   builtins/`assert`, or printed "passed" lines at most change claimed return values (a
//!   missing answer is a failed call);
//! - values are plain: the harness encodes exact built-in types only, so an object whose
//!   `__eq__` is always true cannot be returned; the judge decodes fresh built-ins;
//! - the grading copy holds only the files matching `[grade] source_files`, never runner
//!   configuration (`conftest.py`, `sitecustomize.py`, `*.pth`, ...), and Python runs with
//!   `-I -S` (no site, no user site, no environment).
//!
//! Limits: hidden tests must reach repository code through functions of plain values
//! (`None`/bool/int/float/str/bytes/list/tuple/set/frozenset/dict); returning other objects
//! (class instances, generators) fails the call; in-place changes to arguments are not seen.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use composer_sandbox::{with_plain_values, NetworkPolicy, Outcome, Sandbox, SandboxLimits};
use serde::Serialize;
use serde_json::{json, Value};

use super::task::{RepoRewardMode, RepoTask};

/// The judge and compute harnesses; each runs after composer-sandbox's plain-value prelude
/// (one encoding for both graders).
const JUDGE_PY: &str = include_str!("judge.py");
const COMPUTE_PY: &str = include_str!("compute.py");
/// Judge/compute rounds before the remaining pending tests fail.
const MAX_ROUNDS: usize = 100;
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

/// Every regular file under `root` (not following symlinks), as sorted repo-relative paths.
pub fn walk_files(root: &Path) -> Result<Vec<String>> {
    fn walk(root: &Path, rel: &str, out: &mut Vec<String>) -> Result<()> {
        let dir = if rel.is_empty() {
            root.to_path_buf()
        } else {
            root.join(rel)
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
                walk(root, &child, out)?;
            } else if meta.is_file() {
                out.push(child);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(root, "", &mut out)?;
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

/// Runs the hidden tests `files` against the code in `code` (a sandbox holding the repository
/// to test) through the judge/compute protocol of this module. Returns `(test, passed, error)`
/// per test function in file order. Errs only when the judge itself fails.
pub fn run_hidden_tests(
    code: &Sandbox,
    modules: &[String],
    files: &[(String, String)],
    budget: Duration,
) -> Result<Vec<(String, bool, String)>> {
    let deadline = Instant::now() + budget;
    let judge = Sandbox::new(limits(Duration::from_secs(30)))?;
    let judge_py = with_plain_values(JUDGE_PY);
    let mut memo: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    let mut verdicts: Vec<(String, bool, String)> = Vec::new();
    for _round in 0..MAX_ROUNDS {
        let spec = json!({"modules": modules, "files": files, "memo": memo});
        let remaining = deadline.saturating_duration_since(Instant::now());
        let run = judge.run(
            &["python3", "-I", "-S", "-B", "-c", &judge_py],
            format!("{spec}\n").as_bytes(),
            remaining.clamp(Duration::from_secs(5), Duration::from_secs(30)),
        );
        if let Outcome::SandboxError(e) = &run.outcome {
            bail!("judge sandbox: {e}");
        }
        let mut done = false;
        let mut pending: Vec<(String, Value)> = Vec::new();
        verdicts.clear();
        for line in run.stdout.lines() {
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            if v["done"] == true {
                done = true;
            } else if let Some(file) = v["file"].as_str() {
                let err = v["error"].as_str().unwrap_or("").to_string();
                verdicts.push((format!("{file}::<module>"), false, err));
            } else if let Some(test) = v["test"].as_str() {
                match v["status"].as_str() {
                    Some("pass") => verdicts.push((test.to_string(), true, String::new())),
                    Some("pending") => {
                        verdicts.push((test.to_string(), false, "no answer".into()));
                        pending.push((test.to_string(), v["request"].clone()));
                    }
                    _ => {
                        let err = v["error"].as_str().unwrap_or("failed").to_string();
                        verdicts.push((test.to_string(), false, err));
                    }
                }
            }
        }
        if !done {
            bail!(
                "the judge did not finish ({:?}): {}",
                run.outcome,
                run.stderr.chars().take(2000).collect::<String>()
            );
        }
        if pending.is_empty() {
            return Ok(verdicts);
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        let answers = if remaining.is_zero() {
            BTreeMap::new()
        } else {
            compute(code, &pending, remaining)
        };
        for (i, (test, request)) in pending.into_iter().enumerate() {
            let res = answers.get(&i).cloned().unwrap_or_else(|| {
                json!({"ok": false, "type": "", "error": "the code's process ended before \
                       answering (crashed, exited, or ran out of time)"})
            });
            memo.entry(test)
                .or_default()
                .push(json!({"req": request, "res": res}));
        }
    }
    for v in verdicts.iter_mut().filter(|v| v.2 == "no answer") {
        v.2 = "too many sequential calls to the code".into();
    }
    Ok(verdicts)
}

/// Has the code's sandbox answer `pending` requests in one fresh process; id → answer.
fn compute(
    code: &Sandbox,
    pending: &[(String, Value)],
    budget: Duration,
) -> BTreeMap<usize, Value> {
    let requests: Vec<Value> = pending
        .iter()
        .enumerate()
        .map(|(i, (_, r))| {
            let mut r = r.clone();
            r["id"] = json!(i);
            r
        })
        .collect();
    let per_call = format!("{:.1}", budget.as_secs_f64().min(10.0));
    let compute_py = with_plain_values(COMPUTE_PY);
    let run = code.run(
        &["python3", "-I", "-S", "-B", "-c", &compute_py, &per_call],
        Value::Array(requests).to_string().as_bytes(),
        budget,
    );
    let mut out = BTreeMap::new();
    for line in run.stdout.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if let Some(id) = v["id"].as_u64().map(|i| i as usize) {
            if id < pending.len() && v.is_object() {
                out.entry(id).or_insert(v);
            }
        }
    }
    out
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
