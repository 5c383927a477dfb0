//! `make_tasks` on a small repository written here: function-body and whole-module tasks,
//! candidates whose tests do not notice are dropped, and a restored top-level module grades.

use std::path::Path;

use composer_env::repo::{load_tasks, make_tasks, EpisodeBudget, RepoEpisode, RepoTask};
use serde_json::json;

const MATHX: &str = r#""""Integer helpers."""


def double(n):
    """Twice `n`."""
    return 2 * n


def half(n):
    """`n` halved, rounded down."""
    return n // 2
"#;

const HELPERS: &str = r#""""Helpers nobody's tests depend on."""


def shout(s):
    """`s` in capitals."""
    return s.upper()
"#;

const TESTS: &str = r#"import math
import mathx
from helpers import shout


def test_double():
    assert mathx.double(4) == 8


def test_half():
    assert mathx.half(7) == math.floor(3.5)


def test_tolerates_missing_helpers():
    try:
        shout
    except Exception:
        pass
    assert 1 + 1 == 2
"#;

fn write(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

fn made() -> (
    tempfile::TempDir,
    Vec<RepoTask>,
    composer_env::repo::MakeTasksReport,
) {
    let src = tempfile::tempdir().unwrap();
    write(src.path(), "mathx.py", MATHX);
    write(src.path(), "helpers.py", HELPERS);
    write(src.path(), "tests/test_mathx.py", TESTS);
    let out = tempfile::tempdir().unwrap();
    let report = make_tasks(src.path(), out.path()).expect("make_tasks works");
    let tasks = load_tasks(out.path()).expect("made tasks load");
    (out, tasks, report)
}

fn submit_with(task: &RepoTask, files: &[(&str, &str)]) -> f64 {
    let mut ep = RepoEpisode::new(task, EpisodeBudget::default()).unwrap();
    for (path, content) in files {
        ep.call_tool("write_file", &json!({"path": path, "content": content}))
            .unwrap();
    }
    let out = ep.call_tool("submit", &json!({})).unwrap();
    out.grade.expect("graded").reward
}

#[test]
fn module_deletion_tasks_are_made_checked_and_gradable() {
    let (_out, tasks, report) = made();
    let mut ids = report.created.clone();
    ids.sort();
    assert_eq!(ids, ["mathx", "mathx-double", "mathx-half"], "{report:?}");
    // `helpers` is referenced only by a test that passes without it: dropped, with the reason.
    assert!(
        report
            .skipped
            .iter()
            .any(|(what, why)| what == "helpers.py" && why.contains("no test fails")),
        "{report:?}"
    );
    let module = tasks.iter().find(|t| t.id() == "mathx").unwrap();
    let removed = &module.spec.removed[0];
    assert_eq!(
        (removed.file.as_str(), removed.kind.as_str()),
        ("mathx.py", "file")
    );
    assert_eq!(removed.symbols, ["double", "half"]);
    assert!(!module.repo_dir().join("mathx.py").exists());
    assert!(module.repo_dir().join("helpers.py").exists());
    // The statement gives the API to restore, never the bodies.
    let st = &module.spec.statement;
    assert!(
        st.contains("def double(n)") && st.contains("rounded down"),
        "{st}"
    );
    assert!(!st.contains("n // 2"), "{st}");
    let hidden = std::fs::read_to_string(module.hidden_tests_dir().join("test_mathx.py")).unwrap();
    assert!(hidden.contains("def test_double") && hidden.contains("def test_half"));
    assert!(
        !hidden.contains("test_tolerates_missing_helpers"),
        "{hidden}"
    );

    // Restoring the deleted top-level module scores 1; doing nothing scores 0.
    assert_eq!(submit_with(module, &[("mathx.py", MATHX)]), 1.0);
    assert_eq!(submit_with(module, &[]), 0.0);
}

#[test]
fn attack_shadowing_a_stdlib_module_the_tests_use_scores_zero() {
    // The grading glob of a top-level module task is `*.py`, so the candidate can add
    // `math.py`; the hidden test computes its expected value with `math.floor`. Only the
    // task's own modules are answered by candidate code, so the shadow is never consulted.
    let (_out, tasks, _) = made();
    let module = tasks.iter().find(|t| t.id() == "mathx").unwrap();
    let cheat = "def double(n):\n    return 2 * n\n\n\ndef half(n):\n    return 99\n";
    let fake_math = "def floor(x):\n    return 99\n";
    let r = submit_with(module, &[("mathx.py", cheat), ("math.py", fake_math)]);
    assert_eq!(r, 0.5, "only test_double may pass");
}
