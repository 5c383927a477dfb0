//! Class 1: reading the tests.

use super::*;

#[test]
fn attack_reading_the_tests_finds_nothing_and_scores_zero() {
    let secret = marker("read");
    let task = secret_task(&secret);
    let caps = sandbox_capabilities();
    // The tests also lie on the host, world-readable, where a careless grader might put them
    // (only where a private root hides host files; the README documents the fallback).
    // (Host paths named without the secret, so that the solution's source holds no copy.)
    let place = marker("place").replace("secret", "leak");
    let host_dir = std::env::temp_dir().join(format!("{place}-dir"));
    std::fs::create_dir_all(&host_dir).unwrap();
    let spec = serde_json::json!({"tests": task.tests}).to_string();
    let host_file = std::env::temp_dir().join(format!("{place}.json"));
    let _planted = caps.private_root.then(|| {
        (
            HostFile::new(host_dir.join("tests.json"), &spec),
            HostFile::new(host_file.clone(), &spec),
        )
    });
    if !caps.private_root {
        eprintln!(
            "NOTE: no private root here: host files not planted ({:?})",
            caps.notes
        );
    }
    // The marker is split in the source, so that solution.py itself does not contain it.
    let (head, tail) = secret.split_at(10);
    let code = format!(
        "MARK = {head:?} + {tail:?}\nHOST_DIR = {:?}\nHOST_FILE = {:?}\n{SEARCH_PY}",
        host_dir.display().to_string(),
        host_file.display().to_string()
    );
    let report = assert_zero(&code, &task);
    assert!(report.feedback.contains("NOTHING"), "{}", report.feedback);
    // Control: the same search, run unsandboxed on the host, finds the tests and answers
    // every call, so the attack is a real one.
    let control = format!("WALK = False\n{code}\nprint([f(i) for i in range(4)])\n");
    let _control_file = HostFile::new(host_file.clone(), &spec);
    if let Ok(out) = std::process::Command::new("python3")
        .args(["-I", "-S", "-c", &control])
        .current_dir(&host_dir)
        .output()
    {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&format!("{secret}-3")), "control: {text}");
    }
    let _ = std::fs::remove_dir_all(&host_dir);
}

#[test]
fn attack_reading_hidden_tests_next_to_a_working_copy_fails() {
    // The repository-task layout: hidden tests on the host beside the working copy.
    let secret = marker("hidden");
    let task_dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(task_dir.path().join("hidden_tests")).unwrap();
    let _hidden = HostFile::new(
        task_dir.path().join("hidden_tests/test_x.py"),
        &format!("def test_x():\n    assert f(0) == '{secret}-0'\n"),
    );
    let sb = Sandbox::new(limits()).unwrap();
    sb.write_file("pkg/mod.py", b"x = 1\n").unwrap();
    let host = task_dir.path().display().to_string();
    let (head, tail) = secret.split_at(10);
    let caps = sandbox_capabilities();
    let r = sb.run_shell(
        &format!(
            "cat ../hidden_tests/* ../../hidden_tests/* ../*/hidden_tests/* \
             /proc/self/cwd/../hidden_tests/* {host}/hidden_tests/* 2>&1; \
             ln -s / rootlink; ln -s {host} tasklink; cat rootlink{host}/hidden_tests/* \
             tasklink/hidden_tests/* /proc/1/root{host}/hidden_tests/* 2>&1; \
             A={head}; B={tail}; grep -rl -e \"$A$B\" / --exclude-dir=proc --exclude-dir=sys \
             --exclude-dir=usr --exclude-dir=dev 2>/dev/null; echo done"
        ),
        Duration::from_secs(20),
    );
    assert!(r.stdout.contains("done"), "{r:#?}");
    if caps.private_root {
        assert!(
            !r.stdout.contains(&secret) && !r.stdout.contains("test_x"),
            "hidden tests leaked: {r:#?}"
        );
    } else {
        protection_missing(
            "attack_reading_hidden_tests_next_to_a_working_copy_fails",
            "no private root: host files are readable",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
    }
    // The symlinks the sandbox made do not fool the trusted side either.
    assert!(sb.read_file("rootlink/etc/hostname").is_err());
    assert!(sb.read_file("tasklink/hidden_tests/test_x.py").is_err());
    assert!(sb.write_file("rootlink/tmp/x", b"x").is_err());
    assert_eq!(sb.read_file("pkg/mod.py").unwrap(), b"x = 1\n");
}
