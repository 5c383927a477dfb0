//! The process-level sandbox: spawning `python3 -I -S` under resource limits and namespaces.
//!
//! Process tree of one run (all set up in `pre_exec`, i.e. in the forked child before `exec`):
//!
//! ```text
//! parent (this process)
//!  └─ supervisor  (own session/process group; when root: switched to a per-run uid;
//!      │           when the kernel allows: new user+mount+pid(+net) namespaces)
//!      └─ python3 (pid 1 of the new pid namespace; rlimits; parent-death signal SIGKILL)
//! ```
//!
//! The supervisor never runs untrusted code: it waits for python, kills it at the wall-clock
//! deadline (which takes the whole pid namespace down with it) and forwards its exit status.
//! Code inside the pid namespace cannot name (so cannot signal) the supervisor or the parent.
//!
//! Everything between `fork` and `exec` only uses async-signal-safe libc calls on memory
//! prepared before the fork (no allocation), as required in a multi-threaded parent.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::{NetworkPolicy, Outcome, SandboxLimits};

/// Base of the per-run uids used when the parent runs as root: uid = base + supervisor pid.
/// Pids are unique among live processes, so concurrent runs never share a uid (and so never
/// share an RLIMIT_NPROC budget or can signal each other).
const SANDBOX_UID_BASE: u32 = 0x5A00_0000;
/// Exit code of the supervisor when it killed python at the wall-clock deadline.
const SUPERVISOR_TIMEOUT_EXIT: i32 = 124;
/// Exit code of the supervisor when its own setup failed after the fork.
const SUPERVISOR_ERROR_EXIT: i32 = 125;
/// Size of the private tmpfs mounted on /tmp, /var/tmp and /dev/shm inside the mount namespace.
const PRIVATE_TMP_OPTS: &std::ffi::CStr = c"size=64m,mode=1777";
/// Open-file limit inside the sandbox.
const MAX_OPEN_FILES: u64 = 256;
/// Cap on the bytes read from the result channel (the runner writes a few hundred bytes per test).
const MAX_RESULT_BYTES: usize = 4 << 20;
/// Extra time after the wall-clock limit before the parent kills the process group itself
/// (the supervisor normally kills python exactly at the deadline).
const PARENT_GRACE: Duration = Duration::from_secs(2);

/// What the kernel and the current credentials allow, probed once per process.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Capabilities {
    /// The parent runs as uid 0 (then every run switches to its own unprivileged uid).
    pub running_as_root: bool,
    /// Runs switch to a per-run unprivileged uid (only possible as root).
    pub distinct_uid: bool,
    /// Unprivileged user namespaces work, so the mount/pid/net namespaces below are used.
    pub user_namespace: bool,
    /// No network: each run gets an empty network namespace (only loopback, down).
    pub network_namespace: bool,
    /// Each run is pid 1 of its own pid namespace: all its processes die with it.
    pub pid_namespace: bool,
    /// Private mount namespace: tmpfs on /tmp, /var/tmp, /dev/shm.
    pub private_tmp: bool,
    /// The whole file system is remounted read-only except the working directory and the tmpfs.
    pub read_only_root: bool,
    /// A fresh /proc for the pid namespace (other processes invisible).
    pub private_proc: bool,
    /// RLIMIT_NPROC is enforced for the sandboxed processes (not the case for a root process).
    pub nproc_enforced: bool,
    /// The interpreter used, or None when no usable python3 was found.
    pub python: Option<String>,
    /// Why something is unavailable (probe errors), empty when everything works.
    pub notes: Vec<String>,
}

/// Raw result of one sandboxed process run.
pub(crate) struct RawRun {
    pub stdout: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr: Vec<u8>,
    pub stderr_truncated: bool,
    pub result_channel: Vec<u8>,
    pub exit_code: Option<i32>,
    pub outcome: Outcome,
    pub wall_s: f64,
}

impl RawRun {
    fn sandbox_error(reason: String, wall_s: f64) -> RawRun {
        RawRun {
            stdout: Vec::new(),
            stdout_truncated: false,
            stderr: Vec::new(),
            stderr_truncated: false,
            result_channel: Vec::new(),
            exit_code: None,
            outcome: Outcome::SandboxError(reason),
            wall_s,
        }
    }
}

/// How the child isolates itself; decided once by the capability probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mode {
    namespaces: bool,
    root: bool,
}

