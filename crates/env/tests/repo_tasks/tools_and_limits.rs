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

/// A tool error never echoes a huge argument back (a 1 MB path, tool name or argument name,
/// or one of control characters that `{:?}` would blow up sixfold): the observation stays
/// small, so an agent cannot make replies grow with its input.
#[test]
fn huge_arguments_get_short_errors() {
    let task = task_for("dedupe");
    let mut ep = episode(&task);
    let long = "a/".repeat(1 << 19);
    let ctrl = "\u{1}".repeat(1 << 20);
    let cases = [
        ("read_file", json!({"path": long})),
        ("write_file", json!({"path": long, "content": ""})),
        ("list_files", json!({"path": long})),
        ("list_files", json!({"path": ctrl})),
        (
            "replace_in_file",
            json!({"path": ctrl, "old_str": "a", "new_str": "b"}),
        ),
        (ctrl.as_str(), json!({})),
        ("run_tests", json!({ ctrl.clone(): 1 })),
    ];
    for (name, args) in cases {
        let e = ep
            .call_tool(name, &args)
            .expect_err("a bad call is an error");
        assert!(e.message.len() < 1024, "{} bytes", e.message.len());
        assert!(!ep.done());
    }
    // A path at the usual limit of 4096 bytes still works (as a missing file).
    let e = ep
        .call_tool("read_file", &json!({"path": "x".repeat(4096)}))
        .unwrap_err();
    assert!(e.message.len() < 1024, "{}", e.message.len());
}

/// `write_file` is held to the file size the sandbox allows commands (RLIMIT_FSIZE): it runs
/// on the trusted side, where no rlimit applies, and would let an agent fill the host's disk
/// 128 MB a call.
#[test]
fn write_file_is_held_to_the_sandbox_file_size() {
    let task = task_for("dedupe");
    let mut ep = episode(&task);
    let big = "x".repeat(17 << 20);
    let e = ep
        .call_tool("write_file", &json!({"path": "big.txt", "content": big}))
        .expect_err("over the file size limit");
    assert_eq!(e.error_type, ToolErrorKind::InvalidArgs, "{}", e.message);
    assert!(e.message.contains("content"), "{}", e.message);
    // Growing a file with replace_in_file is held to the same limit.
    let half = "y".repeat(9 << 20);
    call(
        &mut ep,
        "write_file",
        json!({"path": "h.txt", "content": format!("A{half}")}),
    )
    .unwrap();
    let e = ep
        .call_tool(
            "replace_in_file",
            &json!({"path": "h.txt", "old_str": "A", "new_str": half}),
        )
        .expect_err("the result is over the limit");
    assert_eq!(e.error_type, ToolErrorKind::InvalidArgs, "{}", e.message);
    assert!(ep
        .call_tool(
            "read_file",
            &json!({"path": "h.txt", "start_line": 1, "end_line": 1})
        )
        .is_ok());
}

/// Odd arguments (NUL bytes, control characters, extreme numbers, directories as files) are
/// error observations or plain results, never a panic or a hang; the episode goes on.
#[test]
fn odd_arguments_are_errors_not_panics() {
    let task = task_for("dedupe");
    let mut ep = episode(&task);
    let cases = [
        ("run_shell", json!({"command": "echo a\u{0}b"})),
        ("run_shell", json!({"command": "true", "timeout_s": 1e-300})),
        ("run_shell", json!({"command": "true", "timeout_s": 1e308})),
        ("run_shell", json!({"command": "printf '\\377\\376\\0x'"})),
        (
            "read_file",
            json!({"path": "textkit/seqs.py", "start_line": u64::MAX}),
        ),
        (
            "read_file",
            json!({"path": "textkit/seqs.py", "start_line": 2, "end_line": 1}),
        ),
        (
            "read_file",
            json!({"path": "textkit/seqs.py", "end_line": u64::MAX}),
        ),
        (
            "read_file",
            json!({"path": "textkit/seqs.py", "start_line": -1}),
        ),
        (
            "read_file",
            json!({"path": "textkit/seqs.py", "start_line": 1.5}),
        ),
        ("read_file", json!({"path": "."})),
        ("read_file", json!({"path": "textkit"})),
        ("write_file", json!({"path": ".", "content": "x"})),
        ("write_file", json!({"path": "textkit", "content": "x"})),
        (
            "write_file",
            json!({"path": "textkit/seqs.py/x", "content": "x"}),
        ),
        (
            "write_file",
            json!({"path": "a\u{7}\u{1b}[2J.py", "content": "\u{0}"}),
        ),
        (
            "write_file",
            json!({"path": "x".repeat(300), "content": "x"}),
        ),
        (
            "replace_in_file",
            json!({"path": "textkit/seqs.py", "old_str": "", "new_str": "x"}),
        ),
        ("list_files", json!({"path": "textkit/seqs.py"})),
        ("list_files", json!({"path": "./textkit//"})),
    ];
    for (name, args) in cases {
        let _ = ep.call_tool(name, &args);
        assert!(!ep.done(), "{name} {args}");
    }
    // The working copy is intact and the tools still work.
    assert!(call(&mut ep, "read_file", json!({"path": "textkit/seqs.py"})).is_ok());
    let out = call(&mut ep, "run_shell", json!({"command": "echo ok"})).unwrap();
    assert!(out.contains("ok"), "{out}");
}
