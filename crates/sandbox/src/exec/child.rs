//! The forked child: its plan (the private root's steps and everything else prepared before
//! the fork) and the code run between `fork` and `exec`, which is async-signal-safe only: libc
//! calls on memory prepared before the fork, no allocation.
use std::ffi::CString;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};

use super::config::{
    interpreter_binds, Mode, CHANNEL_FD, DEV_NODES, ETC_FILES, MAX_OPEN_FILES, PRIVATE_TMP_OPTS,
    ROOT_OPTS, SANDBOX_HOSTNAME, SANDBOX_WORKDIR, SUPERVISOR_ERROR_EXIT, SUPERVISOR_FAILED,
    SUPERVISOR_TIMEOUT_EXIT, SYSTEM_DIRS, WRITABLE,
};

/// One step building the private root, with host paths prepared before the fork.
pub(super) enum Step {
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
pub(super) struct ChildPlan {
    pub(super) mode: Mode,
    pub(super) isolate_net: bool,
    pub(super) uid: Option<u32>,
    pub(super) workdir: CString,
    pub(super) root_dir: CString,
    pub(super) steps: Vec<Step>,
    pub(super) channel_fd: RawFd,
    /// The write end of the supervisor's status pipe (see [`supervise`]); close-on-exec, so
    /// the command never holds it.
    pub(super) status_fd: RawFd,
    pub(super) cgroup_fds: Vec<RawFd>,
    pub(super) seccomp: Vec<libc::sock_filter>,
    pub(super) wall_ms: u64,
    pub(super) cpu_s: u64,
    pub(super) address_space: u64,
    pub(super) nproc: u64,
    pub(super) fsize: u64,
}

pub(super) fn cstr(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("path {} has a NUL byte", p.display()))
}

