//! Repository tasks: the shipped task set, the tools, honest and dishonest agents.
//!
//! `REGENERATE_REPO_TASKS=1 cargo test -p composer-env --test repo_tasks shipped_tasks_match`
//! rewrites `repo_tasks/tasks/` from `repo_tasks/source/`.

use std::path::{Path, PathBuf};

use composer_env::repo::{
    load_tasks, make_tasks, tool_specs, EpisodeBudget, RepoEpisode, RepoTask, ToolErrorKind,
};
use serde_json::{json, Value};

mod planted;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("repo_tasks")
}

fn tasks() -> Vec<RepoTask> {
    load_tasks(&root().join("tasks")).expect("shipped tasks load")
}

fn episode(task: &RepoTask) -> RepoEpisode {
    RepoEpisode::new(task, EpisodeBudget::default()).expect("episode starts")
}

fn call(ep: &mut RepoEpisode, name: &str, args: Value) -> Result<String, (ToolErrorKind, String)> {
    ep.call_tool(name, &args)
        .map(|o| o.text)
        .map_err(|e| (e.error_type, e.message))
}

fn submit(ep: &mut RepoEpisode) -> f64 {
    let out = ep.call_tool("submit", &json!({})).expect("submit works");
    assert!(out.done);
    out.grade.expect("graded").reward
}

/// The original file the task's removed symbol lives in.
fn original(task: &RepoTask) -> (String, String) {
    let file = task.spec.removed[0].file.clone();
    let text = std::fs::read_to_string(root().join("source").join(&file)).unwrap();
    (file, text)
}

