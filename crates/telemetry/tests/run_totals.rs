//! Issue 19, "numbers that are true": the run summary against totals
//! recomputed by hand from a metrics.jsonl written the way the trainer writes it
//! (`trained_tokens` is a running total), and resume keeping kept lines byte-identical.

use std::fs;

use composer_telemetry::{read_metrics, MetricsWriter, RunSummary};
use serde_json::json;

/// Per-step token counts and step times of a synthetic 50-step run.
fn steps() -> Vec<(u64, f64)> {
    (1..=50u64)
        .map(|step| (1000 + 37 * (step % 7), 2.0 + (step % 3) as f64 * 0.5))
        .collect()
}

/// Writes the run as the trainer does: `trained_tokens` is cumulative.
fn write_run(dir: &std::path::Path) {
    let mut w = MetricsWriter::create(&dir.join("metrics.jsonl")).unwrap();
    let mut cumulative = 0u64;
    for (i, (tokens, step_s)) in steps().into_iter().enumerate() {
        cumulative += tokens;
        w.write(&json!({
            "kind": "train", "step": i + 1,
            "time/rollout_s": step_s * 0.6, "time/reward_s": step_s * 0.1,
            "time/train_s": step_s * 0.25, "time/sync_s": step_s * 0.05,
            "time/step_s": step_s, "trained_tokens": cumulative,
        }))
        .unwrap();
        if (i + 1) % 10 == 0 {
            w.write(&json!({"kind": "eval", "step": i + 1, "eval/accuracy": 0.5}))
                .unwrap();
        }
    }
}

#[test]
fn summary_totals_match_metrics_recomputed_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path());
    let want_tokens: f64 = steps().iter().map(|(t, _)| *t as f64).sum();
    let want_seconds: f64 = steps().iter().map(|(_, s)| s).sum();

    // The file's last cumulative value is the same total, read straight off the JSON.
    let records = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    let last = records
        .iter()
        .rev()
        .find_map(|r| r["trained_tokens"].as_f64())
        .unwrap();
    assert_eq!(last, want_tokens);

    let s = RunSummary::from_metrics(&records);
    assert_eq!(s.steps, 50);
    assert_eq!(s.trained_tokens, want_tokens, "summed a running total?");
    assert!((s.total_step_s - want_seconds).abs() < 1e-9);
    let goodput = s.goodput_tokens_per_s.unwrap();
    assert!(
        (goodput - want_tokens / want_seconds).abs() < 1e-9,
        "{goodput}"
    );
}

#[test]
fn counter_restart_in_an_appended_file_is_not_negative() {
    // Two runs appended to one file: the counter drops back at the second run's first line.
    let lines = [
        json!({"kind": "train", "step": 1, "time/step_s": 1.0, "trained_tokens": 100}),
        json!({"kind": "train", "step": 2, "time/step_s": 1.0, "trained_tokens": 250}),
        json!({"kind": "train", "step": 1, "time/step_s": 1.0, "trained_tokens": 80}),
        json!({"kind": "train", "step": 2, "time/step_s": 1.0, "trained_tokens": 160}),
    ];
    let s = RunSummary::from_metrics(&lines);
    assert_eq!(s.trained_tokens, 250.0 + 160.0);
}

#[test]
fn resume_keeps_existing_lines_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.jsonl");
    // Lines as another writer (or an older serde_json) may have formatted them: exponents,
    // trailing zeros, long mantissas, spacing and key order that a parse + re-serialise
    // round trip would change.
    let kept = [
        r#"{"step": 1, "kind": "train", "lr": 1.0e-6, "loss/rlvr": 0.30000000000000004}"#,
        r#"{"kind":"train","step":2,"reward/mean":0.1234567890123456789,"kl":2.50}"#,
        // Shortest round-trip forms (as the writer prints them) that serde_json's default
        // float parser reads one ULP off: a parse + re-serialise rewrites their last digit.
        r#"{"kind":"train","step":3,"loss/rlvr":1.7546217903306627,"kl":7.2316896362404055}"#,
        r#"{"note":"no step","x":1E+2}"#,
        r#"{"step":3,"kind":"eval","eval/accuracy":0.3333333333333333}"#,
    ];
    let mut text = kept.join("\n");
    text.push('\n');
    text.push_str("{\"step\":4,\"kind\":\"train\",\"lr\":1e-6}\n");
    text.push_str("{\"step\":5,\"kind\":\"tr"); // cut short by a crash
    fs::write(&path, &text).unwrap();

    let mut w = MetricsWriter::open_resume(&path, 3).unwrap();
    w.write(&json!({"step": 4, "kind": "train", "resumed": true}))
        .unwrap();
    drop(w);

    let after = fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = after.lines().collect();
    assert_eq!(lines.len(), kept.len() + 1, "{after}");
    assert_eq!(
        &lines[..kept.len()],
        &kept[..],
        "kept lines must be copied, not re-serialised"
    );
    assert!(lines[kept.len()].contains("\"resumed\":true"));
    // No temp file left behind.
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn resume_does_not_drift_floats_written_by_the_writer() {
    // Lines exactly as MetricsWriter writes them, with values whose shortest form serde_json
    // parses one ULP off; every resume must leave the file byte-identical.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.jsonl");
    let values = [1.7546217903306627, 9.720916325967499, 2.4201240367807078];
    let mut w = MetricsWriter::create(&path).unwrap();
    for (i, v) in values.iter().enumerate() {
        w.write(&json!({"step": i + 1, "kind": "train", "loss/rlvr": v}))
            .unwrap();
    }
    drop(w);
    let original = fs::read(&path).unwrap();
    for _ in 0..3 {
        drop(MetricsWriter::open_resume(&path, 3).unwrap());
        assert_eq!(
            String::from_utf8(fs::read(&path).unwrap()).unwrap(),
            String::from_utf8(original.clone()).unwrap()
        );
    }
}
