//! The process-level sandbox: spawning a command under resource limits, namespaces and a
//! private root file system, and killing everything it started.
//!
//! Process tree of one run (all set up in `pre_exec`, i.e. in the forked child before `exec`):
//!
//! ```text
//! parent (this process)
//!  └─ supervisor  (own session; joins the run's cgroup; when root: switches to the sandbox's
//!      │           unprivileged uid; when the kernel allows: new user+mount+pid(+net)
//!      │           namespaces)
//!      └─ command (pid 1 of the new pid namespace; private root: read-only system
//!                  directories, a tmpfs /tmp, the working copy at /workspace; rlimits;
//!                  parent-death signal SIGKILL)
//! ```
//!
//! The supervisor never runs untrusted code: it waits for the command, kills it at the
//! wall-clock deadline (which takes the whole pid namespace down with it) and forwards its exit
//! status. Everything between `fork` and `exec` only uses async-signal-safe libc calls on
//! memory prepared before the fork (no allocation), as required in a multi-threaded parent.

use std::ffi::CString;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::cgroup::Cgroup;
use crate::{NetworkPolicy, Outcome, SandboxLimits};

/// Base of the sandbox uids used when the parent runs as root (see [`alloc_uid`]).
const SANDBOX_UID_BASE: u32 = 0x5A00_0000;
/// Exit code of the supervisor when it killed the command at the wall-clock deadline.
const SUPERVISOR_TIMEOUT_EXIT: i32 = 124;
/// Exit code of the supervisor when its own setup failed after the fork.
const SUPERVISOR_ERROR_EXIT: i32 = 125;
/// Options of the private tmpfs on /tmp and /dev/shm inside the sandbox.
const PRIVATE_TMP_OPTS: &std::ffi::CStr = c"size=64m,mode=1777";
/// Options of the tmpfs that becomes the sandbox's root (only mount points live there).
const ROOT_OPTS: &std::ffi::CStr = c"size=1m,mode=0755";
/// Open-file limit inside the sandbox.
const MAX_OPEN_FILES: u64 = 256;
/// Cap on one line of the result channel, and on the whole channel.
const MAX_LINE_BYTES: usize = 16 << 20;
const MAX_CHANNEL_BYTES: usize = 256 << 20;
/// Lines buffered between the channel's reader thread and its consumer (back-pressure: a
/// process spamming its channel blocks instead of filling the parent's memory).
const CHANNEL_QUEUE: usize = 16;
/// Extra time after the wall-clock limit before the parent kills the process group itself
/// (the supervisor normally kills the command exactly at the deadline).
const PARENT_GRACE: Duration = Duration::from_secs(2);
/// The descriptor number the result channel gets inside the sandbox.
pub(crate) const CHANNEL_FD: RawFd = 3;
/// Where the working copy appears inside the private root.
pub(crate) const SANDBOX_WORKDIR: &str = "/workspace";

/// System directories bound read-only into the private root (when they exist; symlinks such
/// as a merged-/usr `/bin -> usr/bin` are recreated as symlinks).
const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];
/// The only files of /etc the sandbox sees (the dynamic loader's cache, time zone, the
/// alternatives symlinks that /usr/bin entries may point through).
const ETC_FILES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
];
/// Device nodes bound into the private /dev.
const DEV_NODES: &[&str] = &["null", "zero", "full", "random", "urandom"];
/// Mounts that stay writable inside the read-only private root.
const WRITABLE: &[&std::ffi::CStr] = &[
    c"/workspace",
    c"/tmp",
    c"/dev/shm",
    c"/dev/null",
    c"/dev/zero",
    c"/dev/full",
    c"/dev/random",
    c"/dev/urandom",
];