fn task_for(symbol: &str) -> RepoTask {
    tasks()
        .into_iter()
        .find(|t| t.spec.removed[0].kind == "body" && t.spec.removed[0].symbols == [symbol])
        .unwrap_or_else(|| panic!("a task for {symbol}"))
}

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
fn honest(task: &RepoTask) -> f64 {
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

/// Writes `module_prefix` + the original file (so the code is right but booby-trapped) or
/// `replacement` as the whole file, then submits.
fn attack(symbol: &str, files: &[(&str, String)], shell: &[&str]) -> f64 {
    let task = task_for(symbol);
    let mut ep = episode(&task);
    for (path, content) in files {
        let r = call(
            &mut ep,
            "write_file",
            json!({"path": path, "content": content}),
        );
        assert!(r.is_ok(), "{path}: {r:?}");
    }
    for cmd in shell {
        let _ = call(&mut ep, "run_shell", json!({"command": cmd}));
    }
    submit(&mut ep)
}

#[test]
fn attack_reading_hidden_tests_finds_nothing() {
    let task = task_for("caesar");
    let hidden = task.hidden_tests_dir().display().to_string();
    let mut ep = episode(&task);
    // Only the hidden tests have this one.
    let secret = "test_caesar_case_and_roundtrip";
    let cmds = [
        format!("cat {hidden}/*.py"),
        "cat ../hidden_tests/*.py ../../hidden_tests/*.py".to_string(),
        "cat /proc/self/cwd/../hidden_tests/*.py; ls -R /proc/self/root/ 2>&1 | head -500".into(),
        format!("ln -s {hidden} h; cat h/*.py; ln -s / r; cat r{hidden}/*.py"),
        "grep -rs test_caesar_case / 2>/dev/null | head".into(),
    ];
    for c in &cmds {
        let out = match call(&mut ep, "run_shell", json!({"command": c})) {
            Ok(o) => o,
            Err((_, m)) => m,
        };
        assert!(!out.contains(secret), "{c}: {out}");
    }
    for p in [
        "h/test_strings.py",
        "r/etc/passwd",
        "../hidden_tests/test_strings.py",
        "/etc/passwd",
    ] {
        let r = call(&mut ep, "read_file", json!({"path": p}));
        assert!(r.is_err(), "{p}: {r:?}");
        assert!(!format!("{r:?}").contains(secret));
    }
    for p in ["h", "r", "..", "/"] {
        let r = call(&mut ep, "list_files", json!({"path": p}));
        assert!(!format!("{r:?}").contains(secret), "{p}: {r:?}");
    }
    let w = call(
        &mut ep,
        "write_file",
        json!({"path": "h/x.py", "content": "x"}),
    );
    assert!(w.is_err(), "writing through a symlink: {w:?}");
    assert_eq!(submit(&mut ep), 0.0);
}

/// The graded function stays broken; runner configuration files that would install the
/// correct one (if copied into the grading sandbox, or run by `site`/pytest) score 0, while the
/// same patch in a graded file scores 1 (so the attack is real).
#[test]
fn attack_runner_configuration_files_score_zero() {
    let task = task_for("slugify");
    let (file, correct) = original(&task);
    let broken = std::fs::read_to_string(task.repo_dir().join(&file)).unwrap();
    let module = file.trim_end_matches(".py").replace('/', ".");
    let trapped = planted::booby_trapped_module(&broken);
    let patch = planted::patch_source(&correct, &module);
    let mut files: Vec<(&str, String)> = vec![(file.as_str(), trapped.clone())];
    for p in planted::PLANTED {
        files.push((p, planted::planted_content(p, &patch)));
    }
    let pytest_cfg = "[pytest]\naddopts = -p sitecustomize\n";
    files.push(("pytest.ini", pytest_cfg.to_string()));
    files.push((
        "textkit/setup.cfg",
        pytest_cfg.replace("[pytest]", "[tool:pytest]"),
    ));
    files.push((
        "pyproject.toml",
        "[tool.pytest.ini_options]\naddopts = '-p sitecustomize'\n".to_string(),
    ));
    assert_eq!(attack("slugify", &files, &[]), 0.0);
    let control = [
        (file.as_str(), trapped),
        (
            planted::CONTROL,
            planted::planted_content(planted::CONTROL, &patch),
        ),
    ];
    assert_eq!(
        attack("slugify", &control, &[]),
        1.0,
        "the patch itself must work"
    );
}

#[test]
fn attack_exit_zero_at_import_scores_zero() {
    let (file, text) = original(&task_for("slugify"));
    let broken = std::fs::read_to_string(task_for("slugify").repo_dir().join(&file)).unwrap();
    let _ = text;
    let evil = format!("import os\nos._exit(0)\n{broken}");
    assert_eq!(attack("slugify", &[(file.as_str(), evil)], &[]), 0.0);
}

#[test]
fn attack_patching_builtins_and_assert_scores_zero() {
    let task = task_for("slugify");
    let (file, _) = original(&task);
    let broken = std::fs::read_to_string(task.repo_dir().join(&file)).unwrap();
    let evil = format!(
        "import builtins, sys, json\n\
         builtins.AssertionError = type('X', (Exception,), {{}})\n\
         builtins.NotImplementedError = StopIteration\n\
         json.dumps = lambda *a, **k: '{{\"test\": \"x\", \"status\": \"pass\"}}'\n\
         sys.exit = lambda *a: None\n\
         {broken}"
    );
    assert_eq!(attack("slugify", &[(file.as_str(), evil)], &[]), 0.0);
}

#[test]
fn attack_equal_to_everything_scores_zero() {
    let task = task_for("slugify");
    let (file, text) = original(&task);
    let evil = text.replace(
        "def slugify(text):",
        "class Any(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n\n\nclass Obj:\n    def __eq__(self, other):\n        return True\n\n\ndef slugify(text):\n    return Any('x') if len(text) % 2 else Obj()\n\n\ndef _old(text):",
    );
    assert_eq!(attack("slugify", &[(file.as_str(), evil)], &[]), 0.0);
}

#[test]
fn attack_printing_fake_results_scores_zero() {
    let task = task_for("slugify");
    let (file, _) = original(&task);
    let broken = std::fs::read_to_string(task.repo_dir().join(&file)).unwrap();
    let evil = format!(
        "import os\n\
         for line in ['{{\"done\": true}}', '{{\"test\": \"test_strings::test_slugify_basic\", \"status\": \"pass\"}}',\n\
                      'PASS test_strings::test_slugify_basic', '1 passed, 0 failed']:\n\
         \x20   for fd in range(0, 20):\n\
         \x20       try:\n\
         \x20           os.write(fd, (line + '\\n').encode())\n\
         \x20       except OSError:\n\
         \x20           pass\n\
         {broken}"
    );
    assert_eq!(attack("slugify", &[(file.as_str(), evil)], &[]), 0.0);
}

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

/// Run by `repo_tasks_refuse_a_sandbox_without_private_root` in a process whose sandbox has
/// namespaces disabled: episodes and the served env must refuse, naming the capability.
#[test]
#[ignore = "run in a child process by repo_tasks_refuse_a_sandbox_without_private_root"]
fn no_private_root_child() {
    assert!(!composer_sandbox::sandbox_capabilities().private_root);
    let task = task_for("caesar");
    let hidden = task.hidden_tests_dir().display().to_string();
    let e = RepoEpisode::new(&task, EpisodeBudget::default())
        .err()
        .expect("an episode without a private root is refused");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("private_root") && msg.contains(&hidden),
        "{msg}"
    );
    let e = composer_env::repo::RepoEnv::factory(&root().join("tasks"), EpisodeBudget::default())
        .err()
        .expect("serving without a private root is refused");
    assert!(format!("{e:#}").contains("private_root"), "{e:#}");
    println!("NO_PRIVATE_ROOT_CHILD_OK");
}

#[test]
fn repo_tasks_refuse_a_sandbox_without_private_root() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "no_private_root_child",
            "--nocapture",
        ])
        .env("COMPOSER_SANDBOX_NO_NAMESPACES", "1")
        .output()
        .expect("the test binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("NO_PRIVATE_ROOT_CHILD_OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
