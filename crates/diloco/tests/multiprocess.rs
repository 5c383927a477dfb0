//! Real replica processes (`diloco-replica`) meeting through a local folder and through the
//! S3-compatible test server (`S3_ENDPOINT`, started by ../shared/s3/start-server.sh).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::{s3_endpoint, s3_env, s3_url};

const BIN: &str = env!("CARGO_BIN_EXE_diloco-replica");

/// Common arguments: 3 replicas × 20 rounds × H = 5 inner SGD steps of batch 8.
const RUN: &[&str] = &[
    "--replicas",
    "3",
    "--rounds",
    "20",
    "--inner-steps",
    "5",
    "--batch",
    "8",
    "--lr",
    "0.05",
    "--outer-lr",
    "0.7",
    "--outer-momentum",
    "0.9",
    "--poll-s",
    "0.01",
    "--seed",
    "11",
];

/// A spawned replica whose stdout lines arrive on a channel.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

fn spawn(store: &str, id: usize, extra: &[&str], s3: Option<&str>) -> Proc {
    let mut cmd = Command::new(BIN);
    cmd.args(RUN)
        .args(["--store", store, "--replica-id", &id.to_string()])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(e) = s3 {
        s3_env(&mut cmd, e);
    }
    let mut child = cmd.spawn().expect("spawn diloco-replica");
    let out = child.stdout.take().unwrap();
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Proc {
        child,
        lines,
        seen: vec![],
    }
}

impl Proc {
    /// Waits for a line starting with `prefix` (60 s safety limit).
    fn wait_for(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no {prefix:?} line; saw {:?}", self.seen));
            self.seen.push(line.clone());
            if line.starts_with(prefix) {
                return line;
            }
        }
    }
    /// Waits for exit; returns the FINAL json and every ROUND report.
    fn finish(mut self) -> (Value, Vec<Value>) {
        let fin = self.wait_for("FINAL ");
        let status = self.child.wait().unwrap();
        assert!(status.success(), "replica exited with {status}");
        let rounds = self
            .seen
            .iter()
            .filter_map(|l| l.strip_prefix("ROUND "))
            .map(|j| serde_json::from_str(j).unwrap())
            .collect();
        (
            serde_json::from_str(&fin["FINAL ".len()..]).unwrap(),
            rounds,
        )
    }
}