/// What the kernel and the current credentials allow, probed once per process.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Capabilities {
    /// The parent runs as uid 0 (then every sandbox runs under its own unprivileged uid).
    pub running_as_root: bool,
    /// Sandboxes run under a uid of their own (only possible as root).
    pub distinct_uid: bool,
    /// Unprivileged user namespaces work, so the mount/pid/net namespaces below are used.
    pub user_namespace: bool,
    /// No network: each run gets an empty network namespace (only loopback, down); abstract
    /// AF_UNIX sockets of the host are out of reach too.
    pub network_namespace: bool,
    /// Each run is pid 1 of its own pid namespace: all its processes die with it.
    pub pid_namespace: bool,
    /// Private root: only system directories (read-only), a tmpfs /tmp and the working copy;
    /// no host /tmp, /home, /root, /etc beyond the loader's files, no host socket paths.
    pub private_root: bool,
    /// Private tmpfs on /tmp and /dev/shm.
    pub private_tmp: bool,
    /// Everything except the working copy, /tmp and /dev/shm is read-only.
    pub read_only_root: bool,
    /// A fresh /proc for the pid namespace (other processes invisible).
    pub private_proc: bool,
    /// RLIMIT_NPROC is enforced for the sandboxed processes (not the case for a root process).
    pub nproc_enforced: bool,
    /// The cgroup that caps memory and processes of a whole run, when there is one.
    pub cgroup: Option<String>,
    /// A seccomp filter denies namespace, mount, ptrace, bpf, keyring, io_uring... calls.
    pub seccomp: bool,
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
    pub exit_code: Option<i32>,
    pub outcome: Outcome,
    pub wall_s: f64,
}

impl RawRun {
    pub(crate) fn sandbox_error(reason: String, wall_s: f64) -> RawRun {
        RawRun {
            stdout: Vec::new(),
            stdout_truncated: false,
            stderr: Vec::new(),
            stderr_truncated: false,
            exit_code: None,
            outcome: Outcome::SandboxError(reason),
            wall_s,
        }
    }
}

/// How the child isolates itself; decided once by the capability probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mode {
    pub namespaces: bool,
    pub root: bool,
}

/// One step building the private root, with host paths prepared before the fork.
enum Step {
    /// `mkdir -p` then a recursive bind mount of a directory.
    BindDir(CString, CString),
    /// Create an empty file then bind a file (or device node) onto it.
    BindFile(CString, CString),
    /// A symlink `dst -> target`.
    Symlink(CString, CString),
    /// `mkdir -p` then a private tmpfs.
    Tmpfs(CString),
    /// `mkdir -p` then a fresh procfs (best effort).
    Proc(CString),
    /// `mkdir -p`.
    Dir(CString),
}

/// Everything the forked child needs, prepared before the fork (no allocation after it).
struct ChildPlan {
    mode: Mode,
    isolate_net: bool,
    uid: Option<u32>,
    workdir: CString,
    root_dir: CString,
    steps: Vec<Step>,
    channel_fd: RawFd,
    cgroup_fds: Vec<RawFd>,
    seccomp: Vec<libc::sock_filter>,
    wall_ms: u64,
    cpu_s: u64,
    address_space: u64,
    nproc: u64,
    fsize: u64,
}

/// The python interpreter: `$COMPOSER_SANDBOX_PYTHON`, else a system python3, else `python3`
/// from PATH resolved to `sys.executable`.
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

/// Directories outside [`SYSTEM_DIRS`] that the interpreter needs (its installation prefix),
/// bound read-only at the same path.
fn interpreter_binds() -> &'static Vec<PathBuf> {
    static BINDS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    BINDS.get_or_init(|| {
        let Some(real) = python_path().and_then(|p| std::fs::canonicalize(p).ok()) else {
            return Vec::new();
        };
        if SYSTEM_DIRS.iter().any(|d| real.starts_with(d)) {
            return Vec::new();
        }
        // <prefix>/bin/python3 -> <prefix>
        real.parent()
            .and_then(Path::parent)
            .filter(|p| p.as_os_str().len() > 1)
            .map(|p| vec![p.to_path_buf()])
            .unwrap_or_default()
    })
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A uid for a new sandbox when running as root: unique among the sandboxes of all processes
/// on this machine while fewer than 512 of one process are alive (pid in the high bits).
pub(crate) fn alloc_uid() -> u32 {
    static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & 0x1FF;
    SANDBOX_UID_BASE + ((std::process::id() & 0x3F_FFFF) << 9) + n
}

/// Probe script: prints what isolation it observes, one `key=value` per line.
const PROBE_SCRIPT: &str = r#"
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
"#;

static PROBE: OnceLock<(Capabilities, Mode)> = OnceLock::new();

/// Probes (once per process) what isolation this kernel allows; see [`Capabilities`].
pub fn sandbox_capabilities() -> Capabilities {
    PROBE.get_or_init(probe).0.clone()
}

