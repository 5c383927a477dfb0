//! Building repository tasks from a Python repository with a test suite: one task per
//! top-level public function whose body can be removed and whose tests notice (`kind =
//! "body"`), and one per non-test module that can be deleted whole and whose tests notice
//! (`kind = "file"`).

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use composer_sandbox::{Sandbox, SandboxLimits};
use serde::Deserialize;

use super::grade::{repo_modules, run_hidden_tests, walk_files};
use super::task::{GradeSpec, Removed, RepoRewardMode, TaskFile, TaskLimits};

const SCAN_PY: &str = include_str!("make_tasks.py");
/// The visible-test runner written into every task's `visible_tests/`.
pub const RUNTESTS_PY: &str = include_str!("runtests.py");
const BUDGET: Duration = Duration::from_secs(120);

#[derive(Deserialize)]
struct Scan {
    functions: Vec<Func>,
    tests: Vec<TestFn>,
    headers: std::collections::BTreeMap<String, Vec<(usize, usize)>>,
    modules: Vec<Module>,
}

/// A non-test module (not `__init__.py`) and its public top-level API.
#[derive(Deserialize)]
struct Module {
    file: String,
    doc: String,
    api: Vec<ApiItem>,
}

#[derive(Deserialize)]
struct ApiItem {
    name: String,
    signature: String,
    doc: String,
}

/// A function or method (`Class.method`) whose body a task removes.
#[derive(Deserialize)]
struct Func {
    file: String,
    name: String,
    doc: String,
    body_start: usize,
    body_end: usize,
    indent: usize,
}

#[derive(Deserialize, Clone)]
struct TestFn {
    file: String,
    name: String,
    start: usize,
    end: usize,
    refs: Vec<String>,
}

impl TestFn {
    fn key(&self) -> String {
        let stem = self.file.rsplit('/').next().unwrap_or(&self.file);
        format!("{}::{}", stem.trim_end_matches(".py"), self.name)
    }
}

/// What [`make_tasks`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MakeTasksReport {
    /// Ids of the tasks written.
    pub created: Vec<String>,
    /// `(function, reason)` of the candidates left out.
    pub skipped: Vec<(String, String)>,
    /// `(test, error)` of the repository's tests that fail on the unmodified repository
    /// (never used as hidden tests; when none passes, [`make_tasks`] refuses instead).
    pub failing_on_original: Vec<(String, String)>,
}

fn sandbox_with(files: &[(String, Vec<u8>)]) -> Result<Sandbox> {
    let sb = Sandbox::new(SandboxLimits {
        wall_time: BUDGET,
        cpu_time_s: BUDGET.as_secs(),
        max_output_bytes: 16 << 20,
        ..SandboxLimits::default()
    })?;
    for (rel, bytes) in files {
        sb.write_file(rel, bytes)?;
    }
    Ok(sb)
}

fn lines_of(text: &str, ranges: &[(usize, usize)]) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    for &(s, e) in ranges {
        for l in lines.iter().take(e).skip(s.saturating_sub(1)) {
            out.push_str(l);
            out.push('\n');
        }
        out.push('\n');
    }
    out
}

/// Test modules holding `tests` (each with its file's header), as `(file name, source)`.
fn test_modules(repo: &Path, scan: &Scan, tests: &[&TestFn]) -> Result<Vec<(String, String)>> {
    let files: BTreeSet<&str> = tests.iter().map(|t| t.file.as_str()).collect();
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(repo.join(file))
            .with_context(|| format!("reading {}", repo.join(file).display()))?;
        let mut ranges = scan.headers.get(file).cloned().unwrap_or_default();
        ranges.extend(
            tests
                .iter()
                .filter(|t| t.file == file)
                .map(|t| (t.start, t.end)),
        );
        let name = file.rsplit('/').next().unwrap_or(file).to_string();
        out.push((name, lines_of(&text, &ranges)));
    }
    Ok(out)
}

/// Builds tasks from the Python repository `repo_dir` into `out_dir/<id>/`:
/// - for each public top-level function of a non-test module, its body is replaced with
///   `raise NotImplementedError` (`kind = "body"`, id `<module path>-<function>`);
/// - for each non-test module other than `__init__.py` with a public API, the whole file is
///   deleted (`kind = "file"`, id `<module path>`); the statement lists the API to restore.
///
/// The test functions that reference the removed code and pass on the original but fail on
/// the broken copy become the hidden tests, the first of them also the visible test.
/// Candidates without such tests are skipped (listed in the report).
///
/// Refused before any scanning: a `repo_dir` that is not a directory, an `out_dir` that
/// exists and is not an empty directory (stale tasks would be served with the new ones),
/// cannot be created or written, or lies inside `repo_dir` (it would be scanned as part of
/// the repository). Refused after the first test run: a repository without test functions,
/// or whose tests all fail on the unmodified code. An `out_dir` this call created is removed
/// again when it fails.
pub fn make_tasks(repo_dir: &Path, out_dir: &Path) -> Result<MakeTasksReport> {
    let created_out = check_dirs(repo_dir, out_dir)?;
    let made = build(repo_dir, out_dir);
    if made.is_err() && created_out {
        let _ = std::fs::remove_dir_all(out_dir);
    }
    made
}