/// Everything the forked child needs, prepared before the fork (no allocation after it).
struct ChildPlan {
    mode: Mode,
    isolate_net: bool,
    workdir: CString,
    result_fd: RawFd,
    wall_ms: u64,
    cpu_s: u64,
    address_space: u64,
    nproc: u64,
    fsize: u64,
}

/// The python interpreter: `$COMPOSER_SANDBOX_PYTHON`, else a system python3 (world-readable,
/// so the per-run uid can execute it), else `python3` from PATH resolved to `sys.executable`.
pub(crate) fn python_path() -> Option<&'static PathBuf> {
    static PYTHON: OnceLock<Option<PathBuf>> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            if let Some(p) = std::env::var_os("COMPOSER_SANDBOX_PYTHON") {
                return Some(PathBuf::from(p));
            }
            for candidate in ["/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"] {
                if Path::new(candidate).exists() {
                    return Some(PathBuf::from(candidate));
                }
            }
            let out = Command::new("python3")
                .args(["-I", "-S", "-c", "import sys; print(sys.executable)"])
                .stdin(Stdio::null())
                .output()
                .ok()?;
            let exe = String::from_utf8(out.stdout).ok()?;
            let exe = exe.trim();
            (out.status.success() && !exe.is_empty()).then(|| PathBuf::from(exe))
        })
        .as_ref()
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Probe script: prints what isolation it observes, one `key=value` per line.
const PROBE_SCRIPT: &str = r#"
import os, socket
print("pid1=%d" % (os.getpid() == 1))
try:
    ro = os.statvfs("/").f_flag & os.ST_RDONLY
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
print("uid=%d" % os.getuid())
"#;

static PROBE: OnceLock<(Capabilities, Mode)> = OnceLock::new();

/// Probes (once per process) what isolation this kernel allows; see [`Capabilities`].
pub fn sandbox_capabilities() -> Capabilities {
    PROBE.get_or_init(probe).0.clone()
}

fn mode() -> Mode {
    PROBE.get_or_init(probe).1
}