/// The steps building the private root under `root` (host path of the mount point).
pub(super) fn root_steps(
    root: &Path,
    work: &Path,
    extra_ro: &[PathBuf],
) -> Result<Vec<Step>, String> {
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

pub(super) fn os_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Writes `text` to a /proc file (uid_map, gid_map, setgroups).
pub(super) unsafe fn write_proc(path: &std::ffi::CStr, text: &[u8]) -> std::io::Result<()> {
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
pub(super) fn format_u32(v: u32, out: &mut [u8]) -> usize {
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
pub(super) fn id_map_line(id: u32, buf: &mut [u8; 40]) -> usize {
    let mut len = format_u32(id, &mut buf[..]);
    buf[len] = b' ';
    len += 1;
    len += format_u32(id, &mut buf[len..]);
    buf[len..len + 3].copy_from_slice(b" 1\n");
    len + 3
}

/// `mkdir -p` for an absolute path, without allocating (existing directories are fine).
pub(super) unsafe fn mkdir_all(path: &[u8]) -> std::io::Result<()> {
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
pub(super) unsafe fn set_limit(
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
pub(super) struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}
pub(super) const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub(super) const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub(super) const AT_RECURSIVE: libc::c_int = 0x8000;

pub(super) unsafe fn mount_setattr(path: &std::ffi::CStr, set: u64, clr: u64) -> libc::c_long {
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

pub(super) unsafe fn mount_tmpfs(
    target: &std::ffi::CStr,
    opts: &std::ffi::CStr,
) -> std::io::Result<()> {
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

pub(super) unsafe fn bind(src: &std::ffi::CStr, dst: &std::ffi::CStr) -> std::io::Result<()> {
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
pub(super) unsafe fn mkdir_parent(path: &std::ffi::CStr) -> std::io::Result<()> {
    let bytes = path.to_bytes();
    match bytes.iter().rposition(|&b| b == b'/') {
        Some(0) | None => Ok(()),
        Some(i) => mkdir_all(&bytes[..i]),
    }
}

/// Builds the private root under `plan.root_dir` and pivots into it. Runs as pid 1 of the new
/// pid namespace, with the old root still attached (so procfs may be mounted).
pub(super) unsafe fn enter_private_root(plan: &ChildPlan) -> std::io::Result<()> {
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

pub(super) unsafe fn child_setup(plan: &ChildPlan) -> std::io::Result<()> {
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
        // IPC: System V shared memory, message queues and semaphores and POSIX message queues
        // are per IPC namespace; in the host's, a segment would outlive the run (holding host
        // memory) and be readable by later runs. UTS: the host's name stays the host's.
        let mut flags = libc::CLONE_NEWUSER
            | libc::CLONE_NEWNS
            | libc::CLONE_NEWPID
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWUTS;
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
        // Best effort (the probe reports it): the sandbox sees this name, not the host's.
        libc::sethostname(SANDBOX_HOSTNAME.as_ptr().cast(), SANDBOX_HOSTNAME.len());
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
    // The supervisor ends the command at exactly `cpu_s` of scheduler time; RLIMIT_CPU is only
    // the backstop, per process (so also for the command's own children), and loose because
    // the kernel checks it against tick-sampled time, which on a busy (virtual) machine runs up
    // to a third ahead of the scheduler's. soft == hard: SIGKILL (a pid-namespace init ignores
    // SIGXCPU).
    let backstop = cpu_backstop_s(plan.cpu_s);
    set_limit(libc::RLIMIT_CPU, backstop, backstop)?;
    set_limit(libc::RLIMIT_AS, plan.address_space, plan.address_space)?;
    set_limit(libc::RLIMIT_FSIZE, plan.fsize, plan.fsize)?;
    set_limit(libc::RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES)?;
    set_limit(libc::RLIMIT_NPROC, plan.nproc, plan.nproc)?;
    // Last: the system-call filter (best effort; reported by the capability probe).
    crate::seccomp::install(&plan.seccomp);
    Ok(())
}

/// RLIMIT_CPU of the command and its children for a CPU-time limit of `cpu_s` seconds.
pub(super) fn cpu_backstop_s(cpu_s: u64) -> u64 {
    cpu_s.saturating_mul(2).saturating_add(1)
}

/// The supervisor: closes every inherited descriptor except stdio and its status pipe (so the
/// parent's spawn returns and its pipes see EOF when the command is done), waits for the
/// command, kills it at the wall-clock deadline (exit [`SUPERVISOR_TIMEOUT_EXIT`]) or when its
/// CPU time reaches the limit (re-raising SIGXCPU), and exits the way the command did. Its own
/// failure is reported as a byte on the status pipe, which only it holds: the command shares
/// its stderr and can exit with any code, so neither can tell the parent the sandbox failed.
pub(super) unsafe fn supervise(pid: libc::pid_t, plan: &ChildPlan) -> ! {
    // This process is a copy of the parent (its environment and heap included) running under
    // the sandbox's uid: non-dumpable, so the sandbox cannot read its /proc files or ptrace it.
    libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    let keep = plan.status_fd;
    if keep > 3 {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            (keep - 1) as libc::c_uint,
            0 as libc::c_uint,
        );
    }
    libc::syscall(
        libc::SYS_close_range,
        keep.max(2) as libc::c_uint + 1,
        libc::c_uint::MAX,
        0 as libc::c_uint,
    );
    let mut start: libc::timespec = std::mem::zeroed();
    libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut start);
    // The command's CPU clock (all its threads, scheduler time: what rusage reports too).
    let mut cpu_clock: libc::clockid_t = 0;
    let has_cpu_clock = libc::clock_getcpuclockid(pid, &mut cpu_clock) == 0;
    let cpu_limit_ns = (plan.cpu_s as i64).saturating_mul(1_000_000_000);
    // Sleep until the command changes state (SIGCHLD, blocked so it stays pending), the
    // deadline, or the moment its CPU time could reach the limit.
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
            if plan.status_fd >= 0 {
                libc::write(plan.status_fd, SUPERVISOR_FAILED.as_ptr().cast(), 1);
            }
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
        let mut cpu_left_ms = i64::MAX;
        let mut used: libc::timespec = std::mem::zeroed();
        if has_cpu_clock && libc::clock_gettime(cpu_clock, &mut used) == 0 {
            let used_ns = used.tv_sec as i64 * 1_000_000_000 + used.tv_nsec as i64;
            if used_ns >= cpu_limit_ns {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
                exit_with_signal(libc::SIGXCPU);
            }
            // One thread burns CPU no faster than the wall clock runs.
            cpu_left_ms = (cpu_limit_ns - used_ns) / 1_000_000;
        }
        let remaining_ms = (plan.wall_ms as i64 - elapsed_ms)
            .min(cpu_left_ms)
            .clamp(1, 100);
        let pause = libc::timespec {
            tv_sec: 0,
            tv_nsec: remaining_ms * 1_000_000,
        };
        libc::sigtimedwait(&sigchld, std::ptr::null_mut(), &pause);
    }
    if libc::WIFSIGNALED(status) {
        exit_with_signal(libc::WTERMSIG(status));
    }
    libc::_exit(libc::WEXITSTATUS(status));
}

/// Ends the supervisor by `sig`, so the parent sees the command's (or the limit's) signal.
unsafe fn exit_with_signal(sig: libc::c_int) -> ! {
    libc::signal(sig, libc::SIG_DFL);
    let mut set: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut set);
    libc::sigaddset(&mut set, sig);
    libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    libc::kill(libc::getpid(), sig);
    libc::_exit(128 + sig);
}
