//! Values no run can produce (a negative or astronomically large duration, a negative count)
//! in `metrics.jsonl`: `report` must refuse them naming the file, line and key, in bounded
//! time. A wall of 1e308 s used to make the step-time chart's axis infinite and the report
//! hang; a negative wall gave a "-500%" share.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use composer_telemetry::{read_metrics, report_cli};

/// `report_cli` on a run whose metrics are `lines`, with a 60 s limit (the bug was a hang).
fn report(lines: &str) -> Result<String, String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("metrics.jsonl"), lines).unwrap();
    let path = dir.path().to_path_buf();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = report_cli(&path).map_err(|e| format!("{e:#}"));
        let _ = tx.send(r);
    });
    let r = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("report did not finish within 60 s");
    drop(dir);
    r
}

const GOOD: &str = "{\"kind\":\"train\",\"step\":1,\"time/rollout_s\":6,\"time/train_s\":2}\n";

#[test]
fn astronomically_long_walls_are_refused_not_hung_on() {
    let lines = format!(
        "{GOOD}{}",
        "{\"kind\":\"train\",\"step\":2,\"time/rollout_s\":1e308,\"time/reward_s\":1e308,\"time/train_s\":2}\n"
    );
    let e = report(&lines).expect_err("a 1e308 s wall was reported");
    assert!(
        e.contains("metrics.jsonl line 2")
            && (e.contains("time/rollout_s = 1e308") || e.contains("time/reward_s = 1e308")),
        "{e}"
    );
}

#[test]
fn negative_durations_and_counts_are_refused() {
    for (key, value) in [
        ("time/train_s", "-50"),
        ("env/latency_s", "[0.2, -1]"),
        ("trained_tokens", "-4000"),
        ("staleness/values", "[0, -3]"),
    ] {
        let lines = format!("{GOOD}{{\"kind\":\"train\",\"step\":2,\"{key}\":{value}}}\n");
        let e = report(&lines).expect_err(&format!("{key} = {value} was reported"));
        assert!(
            e.contains("metrics.jsonl line 2") && e.contains(key),
            "{key}: {e}"
        );
    }
}

/// A huge value of an unbounded metric (a diverging grad norm, rewards of either sign) is
/// legitimate: its chart must still be drawn in bounded time.
#[test]
fn huge_values_of_signed_metrics_still_report() {
    let lines = format!(
        "{GOOD}{}",
        "{\"kind\":\"train\",\"step\":2,\"reward/mean\":-1e308,\"grad_norm\":1e308}\n\
         {\"kind\":\"train\",\"step\":3,\"reward/mean\":1e308,\"grad_norm\":1e300}\n"
    );
    report(&lines).unwrap();
}

/// The checks are the report's and the planner's: the plain reader (used by resume, which must
/// never refuse a run's own history) still reads such a file.
#[test]
fn the_plain_reader_still_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.jsonl");
    std::fs::write(
        &path,
        format!("{GOOD}{{\"kind\":\"train\",\"step\":2,\"time/train_s\":-1}}\n"),
    )
    .unwrap();
    assert_eq!(read_metrics(Path::new(&path)).unwrap().len(), 2);
}
