//! Tests of the report: the page's content, its self-containment, and bad run directories.
use super::*;
use crate::metrics::MetricsWriter;
use serde_json::json;

/// A 20-step synthetic run with every key of the contract, plus evals every 5 steps.
/// `trained_tokens` is the trainer's running total: 4000 tokens per step.
pub(crate) fn synthetic_run(dir: &Path) {
    let mut w = MetricsWriter::create(&dir.join("metrics.jsonl")).unwrap();
    for step in 1..=20u64 {
        let s = step as f64;
        w.write(&json!({
            "kind": "train", "step": step, "policy_version": step,
            "reward/mean": 0.2 + 0.03 * s, "reward/std": 0.1,
            "completions/mean_length": 300.0 + 5.0 * s,
            "completions/clipped_ratio": 0.05,
            "completions/lengths": [100 + step, 300, 500, 900 + 10 * step],
            "loss/rlvr": 0.5 / s, "loss/hint": 0.1, "loss/replay": 0.05,
            "kl": 0.001 * s, "entropy": 1.5 - 0.02 * s,
            "time/rollout_s": 6.0, "time/reward_s": 1.5, "time/train_s": 2.0,
            "time/sync_s": 0.5, "time/step_s": 10.0, "tokens_per_s": 1500.0,
            "trained_tokens": 4000 * step, "env/latency_s": [0.2, 0.4],
            "staleness/values": [0, 1, (step % 3)], "staleness/max": step % 3,
            "idle/trainer_s": 0.5,
        }))
        .unwrap();
        if step % 5 == 0 {
            w.write(&json!({"kind": "eval", "step": step, "eval/accuracy": 0.1 * s / 5.0}))
                .unwrap();
        }
    }
    fs::write(
        dir.join("recipe.toml"),
        "[model]\nname = \"qwen<3>&co\"\n[loss]\nalpha = 0.5 # \"hint\"\n",
    )
    .unwrap();
}

#[test]
fn report_is_self_contained_with_every_plot() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path());
    let out = write_report(dir.path()).unwrap();
    assert_eq!(out, dir.path().join("report.html"));
    let html = fs::read_to_string(&out).unwrap();
    // 8 plots: reward, eval, kl, entropy, length, losses, time split, staleness.
    assert_eq!(html.matches("<svg").count(), 8, "one <svg> per plot");
    assert!(!html.contains("<script"));
    assert!(!html.contains("src=\"http") && !html.contains("href=\"http"));
    assert!(!html.contains("Not in the metrics"));
    // Recipe is escaped inside <pre>.
    assert!(
        html.contains("name = &quot;qwen&lt;3&gt;&amp;co&quot;"),
        "{html}"
    );
    assert!(!html.contains("qwen<3>"));
    // Summary numbers: rollout 6 s of a 10 s step binds at 60%; goodput 4000/10 = 400.
    assert!(html.contains("rollout (binding)"));
    assert!(html.contains("60.0%"));
    assert!(html.contains("400 trained tok/s"));
    assert!(html.contains("Where each step"));
    assert!(html.contains("policy-version lag"));
    assert!(!dir.path().join(".report.html.tmp").exists());
    let text = report_cli(dir.path()).unwrap();
    assert!(
        text.contains("report.html") && text.contains("binding"),
        "{text}"
    );
}

#[test]
fn report_of_a_sparse_run_lists_missing_plots() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = MetricsWriter::create(&dir.path().join("metrics.jsonl")).unwrap();
    w.write(&json!({"kind":"train","step":1,"reward/mean":0.5}))
        .unwrap();
    let html = fs::read_to_string(write_report(dir.path()).unwrap()).unwrap();
    assert_eq!(html.matches("<svg").count(), 1);
    assert!(html.contains("Not in the metrics (no plot): Eval accuracy, KL"));
    assert!(html.contains("No recipe.toml"));
}

#[test]
fn missing_or_empty_metrics_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = format!("{:#}", write_report(dir.path()).unwrap_err());
    assert!(err.contains("metrics.jsonl"), "{err}");
    fs::write(dir.path().join("metrics.jsonl"), "\n").unwrap();
    let err = format!("{:#}", write_report(dir.path()).unwrap_err());
    assert!(
        err.contains("metrics.jsonl") && err.contains("no records"),
        "{err}"
    );
    fs::write(dir.path().join("metrics.jsonl"), "{}\n{oops\n{}\n").unwrap();
    let err = format!("{:#}", write_report(dir.path()).unwrap_err());
    assert!(err.contains("metrics.jsonl line 2"), "{err}");
}
