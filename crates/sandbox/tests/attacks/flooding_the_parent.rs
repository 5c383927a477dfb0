//! Escaping into the trusted process's resources: the parent reads the candidate's result
//! channel (fd 3) line by line, and every line it holds is the candidate's to size. Many
//! gradings run at once in one trainer, so what one candidate can make the parent hold is
//! multiplied by the batch.
use super::*;

/// Writes 17 lines of almost 16 MiB (the longest line the parent takes) on fd 3 — when
/// loaded, and again for every call — then sleeps through the deadline, keeping the parent's
/// queue full.
const FLOOD_PY: &str = r#"
import os, time
line = b"x" * ((16 << 20) - 1) + b"\n"
def flood():
    for _ in range(17):
        try:
            os.write(3, line)
        except OSError:
            break
flood()
def f(x):
    flood()
    time.sleep(100)
"#;

/// The peak resident memory of this process in bytes (VmHWM).
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Run by `escape_flooding_the_result_channel_does_not_grow_the_parent` in a child process
/// (its peak memory is its own).
#[test]
#[ignore = "run in a child process by escape_flooding_the_result_channel_does_not_grow_the_parent"]
fn flooding_child() {
    let task = secret_task(&marker("flood"));
    let limits = SandboxLimits {
        wall_time: Duration::from_secs(4),
        ..limits()
    };
    let before = peak_rss();
    let report = grade(FLOOD_PY, &task, &limits, RewardMode::FractionPassed);
    assert_eq!(report.reward, 0.0, "{report:#?}");
    println!("PEAK_GROWTH={}", peak_rss().saturating_sub(before));
}

#[test]
fn escape_flooding_the_result_channel_does_not_grow_the_parent() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "flooding_the_parent::flooding_child",
            "--nocapture",
        ])
        .output()
        .expect("the test binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let growth: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("PEAK_GROWTH="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no measurement:\n{stdout}\n{stderr}"));
    // Two lines in flight (the one read and the one handed over) is the floor for 16 MiB
    // lines; a queue of them is what this guards against.
    assert!(
        growth < 80 << 20,
        "the parent's memory grew by {} MiB while a candidate flooded its channel",
        growth >> 20
    );
}