fn probe() -> (Capabilities, Mode) {
    let root = running_as_root();
    let mut caps = Capabilities {
        running_as_root: root,
        distinct_uid: root,
        user_namespace: false,
        network_namespace: false,
        pid_namespace: false,
        private_tmp: false,
        read_only_root: false,
        private_proc: false,
        nproc_enforced: true,
        python: python_path().map(|p| p.display().to_string()),
        notes: Vec::new(),
    };
    let mut mode = Mode {
        namespaces: true,
        root,
    };
    if caps.python.is_none() {
        caps.notes.push("no python3 interpreter found".to_string());
        mode.namespaces = false;
        return (caps, mode);
    }
    let limits = SandboxLimits {
        wall_time: Duration::from_secs(10),
        ..SandboxLimits::default()
    };
    if std::env::var_os("COMPOSER_SANDBOX_NO_NAMESPACES").is_some() {
        // For testing the fallback on a kernel that has namespaces.
        caps.notes
            .push("namespaces disabled by COMPOSER_SANDBOX_NO_NAMESPACES".to_string());
        mode.namespaces = false;
        return (caps, mode);
    }
    let run = run_raw_with_mode(
        &[("probe.py", PROBE_SCRIPT.as_bytes())],
        "probe.py",
        b"",
        &limits,
        mode,
    );
    let text = String::from_utf8_lossy(&run.stdout).to_string();
    let flag = |key: &str| text.lines().any(|l| l == format!("{key}=1"));
    if run.outcome == Outcome::Completed && run.exit_code == Some(0) {
        caps.user_namespace = true;
        caps.pid_namespace = flag("pid1");
        caps.private_tmp = true;
        caps.read_only_root = flag("ro");
        caps.private_proc = flag("proc");
        caps.network_namespace = !flag("net");
    } else {
        caps.notes.push(format!(
            "namespaces unavailable ({:?}: {}); falling back to rlimits{}",
            run.outcome,
            String::from_utf8_lossy(&run.stderr).trim(),
            if root { " + per-run uid" } else { " only" }
        ));
        mode.namespaces = false;
        let basic = run_raw_with_mode(
            &[("probe.py", PROBE_SCRIPT.as_bytes())],
            "probe.py",
            b"",
            &limits,
            mode,
        );
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

/// Runs `python3 -I -S -B <script> <result-fd>` in a fresh private working directory holding
/// `files`, feeding `stdin` and collecting stdout/stderr (truncated) and the result channel.
pub(crate) fn run_raw(
    files: &[(&str, &[u8])],
    script: &str,
    stdin: &[u8],
    limits: &SandboxLimits,
) -> RawRun {
    let mode = mode();
    if !mode.namespaces && !mode.root && std::env::var_os("COMPOSER_SANDBOX_ALLOW_WEAK").is_none() {
        // Same uid as the parent and no pid namespace: the code could signal or ptrace-read
        // this process and leave processes behind. Refuse unless explicitly accepted.
        return RawRun::sandbox_error(
            "refusing to run untrusted code: not root and no user namespaces, so the code \
             could signal this process (set COMPOSER_SANDBOX_ALLOW_WEAK=1 to accept)"
                .to_string(),
            0.0,
        );
    }
    run_raw_with_mode(files, script, stdin, limits, mode)
}

fn run_raw_with_mode(
    files: &[(&str, &[u8])],
    script: &str,
    stdin: &[u8],
    limits: &SandboxLimits,
    mode: Mode,
) -> RawRun {
    let start = Instant::now();
    let Some(python) = python_path() else {
        return RawRun::sandbox_error("no python3 interpreter found".to_string(), 0.0);
    };
    let workdir = match tempfile::Builder::new()
        .prefix("composer-sandbox-")
        .tempdir()
    {
        Ok(d) => d,
        Err(e) => {
            return RawRun::sandbox_error(
                format!("creating the private working directory: {e}"),
                0.0,
            )
        }
    };
    let run = run_in_dir(
        workdir.path(),
        python,
        files,
        script,
        stdin,
        limits,
        mode,
        start,
    );
    remove_dir_robust(workdir);
    run
}

#[allow(clippy::too_many_arguments)]
fn run_in_dir(
    dir: &Path,
    python: &Path,
    files: &[(&str, &[u8])],
    script: &str,
    stdin: &[u8],
    limits: &SandboxLimits,
    mode: Mode,
    start: Instant,
) -> RawRun {
    let elapsed = |start: Instant| start.elapsed().as_secs_f64();
    for (name, contents) in files {
        if let Err(e) = std::fs::write(dir.join(name), contents) {
            return RawRun::sandbox_error(
                format!("writing {}: {e}", dir.join(name).display()),
                elapsed(start),
            );
        }
    }
    let Ok(workdir_c) = CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return RawRun::sandbox_error("working directory path has a NUL byte".into(), 0.0);
    };
    // The result channel: a pipe whose write end the runner gets as an inherited fd.
    let (result_read, result_write) = match pipe_cloexec() {
        Ok(p) => p,
        Err(e) => return RawRun::sandbox_error(format!("pipe: {e}"), elapsed(start)),
    };
    let plan = ChildPlan {
        mode,
        isolate_net: limits.network == NetworkPolicy::Isolated,
        workdir: workdir_c,
        result_fd: result_write.as_raw_fd(),
        wall_ms: limits.wall_time.as_millis().min(u64::MAX as u128) as u64,
        cpu_s: limits.cpu_time_s.max(1),
        address_space: limits.address_space_bytes,
        nproc: limits.max_processes.max(1),
        fsize: limits.max_file_bytes,
    };
    let (home, tmp) = if mode.namespaces {
        ("/tmp".to_string(), "/tmp".to_string())
    } else {
        let d = dir.display().to_string();
        (d.clone(), d)
    };
    let mut cmd = Command::new(python);
    cmd.arg("-I")
        .arg("-S")
        .arg("-B")
        .arg(script)
        .arg(plan.result_fd.to_string())
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", home)
        .env("TMPDIR", tmp)
        .env("LANG", "C.UTF-8")
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the closure only makes async-signal-safe libc calls on `plan`, which is fully
    // built before the fork and not mutated afterwards.
    unsafe {
        cmd.pre_exec(move || child_setup(&plan));
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return RawRun::sandbox_error(
                format!("spawning {} in the sandbox: {e}", python.display()),
                elapsed(start),
            )
        }
    };
    drop(result_write);
    let pid = child.id() as libc::pid_t;

    let max_out = limits.max_output_bytes;
    let stdout_rx = child.stdout.take().map(|s| spawn_reader(s, max_out));
    let stderr_rx = child.stderr.take().map(|s| spawn_reader(s, max_out));
    let result_rx = Some(spawn_reader(
        std::fs::File::from(result_read),
        MAX_RESULT_BYTES,
    ));
    if let Some(mut input) = child.stdin.take() {
        // A child that never reads stdin (or died) makes this fail: that is fine.
        let _ = input.write_all(stdin);
    }

    // Wait without reaping (so the pid, which is also the process-group id, stays reserved),
    // kill what is left of the process group, then reap.
    let backstop = limits.wall_time + PARENT_GRACE;
    let mut backstop_fired = false;
    loop {
        match wait_exited_nowait(pid) {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return RawRun::sandbox_error(format!("waitid: {e}"), elapsed(start));
            }
        }
        if !backstop_fired && start.elapsed() >= backstop {
            // SAFETY: plain syscall; pid is our unreaped child, so the group id is ours.
            unsafe { libc::killpg(pid, libc::SIGKILL) };
            backstop_fired = true;
        }
        std::thread::sleep(Duration::from_millis(3));
    }
    // SAFETY: as above; leftovers of the group (only possible without a pid namespace).
    unsafe { libc::killpg(pid, libc::SIGKILL) };
    // Reap with wait4 for the CPU time: the supervisor's rusage includes python's (it waited
    // for it). `child` is not used after this.
    let (status, cpu_used_s) = loop {
        let mut raw_status: libc::c_int = 0;
        // SAFETY: rusage is plain data filled by wait4.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: pid is our exited, unreaped child.
        let r = unsafe { libc::wait4(pid, &mut raw_status, 0, &mut usage) };
        if r == pid {
            let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
            let cpu = secs(usage.ru_utime) + secs(usage.ru_stime);
            break (Ok(std::process::ExitStatus::from_raw(raw_status)), cpu);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            break (Err(e), 0.0);
        }
    };
    drop(child);
    let wall_s = elapsed(start);
    if mode.root && !mode.namespaces {
        let uid = SANDBOX_UID_BASE + pid as u32;
        reap_uid(uid);
        remove_files_of_uid(uid);
    }

    let collect = |rx: Option<mpsc::Receiver<(Vec<u8>, bool)>>| {
        rx.and_then(|rx| rx.recv_timeout(Duration::from_secs(1)).ok())
            .unwrap_or_default()
    };
    let (stdout, stdout_truncated) = collect(stdout_rx);
    let (stderr, stderr_truncated) = collect(stderr_rx);
    let (result_channel, _) = collect(result_rx);

    let status = match status {
        Ok(s) => s,
        Err(e) => return RawRun::sandbox_error(format!("wait: {e}"), wall_s),
    };
    let exit_code = status.code();
    let signal = status.signal();
    let timed_out = start.elapsed() >= limits.wall_time
        && (exit_code == Some(SUPERVISOR_TIMEOUT_EXIT) || signal.is_some());
    let outcome = if timed_out {
        Outcome::TimedOut
    } else if let Some(sig) = signal {
        // RLIMIT_CPU: SIGKILL at the hard limit (pid 1 of a pid namespace ignores SIGXCPU).
        // (rusage is tick-sampled and reads up to a few % below the enforced runtime)
        let at_cpu_limit = cpu_used_s >= 0.9 * limits.cpu_time_s.max(1) as f64 - 0.05;
        if sig == libc::SIGXCPU || (sig == libc::SIGKILL && at_cpu_limit) {
            Outcome::CpuLimit
        } else {
            Outcome::Killed { signal: sig }
        }
    } else if exit_code == Some(SUPERVISOR_ERROR_EXIT)
        && String::from_utf8_lossy(&stderr).contains("composer-sandbox:")
    {
        Outcome::SandboxError(String::from_utf8_lossy(&stderr).trim().to_string())
    } else if exit_code != Some(0) && String::from_utf8_lossy(&stderr).contains("MemoryError") {
        Outcome::MemoryLimit
    } else {
        Outcome::Completed
    };
    RawRun {
        stdout,
        stdout_truncated,
        stderr,
        stderr_truncated,
        result_channel,
        exit_code,
        outcome,
        wall_s,
    }
}

