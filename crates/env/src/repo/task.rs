//! Repository tasks on disk: `DIR/<id>/{task.toml, repo/, visible_tests/, hidden_tests/}`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// Per-episode limits of a task (`[limits]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskLimits {
    /// Tool calls before the episode ends (and is graded).
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    /// Longest `run_shell` / `run_tests` call in seconds.
    #[serde(default = "default_shell_timeout")]
    pub shell_timeout_s: u64,
    /// Wall-clock budget of grading in seconds.
    #[serde(default = "default_grade_timeout")]
    pub grade_timeout_s: u64,
}

fn default_max_turns() -> u32 {
    60
}
fn default_shell_timeout() -> u64 {
    30
}
fn default_grade_timeout() -> u64 {
    120
}

impl Default for TaskLimits {
    fn default() -> Self {
        TaskLimits {
            max_turns: default_max_turns(),
            shell_timeout_s: default_shell_timeout(),
            grade_timeout_s: default_grade_timeout(),
        }
    }
}

/// How hidden-test results become a reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RepoRewardMode {
    /// passed / total hidden test functions.
    #[default]
    Fraction,
    /// 1.0 when every hidden test passed, else 0.0.
    All,
}

/// What the grader takes from the working copy (`[grade]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GradeSpec {
    /// Repo-relative globs (`*`, `?`, `**`) of the files taken from the working copy.
    pub source_files: Vec<String>,
    /// Reward mode.
    #[serde(default)]
    pub reward: RepoRewardMode,
}

/// One deleted piece of the repository (`[[removed]]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Removed {
    /// Repo-relative file.
    pub file: String,
    /// `"body"` (the symbols' bodies raise NotImplementedError) or `"file"` (whole file).
    pub kind: String,
    /// The symbols whose bodies were removed.
    #[serde(default)]
    pub symbols: Vec<String>,
}

/// The contents of `task.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskFile {
    /// Task id (must equal the directory name).
    pub id: String,
    /// One-line title.
    pub title: String,
    /// The statement shown to the agent, written like an issue.
    pub statement: String,
    /// Command run by `run_tests` from the working-copy root.
    pub visible_test_command: String,
    /// Episode limits.
    #[serde(default)]
    pub limits: TaskLimits,
    /// Grading.
    pub grade: GradeSpec,
    /// What was removed.
    #[serde(default)]
    pub removed: Vec<Removed>,
}

/// A loaded task: its `task.toml` and its directory.
#[derive(Debug, Clone, PartialEq)]
pub struct RepoTask {
    /// The parsed `task.toml`.
    pub spec: TaskFile,
    /// The task directory (holding `repo/`, `visible_tests/`, `hidden_tests/`).
    pub dir: PathBuf,
}

impl RepoTask {
    /// The task id.
    pub fn id(&self) -> &str {
        &self.spec.id
    }
    /// `repo/` (the code base with the feature removed; trusted).
    pub fn repo_dir(&self) -> PathBuf {
        self.dir.join("repo")
    }
    /// `visible_tests/`.
    pub fn visible_tests_dir(&self) -> PathBuf {
        self.dir.join("visible_tests")
    }
    /// `hidden_tests/` (read only by the trusted grader).
    pub fn hidden_tests_dir(&self) -> PathBuf {
        self.dir.join("hidden_tests")
    }
}

/// Loads one task directory. Errors name the file and, for bad TOML, the key.
pub fn load_task(dir: &Path) -> Result<RepoTask> {
    let file = dir.join("task.toml");
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let spec: TaskFile =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    let at = file.display();
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if spec.id != name {
        bail!(
            "{at}: key `id` ({:?}) must equal the directory name ({name:?})",
            spec.id
        );
    }
    for (key, value) in [
        ("title", &spec.title),
        ("statement", &spec.statement),
        ("visible_test_command", &spec.visible_test_command),
    ] {
        if value.trim().is_empty() {
            bail!("{at}: key `{key}` is empty");
        }
    }
    if spec.grade.source_files.is_empty() {
        bail!("{at}: key `grade.source_files` is empty");
    }
    if let Some(g) = spec
        .grade
        .source_files
        .iter()
        .find(|g| !super::grade::valid_glob(g))
    {
        bail!("{at}: key `grade.source_files`: {g:?} is not a repo-relative glob");
    }
    if spec.limits.max_turns == 0 || spec.limits.shell_timeout_s == 0 {
        bail!("{at}: keys `limits.max_turns` and `limits.shell_timeout_s` must be positive");
    }
    for r in &spec.removed {
        if r.kind != "body" && r.kind != "file" {
            bail!(
                "{at}: key `removed.kind` must be \"body\" or \"file\", not {:?}",
                r.kind
            );
        }
        if !super::grade::valid_glob(&r.file) || r.file.contains(['*', '?']) {
            bail!(
                "{at}: key `removed.file`: {:?} is not a repo-relative path",
                r.file
            );
        }
    }
    for sub in ["repo", "visible_tests", "hidden_tests"] {
        if !dir.join(sub).is_dir() {
            bail!("{}: missing directory `{sub}/`", dir.display());
        }
    }
    Ok(RepoTask {
        spec,
        dir: dir.to_path_buf(),
    })
}

/// Loads every task directory under `dir` (subdirectories holding `task.toml`), sorted by id.
pub fn load_tasks(dir: &Path) -> Result<Vec<RepoTask>> {
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("reading task directory {}", dir.display()))?;
    let mut tasks = Vec::new();
    for e in entries {
        let e = e.with_context(|| format!("reading task directory {}", dir.display()))?;
        if e.path().join("task.toml").is_file() {
            tasks.push(load_task(&e.path())?);
        }
    }
    if tasks.is_empty() {
        bail!(
            "{}: no task directories (with task.toml) found",
            dir.display()
        );
    }
    tasks.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
    Ok(tasks)
}