pub(crate) fn mode() -> Mode {
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
        private_root: false,
        private_tmp: false,
        read_only_root: false,
        private_proc: false,
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
    };
    if caps.python.is_none() {
        caps.notes.push("no python3 interpreter found".to_string());
        mode.namespaces = false;
        return (caps, mode);
    }
    let forced_fallback = std::env::var_os("COMPOSER_SANDBOX_NO_NAMESPACES").is_some();
    let limits = SandboxLimits::default();
    let run_probe = |mode: Mode| -> RawRun {
        let dirs = match SandboxDirs::new(mode) {
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

/// The host side of one sandbox: a private directory holding the working copy (`work/`) and
/// the mount point of the private root (`root/`), plus the uid its processes run under.
pub(crate) struct SandboxDirs {
    base: Option<tempfile::TempDir>,
    work: PathBuf,
    root: PathBuf,
    /// The sandbox's own uid when the parent is root.
    pub uid: Option<u32>,
}

impl SandboxDirs {
    /// Creates the directories (owned by the sandbox's uid when root).
    pub(crate) fn new(mode: Mode) -> anyhow::Result<SandboxDirs> {
        use anyhow::Context;
        let base = tempfile::Builder::new()
            .prefix("composer-sandbox-")
            .tempdir()
            .context("creating the sandbox directory")?;
        let work = base.path().join("work");
        let root = base.path().join("root");
        std::fs::create_dir(&work).context("creating the working copy directory")?;
        std::fs::create_dir(&root).context("creating the private root mount point")?;
        let uid = mode.root.then(alloc_uid);
        if let Some(uid) = uid {
            for p in [base.path(), &work, &root] {
                std::os::unix::fs::lchown(p, Some(uid), Some(uid))
                    .with_context(|| format!("chown {}", p.display()))?;
            }
        }
        Ok(SandboxDirs {
            base: Some(base),
            work,
            root,
            uid,
        })
    }

    /// The sandbox's directory (host path).
    fn base_path(&self) -> PathBuf {
        self.work
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }

    /// The working copy (host path).
    pub(crate) fn work(&self) -> &Path {
        &self.work
    }

    /// Writes a file at `rel` (a plain relative path) in the working copy, refusing to go
    /// through symlinks, owned by the sandbox's uid.
    pub(crate) fn write_file(&self, rel: &str, contents: &[u8]) -> anyhow::Result<()> {
        let path = safe_join(&self.work, rel, true)?;
        if let Some(parent) = path.parent() {
            self.mkdirs(parent)?;
        }
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        // Replace rather than write through: an existing entry may be a hard link the sandbox
        // made to a host file (only possible without a mount namespace).
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => anyhow::bail!("writing {rel}: is a directory"),
            Ok(_) => {
                std::fs::remove_file(&path).map_err(|e| anyhow::anyhow!("writing {rel}: {e}"))?
            }
            Err(_) => {}
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| anyhow::anyhow!("writing {rel}: {e}"))?;
        f.write_all(contents)
            .map_err(|e| anyhow::anyhow!("writing {rel}: {e}"))?;
        if let Some(uid) = self.uid {
            std::os::unix::fs::lchown(&path, Some(uid), Some(uid))
                .map_err(|e| anyhow::anyhow!("chown {rel}: {e}"))?;
        }
        Ok(())
    }

    /// Reads a regular file of the working copy (no symlinks followed).
    pub(crate) fn read_file(&self, rel: &str) -> anyhow::Result<Vec<u8>> {
        read_regular(&self.work, rel)
    }

    fn mkdirs(&self, dir: &Path) -> anyhow::Result<()> {
        let rel = dir.strip_prefix(&self.work).unwrap_or(Path::new(""));
        let mut cur = self.work.clone();
        for c in rel.components() {
            cur.push(c);
            match std::fs::symlink_metadata(&cur) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => anyhow::bail!("{} is not a directory", cur.display()),
                Err(_) => {
                    std::fs::create_dir(&cur)
                        .map_err(|e| anyhow::anyhow!("mkdir {}: {e}", cur.display()))?;
                    if let Some(uid) = self.uid {
                        let _ = std::os::unix::fs::lchown(&cur, Some(uid), Some(uid));
                    }
                }
            }
        }
        Ok(())
    }
}