/// Reads a stream to EOF on its own thread, keeping the first `max` bytes (and draining the
/// rest so the writer never blocks). The receiver gets `(bytes, truncated)`.
fn spawn_reader<R: Read + Send + 'static>(mut r: R, max: usize) -> mpsc::Receiver<(Vec<u8>, bool)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut truncated = false;
        let mut buf = [0u8; 8192];
        loop {
            match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let room = max.saturating_sub(kept.len());
                    if n > room {
                        truncated = true;
                    }
                    kept.extend_from_slice(&buf[..n.min(room)]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = tx.send((kept, truncated));
    });
    rx
}

fn pipe_cloexec() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds is a valid 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 just returned two fresh descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// True when `pid` has exited (it is left unreaped).
fn wait_exited_nowait(pid: libc::pid_t) -> std::io::Result<bool> {
    loop {
        // SAFETY: siginfo is plain data; waitid fills it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if r == 0 {
            // SAFETY: reading si_pid of a siginfo filled by waitid.
            return Ok(unsafe { info.si_pid() } == pid);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Kills every process of `uid` (fallback cleanup without a pid namespace): a helper switches
/// to that uid and sends SIGKILL to all processes it may signal, i.e. exactly that uid's.
fn reap_uid(uid: u32) {
    let mut cmd = Command::new("/bin/true");
    cmd.env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: async-signal-safe syscalls only.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setresgid(uid, uid, uid) != 0
                || libc::setresuid(uid, uid, uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            libc::kill(-1, libc::SIGKILL);
            Ok(())
        });
    }
    if let Ok(mut c) = cmd.spawn() {
        let _ = c.wait();
    }
}

