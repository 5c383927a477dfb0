//! `composer-rl make-tasks --repo R --out D`, the real binary on small Python repositories
//! written here: a function whose tests pass and notice its deletion becomes a task; one no
//! test notices, or whose only tests fail on the original, does not; a repository whose tests
//! fail on the unmodified code is refused with the failing tests named; bad `--repo` / `--out`
//! are refused naming the flag and path, before any scanning, leaving nothing behind.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use composer_env::repo::load_tasks;

const MATHX: &str = r#""""Integer helpers."""


def double(n):
    """Twice `n`."""
    return 2 * n


def unused(n):
    """No test calls this."""
    return n + 1


def ignored(n):
    """Tests mention this but never notice it is gone."""
    return n - 1
"#;

const TESTS: &str = r#"import mathx


def test_double():
    assert mathx.double(4) == 8


def test_mentions_ignored():
    f = mathx.ignored
    assert callable(f)


def test_broken_on_the_original():
    assert mathx.double(1) == 3
"#;

/// A test suite that fails on the unmodified repository.
const FAILING_TESTS: &str = r#"import mathx


def test_double_is_wrong():
    assert mathx.double(2) == 5
"#;

fn write(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

fn make_tasks(repo: &Path, out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(["make-tasks", "--repo"])
        .arg(repo)
        .arg("--out")
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("running composer-rl")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Asserts a refusal: a failing exit with `error: ...` naming all of `needles` on stderr.
fn assert_refused(o: &Output, needles: &[&str]) {
    let (stdout, stderr) = text(o);
    assert!(!o.status.success(), "accepted:\n{stdout}\n{stderr}");
    assert!(stderr.contains("error: "), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{n:?} missing from:\n{stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn make_tasks_keeps_only_functions_whose_passing_tests_notice_the_deletion() {
    let repo = tempfile::tempdir().unwrap();
    write(repo.path(), "mathx.py", MATHX);
    write(repo.path(), "tests/test_mathx.py", TESTS);
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("tasks");
    let o = make_tasks(repo.path(), &out);
    let (stdout, stderr) = text(&o);
    assert!(o.status.success(), "{stdout}\n{stderr}");

    // (a) noticed by a passing test: a task.
    assert!(
        stdout.lines().any(|l| l == "created mathx-double"),
        "{stdout}"
    );
    // (b) no test references `unused`; `ignored` is referenced, but no test fails without it.
    assert!(
        stdout
            .contains("skipped mathx.py:unused: no test references it and passes on the original"),
        "{stdout}"
    );
    assert!(
        stdout.contains("skipped mathx.py:ignored: no test fails when it is removed"),
        "{stdout}"
    );
    // A test failing on the original is reported and never becomes a hidden test.
    assert!(
        stdout
            .contains("not used (fails on the original): test_mathx::test_broken_on_the_original"),
        "{stdout}"
    );

    let tasks = load_tasks(&out).expect("the made tasks load");
    let mut ids: Vec<&str> = tasks.iter().map(|t| t.id()).collect();
    ids.sort();
    assert_eq!(ids, ["mathx", "mathx-double"], "{stdout}");
    let task = tasks.iter().find(|t| t.id() == "mathx-double").unwrap();
    let broken = std::fs::read_to_string(task.repo_dir().join("mathx.py")).unwrap();
    assert!(broken.contains("raise NotImplementedError"), "{broken}");
    assert!(!broken.contains("2 * n"), "{broken}");
    assert!(
        broken.contains("return n + 1"),
        "the other functions stay: {broken}"
    );
    let hidden = std::fs::read_to_string(task.hidden_tests_dir().join("test_mathx.py")).unwrap();
    assert!(hidden.contains("def test_double"), "{hidden}");
    assert!(!hidden.contains("test_broken_on_the_original"), "{hidden}");
    assert!(!hidden.contains("test_mentions_ignored"), "{hidden}");
    assert!(
        !task.repo_dir().join("tests").exists(),
        "tests stay out of repo/"
    );

    // A second run into the same (now non-empty) --out is refused, naming what is there.
    let again = make_tasks(repo.path(), &out);
    assert_refused(&again, &["--out", &out.display().to_string(), "not empty"]);
    assert!(
        load_tasks(&out).is_ok(),
        "the refusal leaves the tasks alone"
    );
}

#[test]
fn make_tasks_refuses_a_repository_whose_tests_fail_on_the_original() {
    let repo = tempfile::tempdir().unwrap();
    write(repo.path(), "mathx.py", MATHX);
    write(repo.path(), "test_mathx.py", FAILING_TESTS);
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("tasks");
    let o = make_tasks(repo.path(), &out);
    assert_refused(
        &o,
        &[
            "fail on the unmodified repository",
            "test_mathx::test_double_is_wrong",
        ],
    );
    assert!(!out.exists(), "the --out it created is removed again");
}

#[test]
fn make_tasks_refuses_a_repository_without_tests() {
    let repo = tempfile::tempdir().unwrap();
    write(repo.path(), "mathx.py", MATHX);
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("tasks");
    assert_refused(&make_tasks(repo.path(), &out), &["no test functions"]);
    assert!(!out.exists());
}

#[test]
fn make_tasks_refuses_bad_directories_before_scanning() {
    let repo = tempfile::tempdir().unwrap();
    write(repo.path(), "mathx.py", MATHX);
    write(repo.path(), "tests/test_mathx.py", TESTS);
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("tasks");

    // --repo missing, or a file.
    let missing = parent.path().join("no-such-repo");
    assert_refused(
        &make_tasks(&missing, &out),
        &["--repo", &missing.display().to_string()],
    );
    let file = parent.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    assert_refused(&make_tasks(&file, &out), &["--repo", "not a directory"]);
    assert!(!out.exists(), "nothing is created for a bad --repo");

    // --out: a file; below a file (cannot be made); non-empty; inside the repository.
    assert_refused(
        &make_tasks(repo.path(), &file),
        &["--out", "not a directory"],
    );
    let below_file = file.join("tasks");
    assert_refused(
        &make_tasks(repo.path(), &below_file),
        &[
            "--out",
            &below_file.display().to_string(),
            "Not a directory",
        ],
    );
    let full = parent.path().join("full");
    write(&full, "keep.txt", "mine");
    assert_refused(
        &make_tasks(repo.path(), &full),
        &["--out", "not empty", "keep.txt"],
    );
    assert_eq!(
        std::fs::read_to_string(full.join("keep.txt")).unwrap(),
        "mine"
    );
    let inside = repo.path().join("tasks");
    assert_refused(
        &make_tasks(repo.path(), &inside),
        &["--out", "inside the repository"],
    );
    assert!(!inside.exists(), "the --out it created is removed again");

    // A missing flag is clap's usage error.
    let o = Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(["make-tasks", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--repo"));
}