impl Drop for SandboxDirs {
    fn drop(&mut self) {
        if let Some(base) = self.base.take() {
            remove_dir_robust(base);
        }
    }
}

/// Reads the regular file `rel` under `root`: no symlinks followed, no hard-linked files (which
/// could be host files linked in where there is no mount namespace), no devices or FIFOs.
pub(crate) fn read_regular(root: &Path, rel: &str) -> anyhow::Result<Vec<u8>> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let path = safe_join(root, rel, false)?;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("reading {rel}: {e}"))?;
    let meta = f
        .metadata()
        .map_err(|e| anyhow::anyhow!("reading {rel}: {e}"))?;
    if !meta.is_file() {
        anyhow::bail!("reading {rel}: not a regular file");
    }
    if meta.nlink() > 1 {
        anyhow::bail!("reading {rel}: refusing a file with several hard links");
    }
    let mut out = Vec::new();
    f.read_to_end(&mut out)
        .map_err(|e| anyhow::anyhow!("reading {rel}: {e}"))?;
    Ok(out)
}

/// `root/rel` for a plain relative path: no absolute paths, no `..`, and no existing symlink
/// on the way (the sandbox may have planted some; nothing of it runs while the parent looks).
pub(crate) fn safe_join(root: &Path, rel: &str, allow_missing: bool) -> anyhow::Result<PathBuf> {
    use std::path::Component;
    let p = Path::new(rel);
    let mut out = root.to_path_buf();
    let mut any = false;
    for c in p.components() {
        match c {
            Component::Normal(n) => {
                out.push(n);
                any = true;
                match std::fs::symlink_metadata(&out) {
                    Ok(m) if m.file_type().is_symlink() => {
                        anyhow::bail!("{rel}: refusing to follow a symlink in the working copy")
                    }
                    Ok(_) => {}
                    Err(_) if allow_missing => {}
                    Err(e) => anyhow::bail!("{rel}: {e}"),
                }
            }
            Component::CurDir => {}
            _ => anyhow::bail!("{rel}: only plain relative paths inside the working copy"),
        }
    }
    if !any {
        anyhow::bail!("{rel:?}: not a file path");
    }
    Ok(out)
}

/// Gives every file of the working copy to `uid` (files the parent put there, or left by an
/// earlier run under the same uid), without following symlinks.
fn chown_tree(dir: &Path, uid: u32) {
    let _ = std::os::unix::fs::lchown(dir, Some(uid), Some(uid));
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            match std::fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() => chown_tree(&p, uid),
                // Never chown a hard link: it may be a host file (no mount namespace).
                Ok(m) if std::os::unix::fs::MetadataExt::nlink(&m) > 1 => {}
                Ok(_) => {
                    let _ = std::os::unix::fs::lchown(&p, Some(uid), Some(uid));
                }
                Err(_) => {}
            }
        }
    }
}

fn cstr(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("path {} has a NUL byte", p.display()))
}

/// The steps building the private root under `root` (host path of the mount point).
fn root_steps(root: &Path, work: &Path, extra_ro: &[PathBuf]) -> Result<Vec<Step>, String> {
    let at = |inner: &str| cstr(&root.join(inner.trim_start_matches('/')));
    let mut steps = Vec::new();
    for d in SYSTEM_DIRS {
        let p = Path::new(d);
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(target) = std::fs::read_link(p) {
                    steps.push(Step::Symlink(cstr(&target)?, at(d)?));
                }
            }
            Ok(m) if m.is_dir() => steps.push(Step::BindDir(cstr(p)?, at(d)?)),
            _ => {}
        }
    }
    for extra in interpreter_binds().iter().chain(extra_ro) {
        if extra.is_dir() {
            let inner = extra.display().to_string();
            steps.push(Step::BindDir(cstr(extra)?, at(&inner)?));
        }
    }
    steps.push(Step::Dir(at("/etc")?));
    for f in ETC_FILES {
        let p = Path::new(f);
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => steps.push(Step::BindDir(cstr(p)?, at(f)?)),
            Ok(m) if m.is_file() => steps.push(Step::BindFile(cstr(p)?, at(f)?)),
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(target) = std::fs::read_link(p) {
                    steps.push(Step::Symlink(cstr(&target)?, at(f)?));
                }
            }
            _ => {}
        }
    }
    steps.push(Step::Dir(at("/dev")?));
    for n in DEV_NODES {
        let host = Path::new("/dev").join(n);
        if host.exists() {
            steps.push(Step::BindFile(cstr(&host)?, at(&format!("/dev/{n}"))?));
        }
    }
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        steps.push(Step::Symlink(
            cstr(Path::new(target))?,
            at(&format!("/dev/{name}"))?,
        ));
    }
    steps.push(Step::Tmpfs(at("/dev/shm")?));
    steps.push(Step::Tmpfs(at("/tmp")?));
    steps.push(Step::BindDir(cstr(work)?, at(SANDBOX_WORKDIR)?));
    steps.push(Step::Proc(at("/proc")?));
    Ok(steps)
}