/// Fallback without a private /tmp (root only): removes what the run's uid left in the
/// world-writable directories.
fn remove_files_of_uid(uid: u32) {
    use std::os::unix::fs::MetadataExt;
    for dir in ["/tmp", "/var/tmp", "/dev/shm"] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            match std::fs::symlink_metadata(&path) {
                Ok(meta) if meta.uid() == uid && meta.is_dir() => {
                    let _ = std::fs::remove_dir_all(&path);
                }
                Ok(meta) if meta.uid() == uid => {
                    let _ = std::fs::remove_file(&path);
                }
                _ => {}
            }
        }
    }
}

/// Removes the working directory even if the sandbox made parts of it unreadable.
fn remove_dir_robust(dir: tempfile::TempDir) {
    let path = dir.path().to_path_buf();
    if dir.close().is_ok() {
        return;
    }
    fn make_writable(p: &Path) {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::symlink_metadata(p) {
            if meta.is_dir() {
                let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700));
                if let Ok(entries) = std::fs::read_dir(p) {
                    for e in entries.flatten() {
                        make_writable(&e.path());
                    }
                }
            }
        }
    }
    make_writable(&path);
    let _ = std::fs::remove_dir_all(&path);
}

// ---------------------------------------------------------------------------------------------
// Child side (after fork, before exec): async-signal-safe code only.
// ---------------------------------------------------------------------------------------------

fn os_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Writes `text` to a /proc file (uid_map, gid_map, setgroups).
unsafe fn write_proc(path: &std::ffi::CStr, text: &[u8]) -> std::io::Result<()> {
    let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
    if fd < 0 {
        return Err(os_err());
    }
    let n = libc::write(fd, text.as_ptr().cast(), text.len());
    let err = os_err();
    libc::close(fd);
    if n != text.len() as isize {
        return Err(err);
    }
    Ok(())
}

