//! Shared definitions of the process sandbox: limits and paths of the private root, the
//! capability report, the raw result of a run, the isolation mode, the interpreter and uids.
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::Outcome;

/// Base of the sandbox uids used when the parent runs as root (see [`alloc_uid`]).
pub(super) const SANDBOX_UID_BASE: u32 = 0x5A00_0000;
/// Exit code of the supervisor when it killed the command at the wall-clock deadline.
pub(super) const SUPERVISOR_TIMEOUT_EXIT: i32 = 124;
/// Exit code of the supervisor when its own setup failed after the fork (not trusted alone:
/// the command can exit with it too; see [`SUPERVISOR_FAILED`]).
pub(super) const SUPERVISOR_ERROR_EXIT: i32 = 125;
/// The byte the supervisor writes on its status pipe when it failed.
pub(super) const SUPERVISOR_FAILED: &[u8; 1] = b"E";
/// Options of the private tmpfs on /tmp and /dev/shm inside the sandbox: 64 MiB and 16,384
/// entries each. The entry cap matters as much as the size: empty files cost no bytes but an
/// inode and a dentry of kernel memory each, and tmpfs's default allows millions of them (a
/// run made 100,000 in each in 3 s; without a cgroup nothing else counts that memory).
pub(super) const PRIVATE_TMP_OPTS: &std::ffi::CStr = c"size=64m,nr_inodes=16384,mode=1777";
/// Options of the tmpfs that becomes the sandbox's root (only mount points live there).
pub(super) const ROOT_OPTS: &std::ffi::CStr = c"size=1m,mode=0755";
/// Open-file limit inside the sandbox.
pub(super) const MAX_OPEN_FILES: u64 = 256;
/// Cap on one line of the result channel, and on the whole channel.
pub(super) const MAX_LINE_BYTES: usize = 16 << 20;
pub(super) const MAX_CHANNEL_BYTES: usize = 256 << 20;
/// Lines buffered between the channel's reader thread and its consumer: none (a rendezvous),
/// so the parent holds at most the line being read and the line handed over, whatever the
/// process writes. A queue of 16 let a candidate that floods fd 3 with lines of
/// [`MAX_LINE_BYTES`] park 270 MiB in the trusted process per grading (a batch of gradings
/// could take the trainer down); a process spamming its channel now blocks on the pipe.
pub(super) const CHANNEL_QUEUE: usize = 0;
/// Extra time after the wall-clock limit before the parent kills the process group itself
/// (the supervisor normally kills the command exactly at the deadline).
pub(super) const PARENT_GRACE: Duration = Duration::from_secs(2);
/// The descriptor number the result channel gets inside the sandbox.
pub(crate) const CHANNEL_FD: RawFd = 3;
/// Where the working copy appears inside the private root.
pub(crate) const SANDBOX_WORKDIR: &str = "/workspace";
/// The host name inside the sandbox (its own UTS namespace).
pub(super) const SANDBOX_HOSTNAME: &[u8] = b"sandbox";

/// System directories bound read-only into the private root (when they exist; symlinks such
/// as a merged-/usr `/bin -> usr/bin` are recreated as symlinks).
pub(super) const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];
/// The only files of /etc the sandbox sees (the dynamic loader's cache, time zone, the
/// alternatives symlinks that /usr/bin entries may point through).
pub(super) const ETC_FILES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
];
/// Device nodes bound into the private /dev.
pub(super) const DEV_NODES: &[&str] = &["null", "zero", "full", "random", "urandom"];
/// Mounts that stay writable inside the read-only private root.
pub(super) const WRITABLE: &[&std::ffi::CStr] = &[
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
    /// Each run has its own IPC namespace: System V shared memory segments, message queues
    /// and semaphores and POSIX message queues are private to the run and die with it (none of
    /// the host's or another run's are visible). Without it (no namespaces), root removes the
    /// run uid's System V objects after the run.
    pub ipc_namespace: bool,
    /// Each run has its own UTS namespace: the host name inside is `sandbox`, not the host's.
    pub uts_namespace: bool,
    /// Private root: only system directories (read-only), a tmpfs /tmp and the working copy;
    /// no host /tmp, /home, /root, /etc beyond the loader's files, no host socket paths.
    pub private_root: bool,
    /// Private tmpfs on /tmp and /dev/shm (so POSIX shared memory, `shm_open`, is private
    /// too).
    pub private_tmp: bool,
    /// Everything except the working copy, /tmp and /dev/shm is read-only.
    pub read_only_root: bool,
    /// The working copy is a tmpfs of its own capped at `max_workdir_bytes` and
    /// `max_workdir_entries` (kernel-enforced: writes beyond fail with `ENOSPC`). Needs root
    /// (the mount is made on the host, so that it outlives runs); without it the working copy
    /// is a plain host directory, capped per file only.
    pub workdir_cap: bool,
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
    /// The working copy is a size-capped tmpfs mounted on the host (see [`super::dirs`]).
    pub workdir_cap: bool,
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
pub(super) fn interpreter_binds() -> &'static Vec<PathBuf> {
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

pub(super) fn running_as_root() -> bool {
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
