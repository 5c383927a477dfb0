//! Issue 19 at the binary's edge: `generate --max-new-tokens 0` returns no tokens, absurd
//! `--num-samples` / `--max-new-tokens` are refused naming the flag, and logs written to a pipe
//! carry no ANSI escape codes.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// The shared fixtures root: `$COMPOSER_SHARED`, else `<workspace>/../shared`.
fn shared_dir() -> PathBuf {
    match std::env::var("COMPOSER_SHARED") {
        Ok(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared")),
    }
}

fn tiny_model() -> String {
    shared_dir()
        .join("fixtures/hf-tiny/llama-tiny")
        .display()
        .to_string()
}

/// Runs the binary with stdout and stderr piped (never a terminal).
fn composer_rl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("running composer-rl")
}

#[test]
fn generate_with_zero_max_new_tokens_returns_no_tokens() {
    let model = tiny_model();
    let out = composer_rl(&[
        "generate",
        "--model",
        &model,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "0",
        "--num-samples",
        "2",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let samples = v["samples"].as_array().expect("samples");
    assert_eq!(samples.len(), 2);
    for s in samples {
        assert_eq!(s["completion_ids"].as_array().unwrap().len(), 0, "{s}");
        assert_eq!(s["logprobs"].as_array().unwrap().len(), 0, "{s}");
        assert_eq!(s["completion_text"], "");
        assert_eq!(s["finish_reason"], "length");
    }
}

#[test]
fn generate_beyond_the_budget_is_refused_naming_the_flag() {
    // A model path that does not exist: the refusal must come before any loading.
    let cases: [(&[&str], &str); 4] = [
        (&["--num-samples", "100000"], "--num-samples"),
        (&["--num-samples", "0"], "--num-samples"),
        (&["--max-new-tokens", "10000000"], "--max-new-tokens"),
        (
            &["--num-samples", "1024", "--max-new-tokens", "32768"],
            "--max-new-tokens",
        ),
    ];
    for (flags, flag) in cases {
        let mut args = vec!["generate", "--model", "/nonexistent/model", "--prompt", "x"];
        args.extend_from_slice(flags);
        let out = composer_rl(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(err.contains(flag), "{args:?}: {err}");
        assert!(!err.contains("/nonexistent/model"), "loaded first: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn logs_to_a_pipe_carry_no_ansi_escapes() {
    // A metrics file whose last line was cut short: `report` logs a warning about it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        "{\"kind\":\"train\",\"step\":1,\"reward/mean\":0.5}\n{\"kind\":\"tr",
    )
    .unwrap();
    let out = composer_rl(&["report", &dir.path().display().to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("truncated final line"), "no log line: {err}");
    assert!(!err.contains('\u{1b}'), "ANSI escape in piped log: {err:?}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains('\u{1b}'));
}

#[test]
fn train_into_a_used_run_dir_is_refused_unless_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{\"step\":1}\n").unwrap();
    let run_s = run.to_str().unwrap();
    let out = composer_rl(&["train", "--quiet", "--run-dir", run_s, "--steps", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(run_s) && err.contains("--resume") && err.contains("--overwrite"),
        "{err}"
    );
    let out = composer_rl(&["train", "--overwrite", "--resume", run_s]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--overwrite"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `serve-env --max-sessions 0` (every session refused) is an error naming the flag, and the
/// address printed is the one bound: with `--port 0`, the port the system chose.
#[test]
fn serve_env_refuses_zero_sessions_and_prints_the_bound_port() {
    let out = composer_rl(&["serve-env", "echo", "--max-sessions", "0"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--max-sessions"), "{stderr}");
    let line = serving_line(&["serve-env", "echo", "--port", "0"]);
    assert!(
        line.contains("serving env `echo` on http://127.0.0.1:"),
        "{line}"
    );
    assert!(
        !line.contains("127.0.0.1:0 "),
        "the port printed is 0: {line}"
    );
}

/// `export` of a directory that does not exist says so, and `serve-env --host` takes a name
/// that resolves (`localhost`), not only an address.
#[test]
fn export_names_a_missing_checkpoint_and_serve_env_resolves_host_names() {
    let out = composer_rl(&["export", "/nonexistent/ck", "--out", "/tmp/never-written"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/nonexistent/ck: no such checkpoint directory"),
        "{stderr}"
    );
    let out = composer_rl(&[
        "serve-env",
        "echo",
        "--host",
        "no such host!",
        "--port",
        "0",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--host no such host!"));
    let line = serving_line(&["serve-env", "echo", "--host", "localhost", "--port", "0"]);
    assert!(line.contains("serving env `echo` on http://"), "{line}");
}

/// Starts `composer-rl args` (a `serve-env`), returns its "serving env" line and stops it.
fn serving_line(args: &[&str]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve-env starts");
    let mut line = String::new();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    while !line.contains("serving env") {
        line.clear();
        if std::io::BufRead::read_line(&mut err, &mut line).unwrap() == 0 {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    line
}