/// The checks of [`make_tasks`] on its two directories, before the expensive work; creates
/// `out_dir` (returns whether it was created here).
fn check_dirs(repo_dir: &Path, out_dir: &Path) -> Result<bool> {
    match std::fs::metadata(repo_dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => bail!(
            "the repository (--repo) {} is not a directory",
            repo_dir.display()
        ),
        Err(e) => bail!(
            "the repository (--repo) {} cannot be read: {e}",
            repo_dir.display()
        ),
    }
    let existed = match std::fs::symlink_metadata(out_dir) {
        Ok(m) if m.is_dir() => {
            let mut entries = std::fs::read_dir(out_dir)
                .with_context(|| format!("reading the output (--out) {}", out_dir.display()))?;
            if let Some(first) = entries.next() {
                let first = first?.file_name();
                bail!(
                    "the output (--out) {} is not empty (it holds {:?}): make-tasks writes \
                     into a new or empty directory, so that no stale task is served with the \
                     new ones",
                    out_dir.display(),
                    first
                );
            }
            true
        }
        Ok(_) => bail!(
            "the output (--out) {} exists and is not a directory",
            out_dir.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => bail!(
            "the output (--out) {} cannot be read: {e}",
            out_dir.display()
        ),
    };
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("the output (--out) {} cannot be created", out_dir.display()))?;
    let refuse = |msg: String| -> Result<bool> {
        if !existed {
            let _ = std::fs::remove_dir_all(out_dir);
        }
        bail!(msg)
    };
    let probe = out_dir.join(".make-tasks-probe");
    if let Err(e) = std::fs::write(&probe, b"") {
        return refuse(format!(
            "the output (--out) {} is not writable: {e}",
            out_dir.display()
        ));
    }
    let _ = std::fs::remove_file(&probe);
    let (repo_real, out_real) = (repo_dir.canonicalize()?, out_dir.canonicalize()?);
    if out_real.starts_with(&repo_real) {
        return refuse(format!(
            "the output (--out) {} is inside the repository (--repo) {}: the tasks would be \
             scanned as part of the repository; choose a directory outside it",
            out_dir.display(),
            repo_dir.display()
        ));
    }
    Ok(!existed)
}

