//! Starting a command in a sandbox ([`spawn`]) and the started command ([`Running`]): waiting,
//! killing at the deadline, collecting the outputs.
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::child::{child_setup, cstr, root_steps, ChildPlan};
use super::config::{
    Mode, RawRun, PARENT_GRACE, SUPERVISOR_ERROR_EXIT, SUPERVISOR_FAILED, SUPERVISOR_TIMEOUT_EXIT,
};
use super::dirs::{chown_tree, workdir_full, SandboxDirs};
use super::procs::{
    pipe_cloexec, reap_uid, remove_files_of_uid, remove_ipc_of_uid, spawn_line_reader,
    spawn_reader, wait_exited_nowait,
};
use crate::cgroup::Cgroup;
use crate::{NetworkPolicy, Outcome, SandboxLimits};

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
    /// The working copy when it is capped: `finish` reports a full one.
    capped_work: Option<PathBuf>,
    /// The read end of the supervisor's status pipe (non-blocking): a byte there is the
    /// supervisor's own failure, the only source of a run's `SandboxError` after the spawn.
    status: std::fs::File,
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
    let (status_read, status_write) = pipe_cloexec().map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: a valid descriptor we own.
    unsafe {
        let fd = status_read.as_raw_fd();
        libc::fcntl(
            fd,
            libc::F_SETFL,
            libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
        );
    }
    let plan = ChildPlan {
        mode,
        isolate_net: limits.network == NetworkPolicy::Isolated,
        uid: dirs.uid,
        workdir: cstr(&dirs.work)?,
        root_dir: cstr(&dirs.root)?,
        steps,
        channel_fd: chan_write.as_ref().map_or(-1, |w| w.as_raw_fd()),
        status_fd: status_write.as_raw_fd(),
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
        // No `__pycache__`: a rewritten module of the same size within the same second would
        // otherwise run its stale bytecode (pyc files are checked by mtime and size only).
        .env("PYTHONDONTWRITEBYTECODE", "1")
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
    drop(status_write);
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
        capped_work: dirs.capped_work(),
        status: std::fs::File::from(status_read),
    })
}

impl Running {
    /// When the run's wall-clock deadline (plus the parent's grace) passes.
    pub(crate) fn deadline(&self) -> Instant {
        self.start + self.wall + PARENT_GRACE
    }

    /// Kills every process of the run now (collect the outputs with [`Running::finish`]).
    pub(crate) fn kill(&self) {
        // SAFETY: plain syscall on our own child's process group (the child is not reaped
        // before `finish`, so the group id is still ours).
        unsafe { libc::killpg(self.pid, libc::SIGKILL) };
        if let Some(cg) = &self.cgroup {
            cg.kill_all();
        }
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
            remove_ipc_of_uid(uid);
        }
        let oom = self.cgroup.as_ref().is_some_and(|c| c.oom_killed());
        let full = self.capped_work.as_deref().is_some_and(workdir_full);
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
        } else if full {
            // Writes past the cap failed (ENOSPC); whatever the command did about it, the
            // run hit the limit.
            Outcome::WorkdirLimit
        } else if let Some(sig) = signal {
            // SIGXCPU: the supervisor ended the command at the limit. SIGKILL past the limit:
            // RLIMIT_CPU's backstop (pid 1 of a pid namespace ignores SIGXCPU).
            let at_cpu_limit = cpu_used_s >= self.cpu_s as f64;
            if sig == libc::SIGXCPU || (sig == libc::SIGKILL && at_cpu_limit) {
                Outcome::CpuLimit
            } else {
                Outcome::Killed { signal: sig }
            }
        } else if exit_code == Some(SUPERVISOR_ERROR_EXIT) && self.supervisor_failed() {
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

impl Running {
    /// Whether the supervisor reported its own failure (the supervisor has been reaped, so
    /// its byte, if any, is in the pipe; nothing else holds the write end).
    fn supervisor_failed(&mut self) -> bool {
        use std::io::Read;
        let mut byte = [0u8; 1];
        matches!(self.status.read(&mut byte), Ok(1) if &byte == SUPERVISOR_FAILED)
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
