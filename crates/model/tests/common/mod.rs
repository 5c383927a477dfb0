//! Shared test helpers.
#![allow(dead_code)]

pub mod kernel_checks;

use std::path::PathBuf;

use candle_core::Device;

/// The device the parity and token-faithfulness tests run on: `$COMPOSER_TEST_DEVICE`
/// (`cpu`, `cuda`, `cuda:N`; default `cpu`). `cuda` needs a test build with
/// `--features cuda`; otherwise the tests fail loudly rather than silently use the CPU.
pub fn test_device() -> Device {
    let spec = std::env::var("COMPOSER_TEST_DEVICE").unwrap_or_default();
    let spec = if spec.trim().is_empty() {
        "cpu"
    } else {
        spec.trim()
    };
    match composer_model::device_from_str(spec) {
        Ok(d) => {
            if !d.is_cpu() {
                eprintln!("COMPOSER_TEST_DEVICE={spec}: running on {d:?}");
            }
            d
        }
        Err(e) => panic!("COMPOSER_TEST_DEVICE={spec}: {e:#}"),
    }
}

/// The shared fixtures root: `$COMPOSER_SHARED`, else `<workspace>/../shared`.
pub fn shared_dir() -> PathBuf {
    match std::env::var("COMPOSER_SHARED") {
        Ok(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared")),
    }
}

/// `hf-tiny/<name>` fixture directory.
pub fn fixture(name: &str) -> PathBuf {
    shared_dir().join("fixtures/hf-tiny").join(name)
}

/// The three tiny checkpoints.
pub const FIXTURES: [&str; 3] = ["llama-tiny", "qwen2-tiny", "qwen3-tiny"];

/// reference.json of a fixture (computed by transformers 5.23, eager attention, f32, CPU).
pub fn reference(name: &str) -> serde_json::Value {
    let p = fixture(name).join("reference.json");
    let text =
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    serde_json::from_str(&text).expect("reference.json parses")
}

/// Copies a fixture directory into a fresh writable temp dir.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for e in std::fs::read_dir(fixture(name)).expect("fixture dir") {
        let e = e.expect("entry");
        if e.file_name() == "reference.json" {
            continue;
        }
        std::fs::copy(e.path(), dir.path().join(e.file_name())).expect("copy");
    }
    dir
}

pub fn as_u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("int") as u32)
        .collect()
}

pub fn as_f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("num") as f32)
        .collect()
}

/// What the teacher-forced scorer (temperature 1) gives each completion token of `sample`
/// after `prompt`: the values the sampler's log-probs are checked against.
pub fn scored_completion(
    model: &composer_model::Transformer,
    prompt: &[u32],
    sample: &composer_model::Sample,
) -> Vec<f32> {
    let seq = [prompt, &sample.completion_ids].concat();
    let scored = composer_model::score_with_temperature(model, &[seq], 1.0)
        .unwrap()
        .remove(0);
    scored[prompt.len() - 1..].to_vec()
}