/// [`make_tasks`] after its directory checks.
fn build(repo_dir: &Path, out_dir: &Path) -> Result<MakeTasksReport> {
    let all = walk_files(repo_dir)?;
    let mut files = Vec::new();
    for rel in all.iter().filter(|p| {
        !p.split('/')
            .any(|s| s.starts_with('.') || s == "__pycache__")
    }) {
        files.push((rel.clone(), std::fs::read(repo_dir.join(rel))?));
    }
    let scanner = sandbox_with(&files)?;
    let python = super::grade::sandbox_python()?;
    let run = scanner.run(&[python, "-I", "-S", "-B", "-c", SCAN_PY], b"", BUDGET);
    let scan: Scan = serde_json::from_str(&run.stdout).with_context(|| {
        format!(
            "scanning {} failed ({:?}): {}",
            repo_dir.display(),
            run.outcome,
            run.stderr
        )
    })?;
    drop(scanner);
    if scan.tests.is_empty() {
        bail!(
            "no test functions in {}: make-tasks needs `test_*` functions in test modules \
             (`test_*.py`, or modules under a `tests/` directory)",
            repo_dir.display()
        );
    }
    // The task's repo/: everything but the test modules.
    let base: Vec<(String, Vec<u8>)> = files
        .into_iter()
        .filter(|(rel, _)| !scan.headers.contains_key(rel))
        .collect();
    let modules = repo_modules(repo_dir)?;
    let modules: Vec<String> = modules
        .into_iter()
        .filter(|m| {
            base.iter()
                .any(|(r, _)| r == &format!("{m}.py") || r.starts_with(&format!("{m}/")))
        })
        .collect();
    // Which tests pass on the original at all.
    let all_tests: Vec<&TestFn> = scan.tests.iter().collect();
    let original = sandbox_with(&base)?;
    let verdicts = run_hidden_tests(
        &original,
        &modules,
        &test_modules(repo_dir, &scan, &all_tests)?,
        BUDGET,
    )?;
    drop(original);
    let failing_on_original: Vec<(String, String)> = verdicts
        .iter()
        .filter(|v| !v.1)
        .map(|v| (v.0.clone(), v.2.clone()))
        .collect();
    let passing: BTreeSet<String> = verdicts.into_iter().filter(|v| v.1).map(|v| v.0).collect();
    if passing.is_empty() {
        let shown: Vec<String> = failing_on_original
            .iter()
            .take(5)
            .map(|(t, e)| format!("{t}: {e}"))
            .collect();
        bail!(
            "the repository's tests fail on the unmodified repository {} (all {} of them; \
             make-tasks needs tests that pass before anything is removed): {}",
            repo_dir.display(),
            failing_on_original.len(),
            shown.join("; ")
        );
    }
    let maker = Maker {
        repo_dir,
        out_dir,
        scan: &scan,
        modules: &modules,
        passing: &passing,
    };

    let mut report = MakeTasksReport {
        failing_on_original,
        ..MakeTasksReport::default()
    };
    for f in &scan.functions {
        let label = format!("{}:{}", f.file, f.name);
        let Some((_, orig)) = base.iter().find(|(r, _)| r == &f.file) else {
            continue;
        };
        let text = String::from_utf8_lossy(orig);
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        if f.body_end > lines.len() || f.body_start == 0 || f.body_start > f.body_end {
            report.skipped.push((label, "bad line range".into()));
            continue;
        }
        lines.splice(
            f.body_start - 1..f.body_end,
            [format!("{}raise NotImplementedError", " ".repeat(f.indent))],
        );
        let broken_text = lines.join("\n") + "\n";
        let broken: Vec<(String, Vec<u8>)> = base
            .iter()
            .map(|(r, b)| {
                if r == &f.file {
                    (r.clone(), broken_text.clone().into_bytes())
                } else {
                    (r.clone(), b.clone())
                }
            })
            .collect();
        let doc = if f.doc.is_empty() {
            "(no docstring)".to_string()
        } else {
            f.doc.clone()
        };
        let glob = source_glob(&f.file);
        let candidate = Candidate {
            id: format!(
                "{}-{}",
                f.file.trim_end_matches(".py").replace('/', "-"),
                f.name.replace('.', "-")
            ),
            title: format!("Implement `{}` in {}", f.name, f.file),
            statement: format!(
                "`{name}` in `{file}` is not implemented: its body was removed and it raises \
                 NotImplementedError. Implement it as documented:\n\n{doc}\n\nRun the visible \
                 tests with `python3 visible_tests/runtests.py`; hidden tests exercise `{name}` \
                 further. Only files matching `{glob}` are graded.\n",
                name = f.name,
                file = f.file,
            ),
            removed: Removed {
                file: f.file.clone(),
                kind: "body".into(),
                symbols: vec![f.name.clone()],
            },
            // A method is referenced by its own name (`s.push(...)`).
            refs: vec![f.name.rsplit('.').next().unwrap_or(&f.name).to_string()],
            broken,
        };
        maker.make(candidate, label, &mut report)?;
    }
    for m in &scan.modules {
        let label = m.file.clone();
        if m.api.is_empty() {
            report.skipped.push((
                label,
                "the module has no public functions or classes".into(),
            ));
            continue;
        }
        let stem = m.file.trim_end_matches(".py");
        let broken: Vec<(String, Vec<u8>)> =
            base.iter().filter(|(r, _)| r != &m.file).cloned().collect();
        let glob = source_glob(&m.file);
        let mut api = String::new();
        for a in &m.api {
            api.push_str(&format!("\n{}\n", a.signature));
            if !a.doc.is_empty() {
                api.push_str(&format!("    {}\n", a.doc.replace('\n', "\n    ")));
            }
        }
        let doc = if m.doc.is_empty() {
            String::new()
        } else {
            format!("Its docstring was: {}\n\n", m.doc)
        };
        let mut refs: Vec<String> = m.api.iter().map(|a| a.name.clone()).collect();
        refs.push(stem.rsplit('/').next().unwrap_or(stem).to_string());
        let candidate = Candidate {
            id: stem.replace('/', "-"),
            title: format!("Restore the module {}", m.file),
            statement: format!(
                "The module `{file}` was deleted, so everything that uses it fails. Write it \
                 again. {doc}It must provide (signatures and docstrings of the original):\n\
                 {api}\nRun the visible tests with `python3 visible_tests/runtests.py`; hidden \
                 tests exercise the module further. Only files matching `{glob}` are graded.\n",
                file = m.file,
            ),
            removed: Removed {
                file: m.file.clone(),
                kind: "file".into(),
                symbols: m.api.iter().map(|a| a.name.clone()).collect(),
            },
            refs,
            broken,
        };
        maker.make(candidate, label, &mut report)?;
    }
    if report.created.is_empty() {
        let why: Vec<String> = report
            .skipped
            .iter()
            .take(10)
            .map(|(what, why)| format!("{what}: {why}"))
            .collect();
        bail!(
            "no task could be made from {}: {}",
            repo_dir.display(),
            why.join("; ")
        );
    }
    Ok(report)
}

