//! The attack suite of `/work/shared/GRADING.md`: one test per class of attack on the grader,
//! each of which must score 0, plus the escape attempts on the sandbox itself. When a new trick
//! is found, add it to its class's module here.

use std::path::PathBuf;
use std::time::Duration;

use composer_sandbox::*;

mod escaping_the_sandbox;
mod filling_the_disk;
mod flooding_the_parent;
mod forging_results;
mod patching_the_grader;
mod reading_the_tests;
mod runner_configuration;
mod swapping_the_working_copy;
mod values_equal_to_everything;

/// Whether `CI` is set (as the other crates' tests read it).
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// A protection `test` checks is missing on this machine: a failure under `CI` (a CI run
/// must prove the containment, never skip it), else a loud SKIPPED line. Only a protection
/// switched off on purpose by its variable (`disabled_by`, e.g. the README's
/// `COMPOSER_SANDBOX_NO_NAMESPACES=1` run) may skip under `CI`.
fn protection_missing(test: &str, what: &str, disabled_by: &[&str], caps: &Capabilities) {
    let on_purpose = disabled_by.iter().find(|v| std::env::var_os(v).is_some());
    assert!(
        !in_ci() || on_purpose.is_some(),
        "{test}: {what} is missing on this machine but CI is set: the containment cannot be \
         checked ({:?})",
        caps.notes
    );
    let why = on_purpose.map_or(String::new(), |v| format!(" ({v} is set)"));
    eprintln!("SKIPPED: {test}: {what}{why} ({:?})", caps.notes);
}

/// A marker no test file, process or path of this run shares with another.
fn marker(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("composer-secret-{tag}-{}-{nanos}", std::process::id())
}

/// A task whose expected values are secrets: only a grader leak can produce them.
fn secret_task(secret: &str) -> CodeTask {
    CodeTask {
        id: format!("attack/{secret}"),
        prompt: "Write f(x).".into(),
        entry_point: "f".into(),
        tests: (0..4)
            .map(|i| format!("assert f({i}) == '{secret}-{i}'"))
            .collect(),
    }
}

fn limits() -> SandboxLimits {
    SandboxLimits {
        wall_time: Duration::from_secs(10),
        cpu_time_s: 5,
        ..SandboxLimits::default()
    }
}

/// Grades `code` against `task` and asserts it scores exactly 0.
fn assert_zero(code: &str, task: &CodeTask) -> GradeReport {
    let report = grade(code, task, &limits(), RewardMode::FractionPassed);
    assert_eq!(
        (report.passed, report.reward),
        (0, 0.0),
        "the attack scored: {report:#?}"
    );
    assert!(
        !matches!(report.outcome, Outcome::SandboxError(_)),
        "{report:#?}"
    );
    report
}

/// Host processes whose command line contains `marker`.
fn processes_with_marker(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(marker) {
                found.push(name);
            }
        }
    }
    found
}

/// A host file readable by everyone, removed on drop.
struct HostFile(PathBuf);

impl HostFile {
    fn new(path: PathBuf, text: &str) -> HostFile {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        HostFile(path)
    }
}

impl Drop for HostFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Python that searches everything it can reach for `MARK` (files under the working
/// directory, its parents, /proc/self/cwd, symlinks to /, /tmp, $HOME, /root, /home, the whole
/// file system, other processes' command lines and environments), then prints what it found.
const SEARCH_PY: &str = r#"
import os, re, stat, time
found = []
t0 = time.time()
WALK = globals().get("WALK", True)
def scan(p):
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):
            return
        with open(p, "rb") as fh:
            data = fh.read(1 << 20)
        if MARK.encode() in data:
            found.append((p, data))
    except Exception:
        pass
def walk(root, depth=6):
    if not WALK:
        return
    try:
        for dp, dn, fn in os.walk(root, followlinks=True):
            if time.time() - t0 > 4 or dp.count("/") > depth + root.count("/"):
                dn[:] = []
                continue
            dn[:] = [d for d in dn if os.path.join(dp, d) not in ("/usr", "/proc", "/sys", "/lib", "/lib64", "/bin", "/sbin")]
            for f in fn:
                scan(os.path.join(dp, f))
    except Exception:
        pass
for i, target in enumerate(["/", "..", "/proc/self/cwd/..", "/proc/1/root", "/proc/1/cwd", "/tmp", HOST_DIR]):
    try:
        os.symlink(target, "link%d" % i)
    except OSError:
        pass
for root in [".", "..", "../..", "/proc/self/cwd", "/proc/self/cwd/..", "/proc/self/root",
             "/proc/1/cwd", "/proc/1/root", "/tmp", "/var/tmp", "/dev/shm", "/root", "/home",
             os.path.expanduser("~"), HOST_DIR, "/"]:
    walk(root)
for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
    if name.isdigit():
        for part in ("cmdline", "environ"):
            scan("/proc/%s/%s" % (name, part))
scan(HOST_FILE)
print("FOUND" if found else "NOTHING", [p for p, _ in found], flush=True)
def f(x):
    for _, data in found:
        m = re.search(rb"f\(%d\) == '([^']*)'" % x, data)
        if m:
            return m.group(1).decode()
    return None
"#;

/// Run by `a_missing_protection_fails_under_ci_and_skips_elsewhere` in a child process.
#[test]
#[ignore = "run in a child process by a_missing_protection_fails_under_ci_and_skips_elsewhere"]
fn missing_protection_child() {
    protection_missing(
        "missing_protection_child",
        "no seccomp filter",
        &["COMPOSER_SANDBOX_NO_SECCOMP"],
        &sandbox_capabilities(),
    );
    println!("MISSING_PROTECTION_CHILD_SKIPPED");
}

#[test]
fn a_missing_protection_fails_under_ci_and_skips_elsewhere() {
    // (CI value, COMPOSER_SANDBOX_NO_SECCOMP set) -> the child skips.
    for (ci, off, skips) in [
        (Some("true"), false, false),
        (Some("1"), false, false),
        (None, false, true),
        (Some("false"), false, true),
        (Some("true"), true, true),
    ] {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--ignored",
            "--exact",
            "missing_protection_child",
            "--nocapture",
        ]);
        cmd.env_remove("CI")
            .env_remove("COMPOSER_SANDBOX_NO_SECCOMP");
        if let Some(v) = ci {
            cmd.env("CI", v);
        }
        if off {
            cmd.env("COMPOSER_SANDBOX_NO_SECCOMP", "1");
        }
        let out = cmd.output().expect("the test binary runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let case = format!("CI={ci:?} off={off}\n{stdout}\n{stderr}");
        if skips {
            assert!(out.status.success(), "{case}");
            assert!(
                stdout.contains("MISSING_PROTECTION_CHILD_SKIPPED"),
                "{case}"
            );
            assert!(
                stderr.contains("SKIPPED: missing_protection_child: no seccomp filter"),
                "{case}"
            );
        } else {
            assert!(!out.status.success(), "{case}");
            assert!(
                stdout.contains("no seccomp filter is missing on this machine but CI is set")
                    || stderr
                        .contains("no seccomp filter is missing on this machine but CI is set"),
                "{case}"
            );
        }
    }
}