/// Writes the decimal digits of `v` into `out`, returning how many (no allocation).
fn format_u32(v: u32, out: &mut [u8]) -> usize {
    let mut digits = [0u8; 10];
    let mut n = 0;
    let mut v = v;
    loop {
        digits[n] = b'0' + (v % 10) as u8;
        n += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for i in 0..n {
        out[i] = digits[n - 1 - i];
    }
    n
}

/// Formats "`id` `id` 1\n" (an identity map of one id) into `buf` without allocating.
fn id_map_line(id: u32, buf: &mut [u8; 40]) -> usize {
    let mut len = format_u32(id, &mut buf[..]);
    buf[len] = b' ';
    len += 1;
    len += format_u32(id, &mut buf[len..]);
    buf[len..len + 3].copy_from_slice(b" 1\n");
    len + 3
}

/// `mkdir -p` for an absolute path, without allocating (existing directories are fine).
unsafe fn mkdir_all(path: &[u8]) -> std::io::Result<()> {
    let mut buf = [0u8; 4096];
    if path.len() >= buf.len() {
        return Err(std::io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    buf[..path.len()].copy_from_slice(path);
    for i in 1..=path.len() {
        if i == path.len() || buf[i] == b'/' {
            let saved = buf[i];
            buf[i] = 0;
            if libc::mkdir(buf.as_ptr().cast(), 0o700) != 0
                && *libc::__errno_location() != libc::EEXIST
            {
                return Err(os_err());
            }
            buf[i] = saved;
        }
    }
    Ok(())
}

/// Sets a resource limit, clamped to the current hard limit (we may lack CAP_SYS_RESOURCE).
unsafe fn set_limit(
    resource: libc::__rlimit_resource_t,
    soft: u64,
    hard: u64,
) -> std::io::Result<()> {
    let mut cur: libc::rlimit = std::mem::zeroed();
    if libc::getrlimit(resource, &mut cur) != 0 {
        return Err(os_err());
    }
    let hard = hard.min(cur.rlim_max);
    let lim = libc::rlimit {
        rlim_cur: soft.min(hard),
        rlim_max: hard,
    };
    if libc::setrlimit(resource, &lim) != 0 {
        return Err(os_err());
    }
    Ok(())
}

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const AT_RECURSIVE: libc::c_int = 0x8000;

unsafe fn mount_setattr(path: &std::ffi::CStr, set: u64, clr: u64) -> libc::c_long {
    let attr = MountAttr {
        attr_set: set,
        attr_clr: clr,
        propagation: 0,
        userns_fd: 0,
    };
    libc::syscall(
        libc::SYS_mount_setattr,
        libc::AT_FDCWD,
        path.as_ptr(),
        AT_RECURSIVE as libc::c_uint,
        &attr as *const MountAttr,
        std::mem::size_of::<MountAttr>(),
    )
}

unsafe fn mount_tmpfs(target: &std::ffi::CStr) -> libc::c_int {
    libc::mount(
        c"tmpfs".as_ptr(),
        target.as_ptr(),
        c"tmpfs".as_ptr(),
        libc::MS_NOSUID | libc::MS_NODEV,
        PRIVATE_TMP_OPTS.as_ptr().cast(),
    )
}

unsafe fn child_setup(plan: &ChildPlan) -> std::io::Result<()> {
    if libc::setsid() < 0 {
        return Err(os_err());
    }
    // No core dumps, for python and for the supervisor re-raising python's signal.
    set_limit(libc::RLIMIT_CORE, 0, 0)?;
    if plan.mode.root {
        // A per-run unprivileged uid: RLIMIT_NPROC applies, the rest of the file system is
        // not writable, and neither the parent nor other runs can be signalled.
        let uid = SANDBOX_UID_BASE + libc::getpid() as u32;
        if libc::chown(plan.workdir.as_ptr(), uid, uid) != 0
            || libc::setgroups(0, std::ptr::null()) != 0
            || libc::setresgid(uid, uid, uid) != 0
            || libc::setresuid(uid, uid, uid) != 0
        {
            return Err(os_err());
        }
        // Changing uid made us non-dumpable, which would make /proc/self/uid_map unwritable.
        libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0);
    }
    if plan.mode.namespaces {
        let uid = libc::getuid();
        let gid = libc::getgid();
        let mut flags = libc::CLONE_NEWUSER | libc::CLONE_NEWNS | libc::CLONE_NEWPID;
        if plan.isolate_net {
            flags |= libc::CLONE_NEWNET;
        }
        if libc::unshare(flags) != 0 {
            return Err(os_err());
        }
        let mut line = [0u8; 40];
        write_proc(c"/proc/self/setgroups", b"deny")?;
        let n = id_map_line(uid, &mut line);
        write_proc(c"/proc/self/uid_map", &line[..n])?;
        let n = id_map_line(gid, &mut line);
        write_proc(c"/proc/self/gid_map", &line[..n])?;
        // Our mounts must not propagate back to the host.
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Err(os_err());
        }
        // A handle on the working directory in the new mount namespace, to bind it back once
        // /tmp is covered.
        let workdir_fd = libc::open(
            plan.workdir.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        );
        if workdir_fd < 0 {
            return Err(os_err());
        }
        // Read-only file system (best effort: needs mount_setattr, Linux >= 5.12)...
        mount_setattr(c"/", MOUNT_ATTR_RDONLY, 0);
        // ...except device nodes such as /dev/null,
        mount_setattr(c"/dev", 0, MOUNT_ATTR_RDONLY);
        // private, size-limited tmpfs on the world-writable directories,
        if mount_tmpfs(c"/tmp") != 0 {
            return Err(os_err());
        }
        mount_tmpfs(c"/var/tmp");
        mount_tmpfs(c"/dev/shm");
        // and the working directory, writable, at its usual path (which the tmpfs may cover).
        mkdir_all(plan.workdir.as_bytes())?;
        let mut fd_path = [0u8; 40];
        fd_path[..14].copy_from_slice(b"/proc/self/fd/");
        let n = format_u32(workdir_fd as u32, &mut fd_path[14..]);
        fd_path[14 + n] = 0;
        if libc::mount(
            fd_path.as_ptr().cast(),
            plan.workdir.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        ) != 0
        {
            return Err(os_err());
        }
        libc::close(workdir_fd);
        mount_setattr(plan.workdir.as_c_str(), 0, MOUNT_ATTR_RDONLY);
        if libc::chdir(plan.workdir.as_ptr()) != 0 {
            return Err(os_err());
        }

        let pid = libc::fork();
        if pid < 0 {
            return Err(os_err());
        }
        if pid > 0 {
            supervise(pid, plan);
        }
        // pid 1 of the new pid namespace: a /proc that shows only this namespace.
        libc::mount(
            c"proc".as_ptr(),
            c"/proc".as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        );
    } else {
        let pid = libc::fork();
        if pid < 0 {
            return Err(os_err());
        }
        if pid > 0 {
            supervise(pid, plan);
        }
    }
    // The sandboxed process: dies with its supervisor, then gets its limits and execs python.
    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
    let flags = libc::fcntl(plan.result_fd, libc::F_GETFD);
    if flags < 0 || libc::fcntl(plan.result_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
        return Err(os_err());
    }
    // soft == hard: SIGKILL at the limit (SIGXCPU would be ignored by a pid-namespace init).
    set_limit(libc::RLIMIT_CPU, plan.cpu_s, plan.cpu_s)?;
    set_limit(libc::RLIMIT_AS, plan.address_space, plan.address_space)?;
    set_limit(libc::RLIMIT_FSIZE, plan.fsize, plan.fsize)?;
    set_limit(libc::RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES)?;
    set_limit(libc::RLIMIT_NPROC, plan.nproc, plan.nproc)?;
    Ok(())
}

/// The supervisor: closes every inherited descriptor except stdio (so the parent's spawn
/// returns and its pipes see EOF when python is done), waits for python, kills it at the
/// wall-clock deadline, and exits the way python did.
unsafe fn supervise(pid: libc::pid_t, plan: &ChildPlan) -> ! {
    // This process is a copy of the parent (its environment and heap included) running under
    // the sandbox's uid: non-dumpable, so the sandbox cannot read its /proc files or ptrace it.
    libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    libc::syscall(
        libc::SYS_close_range,
        3 as libc::c_uint,
        libc::c_uint::MAX,
        0 as libc::c_uint,
    );
    let mut start: libc::timespec = std::mem::zeroed();
    libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut start);
    // Sleep until python changes state (SIGCHLD, blocked so it stays pending) or the deadline.
    let mut sigchld: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut sigchld);
    libc::sigaddset(&mut sigchld, libc::SIGCHLD);
    libc::sigprocmask(libc::SIG_BLOCK, &sigchld, std::ptr::null_mut());
    let mut status: libc::c_int = 0;
    loop {
        let r = libc::waitpid(pid, &mut status, libc::WNOHANG);
        if r == pid {
            break;
        }
        if r < 0 && *libc::__errno_location() != libc::EINTR {
            let msg = b"composer-sandbox: supervisor waitpid failed\n";
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::_exit(SUPERVISOR_ERROR_EXIT);
        }
        let mut now: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now);
        let elapsed_ms = (now.tv_sec - start.tv_sec) as i64 * 1000
            + (now.tv_nsec - start.tv_nsec) as i64 / 1_000_000;
        if elapsed_ms >= plan.wall_ms as i64 {
            // Killing pid 1 of the pid namespace kills every process in it.
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, &mut status, 0);
            libc::_exit(SUPERVISOR_TIMEOUT_EXIT);
        }
        let remaining_ms = (plan.wall_ms as i64 - elapsed_ms).clamp(1, 100);
        let pause = libc::timespec {
            tv_sec: 0,
            tv_nsec: remaining_ms * 1_000_000,
        };
        libc::sigtimedwait(&sigchld, std::ptr::null_mut(), &pause);
    }
    if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::kill(libc::getpid(), sig);
        libc::_exit(128 + sig);
    }
    libc::_exit(libc::WEXITSTATUS(status));
}
