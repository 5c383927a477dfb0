//! The capability probe: what isolation the kernel and the credentials allow, found once per
//! process by running a probe script in the sandbox.
use std::sync::OnceLock;
use std::time::Duration;

use super::config::{python_path, running_as_root, Capabilities, Mode, RawRun};
use super::dirs::SandboxDirs;
use super::running::spawn;
use crate::{Outcome, SandboxLimits};

/// Probe script: prints what isolation it observes, one `key=value` per line.
pub(super) const PROBE_SCRIPT: &str = r#"
import os, socket
print("pid1=%d" % (os.getpid() == 1))
try:
    ro = os.statvfs("/usr").f_flag & os.ST_RDONLY
except OSError:
    ro = 0
print("ro=%d" % (1 if ro else 0))
try:
    ok = b"python" in open("/proc/1/cmdline", "rb").read()
except OSError:
    ok = False
print("proc=%d" % ok)
try:
    s = socket.socket(); s.settimeout(0.5); s.connect(("127.0.0.1", 9)); net = 1
except OSError as e:
    net = 0 if e.errno in (101, 99) else 1
print("net=%d" % net)
print("private=%d" % (os.getcwd() == "/workspace" and not os.path.exists("/etc/passwd")))
try:
    seccomp = any(l.split() == ["Seccomp:", "2"] for l in open("/proc/self/status"))
except OSError:
    seccomp = False
print("seccomp=%d" % seccomp)
try:
    print("ipcns=" + os.readlink("/proc/self/ns/ipc"))
except OSError:
    print("ipcns=")
print("uts=%d" % (socket.gethostname() == "sandbox"))
"#;

pub(super) static PROBE: OnceLock<(Capabilities, Mode)> = OnceLock::new();

/// Probes (once per process) what isolation this kernel allows; see [`Capabilities`].
pub fn sandbox_capabilities() -> Capabilities {
    PROBE.get_or_init(probe).0.clone()
}

pub(crate) fn mode() -> Mode {
    PROBE.get_or_init(probe).1
}

pub(super) fn probe() -> (Capabilities, Mode) {
    let root = running_as_root();
    let mut caps = Capabilities {
        running_as_root: root,
        distinct_uid: root,
        user_namespace: false,
        network_namespace: false,
        pid_namespace: false,
        ipc_namespace: false,
        uts_namespace: false,
        private_root: false,
        private_tmp: false,
        read_only_root: false,
        private_proc: false,
        workdir_cap: false,
        nproc_enforced: true,
        cgroup: None,
        seccomp: false,
        python: python_path().map(|p| p.display().to_string()),
        notes: Vec::new(),
    };
    match crate::cgroup::describe() {
        Ok(d) => caps.cgroup = Some(d),
        Err(e) => caps.notes.push(e),
    }
    let mut mode = Mode {
        namespaces: true,
        root,
        workdir_cap: false,
    };
    let limits = SandboxLimits::default();
    // The capped working copy: a tmpfs mounted on the host, so root only (and not where root
    // lacks CAP_SYS_ADMIN, e.g. an unprivileged container).
    if std::env::var_os("COMPOSER_SANDBOX_NO_WORKDIR_CAP").is_some() {
        caps.notes
            .push("working copy cap disabled by COMPOSER_SANDBOX_NO_WORKDIR_CAP".to_string());
    } else if root {
        let trial = Mode {
            workdir_cap: true,
            ..mode
        };
        match SandboxDirs::new(trial, &limits) {
            Ok(_) => mode.workdir_cap = true,
            Err(e) => caps.notes.push(format!(
                "no size-capped working copy (per-file cap only): {e:#}"
            )),
        }
    } else {
        caps.notes.push(
            "not root: the working copy is a host directory, capped per file only".to_string(),
        );
    }
    caps.workdir_cap = mode.workdir_cap;
    if caps.python.is_none() {
        caps.notes.push("no python3 interpreter found".to_string());
        mode.namespaces = false;
        return (caps, mode);
    }
    let forced_fallback = std::env::var_os("COMPOSER_SANDBOX_NO_NAMESPACES").is_some();
    let run_probe = |mode: Mode| -> RawRun {
        let dirs = match SandboxDirs::new(mode, &limits) {
            Ok(d) => d,
            Err(e) => return RawRun::sandbox_error(format!("{e:#}"), 0.0),
        };
        if let Err(e) = dirs.write_file("probe.py", PROBE_SCRIPT.as_bytes()) {
            return RawRun::sandbox_error(format!("{e:#}"), 0.0);
        }
        let py = python_path().map(|p| p.display().to_string());
        let py = py.as_deref().unwrap_or("python3");
        let argv = [py, "-I", "-S", "-B", "probe.py"];
        match spawn(
            &dirs,
            &argv,
            &limits,
            Duration::from_secs(10),
            10,
            false,
            mode,
        ) {
            Ok(r) => r.finish(),
            Err(e) => RawRun::sandbox_error(e, 0.0),
        }
    };
    let run = if forced_fallback {
        // For testing the fallback on a kernel that has namespaces.
        RawRun::sandbox_error(
            "namespaces disabled by COMPOSER_SANDBOX_NO_NAMESPACES".to_string(),
            0.0,
        )
    } else {
        run_probe(mode)
    };
    let text = String::from_utf8_lossy(&run.stdout).to_string();
    let flag = |key: &str| text.lines().any(|l| l == format!("{key}=1"));
    if run.outcome == Outcome::Completed && run.exit_code == Some(0) {
        caps.user_namespace = true;
        caps.pid_namespace = flag("pid1");
        caps.private_root = flag("private");
        caps.private_tmp = true;
        caps.read_only_root = flag("ro");
        caps.private_proc = flag("proc");
        caps.network_namespace = !flag("net");
        caps.seccomp = flag("seccomp");
        // The IPC namespace is unshared together with the user namespace (one `unshare`, all
        // or nothing); where both sides can read their namespace link, it must differ.
        let inside = text
            .lines()
            .find_map(|l| l.strip_prefix("ipcns="))
            .filter(|l| !l.is_empty());
        let host = std::fs::read_link("/proc/self/ns/ipc").ok();
        caps.ipc_namespace = match (inside, host) {
            (Some(inside), Some(host)) => host.as_os_str() != inside,
            _ => true,
        };
        caps.uts_namespace = flag("uts");
    } else {
        caps.notes.push(format!(
            "namespaces unavailable ({:?}: {}); falling back to rlimits{}",
            run.outcome,
            String::from_utf8_lossy(&run.stderr).trim(),
            if root { " + per-sandbox uid" } else { " only" }
        ));
        mode.namespaces = false;
        let basic = run_probe(mode);
        let basic_text = String::from_utf8_lossy(&basic.stdout);
        caps.seccomp = basic_text.lines().any(|l| l == "seccomp=1");
        if basic.exit_code != Some(0) {
            caps.notes.push(format!(
                "the rlimit-only sandbox fails too ({:?}: {})",
                basic.outcome,
                String::from_utf8_lossy(&basic.stderr).trim()
            ));
        }
    }
    (caps, mode)
}