fn single_process_loss(data_offset: usize) -> f64 {
    let out = Command::new(BIN)
        .args(RUN)
        .args(["--single", "--data-offset", &data_offset.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8(out.stdout).unwrap();
    let line = s.lines().find_map(|l| l.strip_prefix("FINAL ")).unwrap();
    serde_json::from_str::<Value>(line).unwrap()["eval_loss"]
        .as_f64()
        .unwrap()
}

/// The reference is `diloco-replica --single`: the same DiLoCo run (same outer Nesterov SGD,
/// H = 5, 20 rounds, 100 inner steps) as one replica whose every inner step trains on the union
/// of the three replicas' minibatches — exactly the same 2400 samples in the same steps. (The
/// first version compared against plain SGD without the outer optimizer, which is a different
/// optimiser, hence 0.104 vs 0.168.)
///
/// "Within noise" is measured, not guessed: the noise is the spread of the single process's
/// final loss when only the order of the training samples changes (`--data-offset`, same data
/// set, init and schedule). Measured by hand for seed 11 over 12 offsets: mean 0.1036, σ 0.0065;
/// 3-process vs single for seeds 11–18: 0.1041/0.0992, 0.1715/0.1684, 0.1117/0.1075,
/// 0.1526/0.1530, 0.1629/0.1609, 0.0381/0.0380, 0.1307/0.1297, 0.0568/0.0568 (≤ 0.75 σ).
/// The test re-measures σ over 8 offsets and accepts |multi − single| ≤ 3σ.
fn assert_matches_single(finals: &[Value]) {
    let single = single_process_loss(0);
    let noise: Vec<f64> = (0..8).map(|k| single_process_loss(1000 * k)).collect();
    let mean = noise.iter().sum::<f64>() / noise.len() as f64;
    let sigma =
        (noise.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (noise.len() - 1) as f64).sqrt();
    let first = finals[0]["eval_loss"].as_f64().unwrap();
    for f in finals {
        // All replicas end on the same global weights (α = 0), bit for bit.
        assert_eq!(f["eval_loss"].as_f64().unwrap(), first, "{finals:?}");
        assert_eq!(f["round"], 20);
    }
    println!("3-replica DiLoCo eval MSE {first:.5} vs single process {single:.5}; sample-order σ {sigma:.5}");
    assert!(sigma > 0.0);
    assert!(
        (first - single).abs() <= 3.0 * sigma,
        "diloco {first} vs single {single}, σ {sigma}"
    );
}

fn run_three(store: &str, s3: Option<&str>) {
    let procs: Vec<Proc> = (0..3).map(|i| spawn(store, i, &[], s3)).collect();
    let results: Vec<(Value, Vec<Value>)> = procs.into_iter().map(Proc::finish).collect();
    for (_, rounds) in &results {
        assert_eq!(rounds.len(), 20);
        assert!(
            rounds.iter().all(|r| r["replicas_in_quorum"] == 3),
            "{rounds:?}"
        );
    }
    let finals: Vec<Value> = results.into_iter().map(|r| r.0).collect();
    assert_matches_single(&finals);
}

#[test]
fn three_replicas_through_a_local_folder_match_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    run_three(&url, None);
    assert!(dir.path().join("init.safetensors").exists());
    assert!(dir.path().join("round-000019/frag-0/closed.json").exists());
}

#[test]
fn three_replicas_through_s3_match_one_process() {
    let Some(endpoint) = s3_endpoint() else {
        return;
    };
    run_three(&s3_url("test-three"), Some(&endpoint));
}

/// Kill replica 2 (SIGKILL) right after it publishes round 5: the others finish that round and
/// the following ones without it (quorum timeout 1 s, min 2), the run completes, and the
/// restarted replica rejoins from the store's global weights and takes part again.
#[test]
fn killed_replica_is_left_out_then_rejoins() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let extra = [
        "--min-replicas",
        "2",
        "--quorum-timeout-s",
        "1",
        "--step-sleep-ms",
        "5",
    ];
    let p0 = spawn(&url, 0, &extra, None);
    let p1 = spawn(&url, 1, &extra, None);
    let mut p2 = spawn(&url, 2, &extra, None);
    p2.wait_for("PUBLISHED round=5");
    p2.child.kill().unwrap(); // SIGKILL on unix
    p2.child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let mut p2 = spawn(&url, 2, &extra, None);
    let joined = p2.wait_for("JOINED ");
    let join_round: u64 = joined["JOINED round=".len()..].parse().unwrap();
    assert!(join_round >= 6, "rejoined at round {join_round}");
    let (f2, r2) = p2.finish();
    let (f0, r0) = p0.finish();
    let (f1, _) = p1.finish();
    assert!(
        r0.iter().any(|r| r["replicas_in_quorum"] == 2),
        "a round closed without the dead replica"
    );
    assert!(
        r2.iter().any(|r| r["own_delta_used"] == true),
        "the rejoined replica contributed again"
    );
    assert!(
        r0.last().unwrap()["replicas_in_quorum"] == 3,
        "{:?}",
        r0.last()
    );
    for f in [&f0, &f1, &f2] {
        assert_eq!(f["round"], 20);
        assert_eq!(
            f["eval_loss"], f0["eval_loss"],
            "all end on the same global weights"
        );
    }
}

/// The S3 store unreachable (nothing listens on the port): bounded retries, then a clear error.
#[test]
fn unreachable_s3_store_fails_after_bounded_retries() {
    let mut cmd = Command::new(BIN);
    cmd.args(RUN).args([
        "--store",
        "s3://composer-rl/dead",
        "--replica-id",
        "0",
        "--retries",
        "2",
        "--backoff-s",
        "0.05",
    ]);
    s3_env(&mut cmd, "http://127.0.0.1:9");
    let start = Instant::now();
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("init.safetensors") && err.contains("failed after 3 attempts"),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(30));
}