/// A started sandboxed command.
pub(crate) struct Running {
    child: Child,
    pid: libc::pid_t,
    start: Instant,
    wall: Duration,
    cpu_s: u64,
    /// The command's stdin (drop it to send EOF).
    pub stdin: Option<ChildStdin>,
    stdout_rx: Option<mpsc::Receiver<(Vec<u8>, bool)>>,
    stderr_rx: Option<mpsc::Receiver<(Vec<u8>, bool)>>,
    /// Lines of the result channel (fd 3 inside), when one was asked for.
    pub channel: Option<mpsc::Receiver<Vec<u8>>>,
    cgroup: Option<Cgroup>,
    mode: Mode,
    uid: Option<u32>,
    /// The sandbox's directory on the host (spared by the fallback clean-up).
    keep: PathBuf,
}

/// Why untrusted code must not run at all in `mode`, if so: the same uid as the parent and no
/// pid namespace (the code could signal or ptrace-read this process and leave processes
/// behind), unless explicitly accepted with `COMPOSER_SANDBOX_ALLOW_WEAK=1`.
pub(crate) fn refusal(mode: Mode) -> Option<String> {
    (!mode.namespaces && !mode.root && std::env::var_os("COMPOSER_SANDBOX_ALLOW_WEAK").is_none())
        .then(|| {
            "refusing to run untrusted code: not root and no user namespaces, so the code \
             could signal this process (set COMPOSER_SANDBOX_ALLOW_WEAK=1 to accept)"
                .to_string()
        })
}

/// Starts `argv` in the sandbox `dirs` (working directory = the working copy). `channel`
/// gives the command a result channel on fd 3, read line by line through
/// [`Running::channel`].
pub(crate) fn spawn(
    dirs: &SandboxDirs,
    argv: &[&str],
    limits: &SandboxLimits,
    wall: Duration,
    cpu_s: u64,
    channel: bool,
    mode: Mode,
) -> Result<Running, String> {
    let start = Instant::now();
    if let Some(reason) = refusal(mode) {
        return Err(reason);
    }
    let Some(program) = argv.first() else {
        return Err("empty command".to_string());
    };
    if let Some(uid) = dirs.uid {
        chown_tree(&dirs.work, uid);
    }
    let steps = if mode.namespaces {
        root_steps(&dirs.root, &dirs.work, &[])?
    } else {
        Vec::new()
    };
    let cgroup = if mode.root {
        Cgroup::create(limits.memory_bytes, limits.max_processes.max(1) + 1)
            .map_err(|e| format!("creating the run's cgroup: {e}"))?
    } else {
        None
    };
    let (chan_read, chan_write) = if channel {
        let (r, w) = pipe_cloexec().map_err(|e| format!("pipe: {e}"))?;
        (Some(r), Some(w))
    } else {
        (None, None)
    };
    let plan = ChildPlan {
        mode,
        isolate_net: limits.network == NetworkPolicy::Isolated,
        uid: dirs.uid,
        workdir: cstr(&dirs.work)?,
        root_dir: cstr(&dirs.root)?,
        steps,
        channel_fd: chan_write.as_ref().map_or(-1, |w| w.as_raw_fd()),
        cgroup_fds: cgroup.as_ref().map(|c| c.procs_fds()).unwrap_or_default(),
        seccomp: if std::env::var_os("COMPOSER_SANDBOX_NO_SECCOMP").is_some() {
            Vec::new()
        } else {
            crate::seccomp::filter()
        },
        wall_ms: wall.as_millis().min(u64::MAX as u128) as u64,
        cpu_s: cpu_s.max(1),
        address_space: limits.address_space_bytes,
        nproc: limits.max_processes.max(1),
        fsize: limits.max_file_bytes,
    };
    let home = if mode.namespaces {
        "/tmp".to_string()
    } else {
        dirs.work.display().to_string()
    };
    let mut cmd = Command::new(program);
    cmd.args(&argv[1..])
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", &home)
        .env("TMPDIR", &home)
        .env("LANG", "C.UTF-8")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the closure only makes async-signal-safe libc calls on `plan`, which is fully
    // built before the fork and not mutated afterwards.
    unsafe {
        cmd.pre_exec(move || child_setup(&plan));
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("spawning {program} in the sandbox: {e}"))?;
    drop(chan_write);
    let pid = child.id() as libc::pid_t;
    let max_out = limits.max_output_bytes;
    let stdout_rx = child.stdout.take().map(|s| spawn_reader(s, max_out));
    let stderr_rx = child.stderr.take().map(|s| spawn_reader(s, max_out));
    let channel = chan_read.map(|r| spawn_line_reader(std::fs::File::from(r)));
    Ok(Running {
        stdin: child.stdin.take(),
        child,
        pid,
        start,
        wall,
        cpu_s: cpu_s.max(1),
        stdout_rx,
        stderr_rx,
        channel,
        cgroup,
        mode,
        uid: dirs.uid,
        keep: dirs.base_path(),
    })
}

