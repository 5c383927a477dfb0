//! The `generate` and `score` subcommands of the real `composer-rl` binary on the
//! transformers-written tiny checkpoints: greedy continuations and next-token log-probs
//! against each fixture's reference.json (computed by transformers 5.23, f32, CPU), seeded
//! sampling reproducibility, the chat template, the JSON shapes, and a missing model dir;
//! `score --ids` / `--batch`; and `bench model` / `bench rollout`.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

mod bench_grpo;
mod bench_model;
mod bench_rollout;
mod generate_and_score;
mod score_ids;

const FIXTURES: [&str; 3] = ["llama-tiny", "qwen2-tiny", "qwen3-tiny"];

/// The shared fixtures root: `$COMPOSER_SHARED`, else `<workspace>/../shared`.
fn shared_dir() -> PathBuf {
    match std::env::var("COMPOSER_SHARED") {
        Ok(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared")),
    }
}

fn fixture(name: &str) -> PathBuf {
    shared_dir().join("fixtures/hf-tiny").join(name)
}

fn reference(name: &str) -> Value {
    let p = fixture(name).join("reference.json");
    let text =
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    serde_json::from_str(&text).expect("reference.json parses")
}

fn composer_rl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_composer-rl"))
        .args(args)
        .output()
        .expect("running composer-rl")
}

/// Runs the binary, expects success, parses stdout as one JSON value.
fn run_json(args: &[&str]) -> Value {
    let out = composer_rl(args);
    assert!(
        out.status.success(),
        "composer-rl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout of {args:?} is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Runs the binary, expects failure with nothing on stdout, returns stderr.
fn run_err(args: &[&str]) -> String {
    let out = composer_rl(args);
    assert!(!out.status.success(), "composer-rl {args:?} succeeded");
    assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("integer") as u32)
        .collect()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

/// The `{"samples":[{completion_ids, completion_text, logprobs, finish_reason}]}` shape.
fn samples(out: &Value) -> &Vec<Value> {
    let obj = out.as_object().expect("object");
    assert_eq!(obj.keys().collect::<Vec<_>>(), ["samples"], "{out}");
    let samples = out["samples"].as_array().expect("samples array");
    for s in samples {
        let mut keys: Vec<&String> = s.as_object().expect("sample object").keys().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "completion_ids",
                "completion_text",
                "finish_reason",
                "logprobs"
            ],
            "{s}"
        );
        assert_eq!(
            s["completion_ids"].as_array().unwrap().len(),
            s["logprobs"].as_array().unwrap().len()
        );
        assert!(matches!(
            s["finish_reason"].as_str(),
            Some("stop") | Some("length")
        ));
    }
    samples
}
