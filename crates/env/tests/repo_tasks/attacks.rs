//! Dishonest agents: reading hidden tests, runner configuration, exiting at import, patched
//! builtins, values equal to everything, fake result lines — each scores 0.

use super::*;

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