impl Running {
    /// When the run's wall-clock deadline (plus the parent's grace) passes.
    pub(crate) fn deadline(&self) -> Instant {
        self.start + self.wall + PARENT_GRACE
    }

    /// Waits for the command to end (killing it at the deadline), kills every process it
    /// left, and collects the outputs.
    pub(crate) fn finish(mut self) -> RawRun {
        drop(self.stdin.take());
        let pid = self.pid;
        let start = self.start;
        let elapsed = |start: Instant| start.elapsed().as_secs_f64();
        // Wait without reaping (so the pid, which is also the process-group id, stays
        // reserved), kill what is left of the process group, then reap.
        let backstop = self.wall + PARENT_GRACE;
        let mut backstop_fired = false;
        loop {
            match wait_exited_nowait(pid) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return RawRun::sandbox_error(format!("waitid: {e}"), elapsed(start));
                }
            }
            if !backstop_fired && start.elapsed() >= backstop {
                // SAFETY: plain syscall; pid is our unreaped child, so the group id is ours.
                unsafe { libc::killpg(pid, libc::SIGKILL) };
                if let Some(cg) = &self.cgroup {
                    cg.kill_all();
                }
                backstop_fired = true;
            }
            std::thread::sleep(Duration::from_millis(3));
        }
        // SAFETY: as above; leftovers of the group (only possible without a pid namespace).
        unsafe { libc::killpg(pid, libc::SIGKILL) };
        if let Some(cg) = &self.cgroup {
            cg.kill_all();
        }
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
        let wall_s = elapsed(start);
        if let (false, Some(uid)) = (self.mode.namespaces, self.uid) {
            reap_uid(uid);
            remove_files_of_uid(uid, &self.keep);
        }
        let oom = self.cgroup.as_ref().is_some_and(|c| c.oom_killed());
        drop(self.cgroup.take());

        let collect = |rx: Option<mpsc::Receiver<(Vec<u8>, bool)>>| {
            rx.and_then(|rx| rx.recv_timeout(Duration::from_secs(1)).ok())
                .unwrap_or_default()
        };
        let (stdout, stdout_truncated) = collect(self.stdout_rx.take());
        let (stderr, stderr_truncated) = collect(self.stderr_rx.take());

        let status = match status {
            Ok(s) => s,
            Err(e) => return RawRun::sandbox_error(format!("wait: {e}"), wall_s),
        };
        let exit_code = status.code();
        let signal = status.signal();
        let timed_out = start.elapsed() >= self.wall
            && (exit_code == Some(SUPERVISOR_TIMEOUT_EXIT) || signal.is_some());
        let outcome = if timed_out {
            Outcome::TimedOut
        } else if oom {
            Outcome::MemoryLimit
        } else if let Some(sig) = signal {
            // RLIMIT_CPU: SIGKILL at the hard limit (pid 1 of a pid namespace ignores SIGXCPU).
            // (rusage is tick-sampled and reads up to a few % below the enforced runtime)
            let at_cpu_limit = cpu_used_s >= 0.9 * self.cpu_s as f64 - 0.05;
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
            exit_code,
            outcome,
            wall_s,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Only reached without `finish` on error paths: kill everything.
        if self.stdout_rx.is_some() {
            // SAFETY: plain syscalls on our own child's process group.
            unsafe { libc::killpg(self.pid, libc::SIGKILL) };
            if let Some(cg) = &self.cgroup {
                cg.kill_all();
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Reads lines of a stream on its own thread (each line cut at [`MAX_LINE_BYTES`], reading
/// stops after [`MAX_CHANNEL_BYTES`]).
fn spawn_line_reader<R: Read + Send + 'static>(r: R) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::sync_channel(CHANNEL_QUEUE);
    std::thread::spawn(move || {
        let mut reader = std::io::BufReader::new(r);
        let mut total = 0usize;
        loop {
            let mut line = Vec::new();
            let mut limited = std::io::Read::take(&mut reader, MAX_LINE_BYTES as u64);
            match std::io::BufRead::read_until(&mut limited, b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    total += n;
                    if tx.send(line).is_err() || total > MAX_CHANNEL_BYTES {
                        break;
                    }
                }
            }
        }
    });
    rx
}

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
fn remove_files_of_uid(uid: u32, keep: &Path) {
    use std::os::unix::fs::MetadataExt;
    for dir in ["/tmp", "/var/tmp", "/dev/shm"] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path == keep {
                // The sandbox's own directory (its working copy persists between runs).
                continue;
            }
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
const MOUNT_ATTR_NOSUID: u64 = 0x2;
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

unsafe fn mount_tmpfs(target: &std::ffi::CStr, opts: &std::ffi::CStr) -> std::io::Result<()> {
    if libc::mount(
        c"tmpfs".as_ptr(),
        target.as_ptr(),
        c"tmpfs".as_ptr(),
        libc::MS_NOSUID | libc::MS_NODEV,
        opts.as_ptr().cast(),
    ) != 0
    {
        return Err(os_err());
    }
    Ok(())
}

unsafe fn bind(src: &std::ffi::CStr, dst: &std::ffi::CStr) -> std::io::Result<()> {
    if libc::mount(
        src.as_ptr(),
        dst.as_ptr(),
        std::ptr::null(),
        libc::MS_BIND | libc::MS_REC,
        std::ptr::null(),
    ) != 0
    {
        return Err(os_err());
    }
    Ok(())
}

/// Creates the parent directories of `path` (a NUL-terminated absolute path).
unsafe fn mkdir_parent(path: &std::ffi::CStr) -> std::io::Result<()> {
    let bytes = path.to_bytes();
    match bytes.iter().rposition(|&b| b == b'/') {
        Some(0) | None => Ok(()),
        Some(i) => mkdir_all(&bytes[..i]),
    }
}

/// Builds the private root under `plan.root_dir` and pivots into it. Runs as pid 1 of the new
/// pid namespace, with the old root still attached (so procfs may be mounted).
unsafe fn enter_private_root(plan: &ChildPlan) -> std::io::Result<()> {
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
    mount_tmpfs(plan.root_dir.as_c_str(), ROOT_OPTS)?;
    for step in &plan.steps {
        match step {
            Step::BindDir(src, dst) => {
                mkdir_all(dst.to_bytes())?;
                bind(src, dst)?;
            }
            Step::BindFile(src, dst) => {
                mkdir_parent(dst)?;
                let fd = libc::open(
                    dst.as_ptr(),
                    libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o644,
                );
                if fd < 0 {
                    return Err(os_err());
                }
                libc::close(fd);
                bind(src, dst)?;
            }
            Step::Symlink(target, dst) => {
                mkdir_parent(dst)?;
                if libc::symlink(target.as_ptr(), dst.as_ptr()) != 0 {
                    return Err(os_err());
                }
            }
            Step::Tmpfs(dst) => {
                mkdir_all(dst.to_bytes())?;
                mount_tmpfs(dst, PRIVATE_TMP_OPTS)?;
            }
            Step::Proc(dst) => {
                mkdir_all(dst.to_bytes())?;
                // Best effort: refused where the host's /proc is partly covered.
                libc::mount(
                    c"proc".as_ptr(),
                    dst.as_ptr(),
                    c"proc".as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                    std::ptr::null(),
                );
            }
            Step::Dir(dst) => mkdir_all(dst.to_bytes())?,
        }
    }
    if libc::chdir(plan.root_dir.as_ptr()) != 0
        || libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) != 0
        || libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0
        || libc::chdir(c"/".as_ptr()) != 0
    {
        return Err(os_err());
    }
    // Everything read-only and nosuid (needs mount_setattr, Linux >= 5.12: required), ...
    if mount_setattr(c"/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0) != 0 {
        return Err(os_err());
    }
    // ...except the working copy, the private tmpfs and the device nodes.
    for w in WRITABLE {
        mount_setattr(w, 0, MOUNT_ATTR_RDONLY);
    }
    Ok(())
}

unsafe fn child_setup(plan: &ChildPlan) -> std::io::Result<()> {
    if libc::setsid() < 0 {
        return Err(os_err());
    }
    // No core dumps, for the command and for the supervisor re-raising its signal.
    set_limit(libc::RLIMIT_CORE, 0, 0)?;
    // Join the run's cgroup(s) first: every later process is counted and capped.
    for &fd in &plan.cgroup_fds {
        if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
            return Err(os_err());
        }
    }
    if let Some(uid) = plan.uid {
        // The sandbox's own unprivileged uid: RLIMIT_NPROC applies, host files are only
        // readable where world-readable, and neither the parent nor other sandboxes can be
        // signalled.
        if libc::setgroups(0, std::ptr::null()) != 0
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
        let pid = libc::fork();
        if pid < 0 {
            return Err(os_err());
        }
        if pid > 0 {
            supervise(pid, plan);
        }
        // pid 1 of the new pid namespace.
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        enter_private_root(plan)?;
        if libc::chdir(c"/workspace".as_ptr()) != 0 {
            return Err(os_err());
        }
    } else {
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
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
    }
    // The sandboxed process: the result channel on fd 3, then its limits, then exec.
    if plan.channel_fd >= 0 {
        if plan.channel_fd == CHANNEL_FD {
            let flags = libc::fcntl(CHANNEL_FD, libc::F_GETFD);
            if flags < 0 || libc::fcntl(CHANNEL_FD, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(os_err());
            }
        } else if libc::dup2(plan.channel_fd, CHANNEL_FD) < 0 {
            return Err(os_err());
        }
    }
    // No other inherited descriptor survives the exec: mark them all close-on-exec (not
    // closed now: std reports exec errors through one of them). Best effort: needs
    // close_range with CLOSE_RANGE_CLOEXEC, Linux >= 5.11.
    let first_closed = if plan.channel_fd >= 0 {
        CHANNEL_FD + 1
    } else {
        3
    };
    libc::syscall(
        libc::SYS_close_range,
        first_closed as libc::c_uint,
        libc::c_uint::MAX,
        4 as libc::c_uint, // CLOSE_RANGE_CLOEXEC
    );
    // soft == hard: SIGKILL at the limit (SIGXCPU would be ignored by a pid-namespace init).
    set_limit(libc::RLIMIT_CPU, plan.cpu_s, plan.cpu_s)?;
    set_limit(libc::RLIMIT_AS, plan.address_space, plan.address_space)?;
    set_limit(libc::RLIMIT_FSIZE, plan.fsize, plan.fsize)?;
    set_limit(libc::RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES)?;
    set_limit(libc::RLIMIT_NPROC, plan.nproc, plan.nproc)?;
    // Last: the system-call filter (best effort; reported by the capability probe).
    crate::seccomp::install(&plan.seccomp);
    Ok(())
}

/// The supervisor: closes every inherited descriptor except stdio (so the parent's spawn
/// returns and its pipes see EOF when the command is done), waits for the command, kills it at the
/// wall-clock deadline, and exits the way the command did.
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
    // Sleep until the command changes state (SIGCHLD, blocked so it stays pending) or the deadline.
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
