//! `bench model`: padding-free, LoRA with checkpointing, bad flags, a failing torch side.

use super::*;

/// `bench model --padding-free`: the training step runs on the batch's rows packed as segments
/// of one row, and the report says so.
#[test]
fn bench_model_runs_padding_free() {
    let args = [
        "bench",
        "model",
        "--shape",
        "small",
        "--batch",
        "2",
        "--train-seq-len",
        "16",
        "--skip-decode",
        "--json",
    ];
    let padded = run_json(&args);
    assert_eq!(padded["padding_free"], false);
    let out = run_json(&[&args[..], &["--padding-free"]].concat());
    assert_eq!(out["padding_free"], true);
    let row = &out["rows"][0];
    assert!(row["train_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(row["train_phase_s"].as_array().unwrap().len(), 3);
}

/// `bench model` on the CPU-sized shape with LoRA and gradient checkpointing: the JSON report
/// counts only the adapters as trainable and times every phase; bad flags name themselves
/// before any model is built.
#[test]
fn bench_model_runs_lora_with_checkpointing_and_refuses_bad_flags() {
    let out = run_json(&[
        "bench",
        "model",
        "--shape",
        "small",
        "--batch",
        "2",
        "--train-seq-len",
        "16",
        "--skip-decode",
        "--lora",
        "4",
        "--gradient-checkpointing",
        "--json",
    ]);
    let total = out["num_parameters"].as_u64().unwrap();
    let trainable = out["num_trainable_parameters"].as_u64().unwrap();
    assert!(
        trainable > 0 && trainable < total / 10,
        "{trainable} of {total}"
    );
    let row = &out["rows"][0];
    assert!(row["train_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(row["decode_tokens_per_s"].is_null());
    let phases = row["train_phase_s"].as_array().unwrap();
    assert_eq!(phases.len(), 3);
    assert!(phases.iter().all(|p| p.as_f64().unwrap() >= 0.0));
    for (args, want) in [
        (
            vec!["bench", "model", "--shape", "qwen9"],
            "--shape \"qwen9\"",
        ),
        (
            vec![
                "bench",
                "model",
                "--shape",
                "small",
                "--train-seq-len",
                "100000",
            ],
            "--train-seq-len 100000",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--dtype", "f8"],
            "--dtype",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--prompt-len", "0"],
            "--prompt-len 0",
        ),
        (
            vec![
                "bench",
                "model",
                "--shape",
                "qwen2.5-0.5b",
                "--prompt-len",
                "40000",
            ],
            "--prompt-len 40000",
        ),
        (
            vec![
                "bench",
                "model",
                "--shape",
                "small",
                "--prompt-len",
                "18446744073709551615",
            ],
            "--prompt-len 18446744073709551615",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--torch-compile"],
            "--torch",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--peak-tflops", "0"],
            "--peak-tflops",
        ),
        (
            vec![
                "bench", "model", "--shape", "small", "--device", "tpu", "--torch",
            ],
            "unknown device `tpu`",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--train-seq-len", "0"],
            "--train-seq-len 0",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--batch", "0"],
            "--batch 0",
        ),
        (
            vec!["bench", "model", "--shape", "small", "--batch", "100000000"],
            "--batch 100000000",
        ),
        (
            vec!["bench", "grpo", "--learning-rate", "nan"],
            "--learning-rate",
        ),
        (vec!["bench", "async", "--target", "nan"], "--target"),
        (vec!["bench", "channels", "--target", "5"], "--target"),
        (vec!["bench", "channels", "--max-steps", "0"], "--max-steps"),
        (
            vec!["bench", "channels", "--hint-weight=-1"],
            "--hint-weight",
        ),
    ] {
        let out = composer_rl(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}

/// `bench model --torch` with a Python that cannot run PyTorch's side: our side still runs and
/// the reference's row says why it failed, naming the interpreter (the reference itself needs
/// torch, which CI does not install; BENCHMARKS.md has a run with it).
#[test]
fn bench_model_keeps_its_own_numbers_when_the_torch_side_fails() {
    let out = composer_rl(&[
        "bench",
        "model",
        "--shape",
        "small",
        "--batch",
        "1",
        "--train-seq-len",
        "64",
        "--skip-decode",
        "--torch",
        "--python",
        "/nonexistent/python3",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(out.stdout.trim_ascii()).expect("one JSON document");
    let ours = &report["composer_rl"]["rows"][0];
    assert!(
        ours["train_tokens_per_s"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    let torch = report["torch"].as_array().unwrap();
    assert_eq!(torch.len(), 1, "{report}");
    let error = torch[0]["error"].as_str().unwrap();
    assert!(error.contains("/nonexistent/python3"), "{error}");
    // Training FLOPs per token of the small shape: 6·N plus causal attention 6·L·H·d·T.
    let n = report["composer_rl"]["num_parameters"].as_f64().unwrap();
    let flops = report["train_flops_per_token"].as_f64().unwrap();
    assert_eq!(flops, 6.0 * n + 6.0 * (4 * 4 * 32 * 64) as f64, "{report}");
}
