//! The shipped task set and honest agents: full, partial and all-or-nothing credit.

use super::*;

#[test]
fn shipped_tasks_match_make_tasks() {
    let out = tempfile::tempdir().unwrap();
    let report = make_tasks(&root().join("source"), out.path()).expect("make_tasks works");
    assert!(report.created.len() >= 8, "{report:?}");
    // One module-deletion task per textkit module besides the function tasks.
    for module in ["textkit-numbers", "textkit-seqs", "textkit-strings"] {
        assert!(report.created.iter().any(|c| c == module), "{report:?}");
    }
    if std::env::var_os("REGENERATE_REPO_TASKS").is_some() {
        let dest = root().join("tasks");
        let _ = std::fs::remove_dir_all(&dest);
        make_tasks(&root().join("source"), &dest).unwrap();
    }
    let mut made: Vec<String> = report.created.clone();
    made.sort();
    let shipped: Vec<String> = tasks().iter().map(|t| t.id().to_string()).collect();
    assert_eq!(made, shipped);
}

/// The honest agent: looks around, restores the original file, runs the visible tests.
pub(crate) fn honest(task: &RepoTask) -> f64 {
    let mut ep = episode(task);
    let (file, text) = original(task);
    let listed = call(&mut ep, "list_files", json!({})).unwrap();
    // A body task's file is there (broken); a file task's file is gone.
    assert_eq!(
        listed.lines().any(|l| l == file),
        task.spec.removed[0].kind == "body",
        "{listed}"
    );
    let before = call(&mut ep, "run_tests", json!({})).unwrap();
    assert!(before.contains("FAIL"), "{before}");
    call(
        &mut ep,
        "write_file",
        json!({"path": file, "content": text}),
    )
    .unwrap();
    let after = call(&mut ep, "run_tests", json!({})).unwrap();
    assert!(after.starts_with("exit code: 0"), "{after}");
    submit(&mut ep)
}

#[test]
fn honest_agent_scores_one_on_every_shipped_task() {
    for task in tasks() {
        assert_eq!(honest(&task), 1.0, "task {}", task.id());
    }
}

#[test]
fn honest_agent_with_replace_in_file_scores_one() {
    let task = task_for("gcd");
    let mut ep = episode(&task);
    let body = "    a, b = abs(a), abs(b)\n    while b:\n        a, b = b, a % b\n    return a";
    let old = "(non-negative; gcd(0, 0) == 0).\"\"\"\n    raise NotImplementedError";
    let new = format!("(non-negative; gcd(0, 0) == 0).\"\"\"\n{body}");
    let r = call(
        &mut ep,
        "replace_in_file",
        json!({"path": "textkit/numbers.py", "old_str": old, "new_str": new}),
    );
    assert!(r.is_ok(), "{r:?}");
    let snippet = call(
        &mut ep,
        "read_file",
        json!({"path": "textkit/numbers.py", "start_line": 4, "end_line": 9}),
    )
    .unwrap();
    assert!(snippet.contains("while b:"), "{snippet}");
    assert_eq!(submit(&mut ep), 1.0);
}

#[test]
fn do_nothing_agent_scores_zero() {
    for task in tasks().iter().take(3) {
        let mut ep = episode(task);
        assert_eq!(submit(&mut ep), 0.0);
        assert!(
            ep.call_tool("list_files", &json!({})).is_err(),
            "over after submit"
        );
    }
}

#[test]
fn partial_fix_gets_partial_credit() {
    let task = task_for("gcd");
    let mut ep = episode(&task);
    // Right except for zeros: test_gcd passes, test_gcd_zero fails.
    let (file, text) = original(&task);
    let text = text.replace(
        "    a, b = abs(a), abs(b)\n",
        "    a, b = abs(a), abs(b)\n    if a == 0:\n        return -1\n",
    );
    call(
        &mut ep,
        "write_file",
        json!({"path": file, "content": text}),
    )
    .unwrap();
    let out = ep.call_tool("submit", &json!({})).unwrap();
    let g = out.grade.unwrap();
    assert_eq!((g.passed, g.total), (1, 2), "{g:?}");
    assert_eq!(g.failed[0].0, "test_numbers::test_gcd_zero");
    assert!(
        !out.text.contains("assert numbers.gcd"),
        "never the test source: {}",
        out.text
    );
}

/// `[grade] reward = "all"`: the same half-right fix that gets 1/2 under "fraction" gets 0,
/// the full fix gets 1.
#[test]
fn reward_all_is_all_or_nothing() {
    let shipped = task_for("gcd");
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join(shipped.id());
    let cp = std::process::Command::new("cp")
        .arg("-r")
        .arg(shipped.repo_dir().parent().unwrap())
        .arg(&copy)
        .status()
        .unwrap();
    assert!(cp.success());
    let toml = copy.join("task.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    assert!(text.contains("reward = \"fraction\""));
    std::fs::write(
        &toml,
        text.replace("reward = \"fraction\"", "reward = \"all\""),
    )
    .unwrap();
    let task = composer_env::repo::load_task(&copy).unwrap();
    let (file, right) = original(&task);
    let half = right.replace(
        "    a, b = abs(a), abs(b)\n",
        "    a, b = abs(a), abs(b)\n    if a == 0:\n        return -1\n",
    );
    for (content, passed, reward) in [(half, 1, 0.0), (right, 2, 1.0)] {
        let mut ep = episode(&task);
        call(
            &mut ep,
            "write_file",
            json!({"path": file, "content": content}),
        )
        .unwrap();
        let g = ep.call_tool("submit", &json!({})).unwrap().grade.unwrap();
        assert_eq!((g.passed, g.total, g.reward), (passed, 2, reward), "{g:?}");
    }
}
