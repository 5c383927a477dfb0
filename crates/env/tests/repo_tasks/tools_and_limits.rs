//! Malformed tool calls, the turn limit, concurrent episodes, the grading copy, bad task files,
//! episodes across threads.

use super::honest_agents::honest;
use super::*;

#[test]
fn malformed_tool_calls_are_error_observations() {
    let task = task_for("dedupe");
    let mut ep = episode(&task);
    let cases = [
        ("no_such_tool", json!({}), ToolErrorKind::ToolNotFound),
        ("read_file", json!({}), ToolErrorKind::InvalidArgs),
        ("read_file", json!({"path": 3}), ToolErrorKind::InvalidArgs),
        (
            "read_file",
            json!("textkit/seqs.py"),
            ToolErrorKind::InvalidArgs,
        ),
        (
            "read_file",
            json!({"path": "textkit/seqs.py", "start_line": 0}),
            ToolErrorKind::InvalidArgs,
        ),
        (
            "read_file",
            json!({"path": "textkit/seqs.py", "start_line": 900}),
            ToolErrorKind::InvalidArgs,
        ),
        (
            "read_file",
            json!({"path": "nope.py"}),
            ToolErrorKind::ExecutionError,
        ),
        (
            "read_file",
            json!({"path": "/etc/passwd"}),
            ToolErrorKind::InvalidArgs,
        ),
        (
            "write_file",
            json!({"path": "a.py"}),
            ToolErrorKind::InvalidArgs,
        ),
        (
            "write_file",
            json!({"path": "../a.py", "content": ""}),
            ToolErrorKind::InvalidArgs,
        ),
        (
            "write_file",
            json!({"path": "a.py", "content": "", "mode": 1}),
            ToolErrorKind::InvalidArgs,
        ),
        (
            "replace_in_file",
            json!({"path": "textkit/seqs.py", "old_str": "zzz", "new_str": ""}),
            ToolErrorKind::ExecutionError,
        ),
        (
            "replace_in_file",
            json!({"path": "textkit/seqs.py", "old_str": "def ", "new_str": ""}),
            ToolErrorKind::ExecutionError,
        ),
        (
            "run_shell",
            json!({"command": ["ls"]}),
            ToolErrorKind::InvalidArgs,
        ),
        (
            "run_shell",
            json!({"command": "ls", "timeout_s": "x"}),
            ToolErrorKind::InvalidArgs,
        ),
        (
            "run_shell",
            json!({"command": "sleep 30", "timeout_s": 1}),
            ToolErrorKind::Timeout,
        ),
    ];
    for (name, args, kind) in cases {
        match ep.call_tool(name, &args) {
            Err(e) => assert_eq!(e.error_type, kind, "{name} {args}: {}", e.message),
            Ok(o) => panic!("{name} {args} should fail: {}", o.text),
        }
        assert!(!ep.done());
    }
    let out = call(
        &mut ep,
        "run_shell",
        json!({"command": "yes | head -c 100000"}),
    )
    .unwrap();
    assert!(out.contains("truncated"), "{}", &out[out.len() - 100..]);
    let names: Vec<&str> = tool_specs().iter().map(|t| t.name).collect();
    assert_eq!(
        names,
        [
            "list_files",
            "read_file",
            "write_file",
            "replace_in_file",
            "run_shell",
            "run_tests",
            "submit"
        ]
    );
    assert_eq!(submit(&mut ep), 0.0);
}

#[test]
fn turn_limit_ends_and_grades_the_episode() {
    let mut task = task_for("mean");
    task.spec.limits.max_turns = 2;
    let mut ep = episode(&task);
    let (file, text) = original(&task);
    assert!(
        !ep.call_tool("write_file", &json!({"path": file, "content": text}))
            .unwrap()
            .done
    );
    let last = ep.call_tool("no_such_tool", &json!({})).unwrap();
    assert!(last.done);
    assert_eq!(last.grade.unwrap().reward, 1.0);
    assert!(ep.call_tool("list_files", &json!({})).is_err());
}

#[test]
fn eight_concurrent_episodes_complete() {
    let all = tasks();
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let task = all[i % all.len()].clone();
            std::thread::spawn(move || honest(&task))
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 1.0);
    }
}

#[test]
fn grading_copy_takes_only_source_files() {
    use composer_env::repo::grade::{glob_match, select_source_files};
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "textkit/strings.py",
        "textkit/conftest.py",
        "textkit/sitecustomize.py",
        "textkit/x.pth",
        "textkit/sub/deep.py",
        "conftest.py",
        "pyproject.toml",
        "visible_tests/test_strings.py",
    ] {
        let p = dir.path().join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "x").unwrap();
    }
    std::os::unix::fs::symlink("/etc/passwd", dir.path().join("textkit/link.py")).unwrap();
    let got = select_source_files(dir.path(), &["textkit/*.py".to_string()]).unwrap();
    assert_eq!(got, ["textkit/strings.py"]);
    let got = select_source_files(dir.path(), &["**/*.py".to_string()]).unwrap();
    assert_eq!(
        got,
        [
            "textkit/strings.py",
            "textkit/sub/deep.py",
            "visible_tests/test_strings.py"
        ]
    );
    assert!(glob_match("a/**/b.py", "a/b.py") && glob_match("a/**/b.py", "a/x/y/b.py"));
    assert!(!glob_match("a/*.py", "a/x/b.py") && glob_match("a/?.py", "a/b.py"));
}

#[test]
fn task_files_with_errors_are_refused_with_the_file_and_key() {
    let src = task_for("chunk");
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join(src.id());
    for sub in ["repo", "visible_tests", "hidden_tests"] {
        std::fs::create_dir_all(t.join(sub)).unwrap();
    }
    let good = std::fs::read_to_string(src.dir.join("task.toml")).unwrap();
    let cases = [
        (
            good.replace("max_turns = 60", "max_turns = 60\nmax_tunrs = 3"),
            "max_tunrs",
        ),
        (
            good.replace("reward = \"fraction\"", "reward = \"most\""),
            "reward",
        ),
        (
            good.replace(
                "source_files = [\"textkit/*.py\"]",
                "source_files = [\"../x.py\"]",
            ),
            "source_files",
        ),
        (
            good.replace("file = \"textkit/seqs.py\"", "file = \"../seqs.py\""),
            "removed.file",
        ),
        (
            good.replacen(&format!("id = \"{}\"", src.id()), "id = \"other\"", 1),
            "id",
        ),
    ];
    for (text, key) in cases {
        std::fs::write(t.join("task.toml"), text).unwrap();
        let e = format!("{:#}", load_tasks(dir.path()).unwrap_err());
        assert!(e.contains("task.toml") && e.contains(key), "{key}: {e}");
    }
    std::fs::write(t.join("task.toml"), good).unwrap();
    assert_eq!(load_tasks(dir.path()).unwrap().len(), 1);
}

#[test]
fn episodes_can_move_between_threads() {
    fn assert_send<T: Send + 'static>() {}
    assert_send::<RepoEpisode>();
    let task = task_for("flatten");
    let ep = episode(&task);
    let mut ep = std::thread::spawn(move || ep).join().unwrap();
    assert_eq!(ep.turns(), 0);
    assert!(call(
        &mut ep,
        "read_file",
        json!({"path": "visible_tests/runtests.py"})
    )
    .is_ok());
}