/// The grading glob for a task whose removed code lives in `file`: the `*.py` of its directory.
fn source_glob(file: &str) -> String {
    match file.rsplit_once('/') {
        Some((d, _)) => format!("{d}/*.py"),
        None => "*.py".to_string(),
    }
}

/// One task to be: the broken copy of the repository and what to write about it.
struct Candidate {
    id: String,
    title: String,
    statement: String,
    removed: Removed,
    /// Names a test must reference to be a hidden test of this task.
    refs: Vec<String>,
    broken: Vec<(String, Vec<u8>)>,
}

/// What every candidate is checked against.
struct Maker<'a> {
    repo_dir: &'a Path,
    out_dir: &'a Path,
    scan: &'a Scan,
    modules: &'a [String],
    passing: &'a BTreeSet<String>,
}

impl Maker<'_> {
    /// Keeps the tests that reference the candidate, pass on the original and fail on the
    /// broken copy; writes the task when there are any, else records why not.
    fn make(&self, c: Candidate, label: String, report: &mut MakeTasksReport) -> Result<()> {
        if report.created.contains(&c.id) {
            report
                .skipped
                .push((label, format!("the id {:?} is taken by another task", c.id)));
            return Ok(());
        }
        let tests: Vec<&TestFn> = self
            .scan
            .tests
            .iter()
            .filter(|t| {
                t.refs.iter().any(|r| c.refs.contains(r)) && self.passing.contains(&t.key())
            })
            .collect();
        if tests.is_empty() {
            report.skipped.push((
                label,
                "no test references it and passes on the original".into(),
            ));
            return Ok(());
        }
        let sb = sandbox_with(&c.broken)?;
        let v = run_hidden_tests(
            &sb,
            self.modules,
            &test_modules(self.repo_dir, self.scan, &tests)?,
            BUDGET,
        )?;
        let failing: BTreeSet<String> = v.into_iter().filter(|v| !v.1).map(|v| v.0).collect();
        let kept: Vec<&TestFn> = tests
            .into_iter()
            .filter(|t| failing.contains(&t.key()))
            .collect();
        if kept.is_empty() {
            report
                .skipped
                .push((label, "no test fails when it is removed".into()));
            return Ok(());
        }
        self.write_task(&c, &kept)?;
        report.created.push(c.id);
        Ok(())
    }

    fn write_task(&self, c: &Candidate, kept: &[&TestFn]) -> Result<()> {
        let dir = self.out_dir.join(&c.id);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("replacing {}", dir.display()))?;
        }
        let put = |rel: &str, bytes: &[u8]| -> Result<()> {
            let p = dir.join(rel);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&p, bytes).with_context(|| format!("writing {}", p.display()))
        };
        for (rel, bytes) in &c.broken {
            put(&format!("repo/{rel}"), bytes)?;
        }
        // A task whose only module was deleted still needs its repo/ directory.
        std::fs::create_dir_all(dir.join("repo"))
            .with_context(|| format!("creating {}", dir.join("repo").display()))?;
        for (name, src) in test_modules(self.repo_dir, self.scan, kept)? {
            put(&format!("hidden_tests/{name}"), src.as_bytes())?;
        }
        for (name, src) in test_modules(self.repo_dir, self.scan, &kept[..1])? {
            put(&format!("visible_tests/{name}"), src.as_bytes())?;
        }
        put("visible_tests/runtests.py", RUNTESTS_PY.as_bytes())?;
        let spec = TaskFile {
            id: c.id.clone(),
            title: c.title.clone(),
            statement: c.statement.clone(),
            visible_test_command: "python3 visible_tests/runtests.py".into(),
            limits: TaskLimits::default(),
            grade: GradeSpec {
                source_files: vec![source_glob(&c.removed.file)],
                reward: RepoRewardMode::Fraction,
            },
            removed: vec![c.removed.clone()],
        };
        let text = toml::to_string(&spec).context("serialising task.toml")?;
        put("task.toml", text.as_bytes())
    }
}
