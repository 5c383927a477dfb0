//! Issue 19, "numbers that are true": `plan --from-run` takes its per-step token figure from
//! the run summary, so a running-total `trained_tokens` is not summed twice.

use composer_plan::plan_from_run;
use composer_telemetry::MetricsWriter;
use serde_json::json;

#[test]
fn plan_from_run_inherits_the_per_step_tokens_of_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = MetricsWriter::create(&dir.path().join("metrics.jsonl")).unwrap();
    let mut cumulative = 0u64;
    let mut want = 0.0;
    for step in 1..=50u64 {
        let tokens = 1000 + 37 * (step % 7);
        want += tokens as f64;
        cumulative += tokens;
        let step_s = 2.0 + (step % 3) as f64 * 0.5;
        w.write(&json!({
            "kind": "train", "step": step,
            "time/rollout_s": step_s * 0.6, "time/reward_s": step_s * 0.1,
            "time/train_s": step_s * 0.25, "time/sync_s": step_s * 0.05,
            "time/step_s": step_s, "trained_tokens": cumulative,
        }))
        .unwrap();
    }
    drop(w);
    let plan = plan_from_run(dir.path()).unwrap();
    let per_step = plan.trained_tokens_per_step;
    assert!((per_step - want / 50.0).abs() < 1e-9, "{per_step}");
}
