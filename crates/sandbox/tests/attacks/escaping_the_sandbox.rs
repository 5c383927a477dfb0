//! Class 6: escaping the sandbox.

use super::*;

#[test]
fn escape_host_files_are_invisible() {
    let secret = marker("hostfile");
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let in_tmp = HostFile::new(std::env::temp_dir().join(&secret), &secret);
    let in_home = HostFile::new(PathBuf::from(&home).join(&secret), &secret);
    let paths: Vec<String> = [&in_tmp.0, &in_home.0]
        .iter()
        .flat_map(|p| {
            let p = p.display().to_string();
            vec![
                p.clone(),
                format!("/proc/self/root{p}"),
                format!("/proc/1/root{p}"),
            ]
        })
        .chain(["/etc/passwd", "/etc/hostname", "/etc/shadow"].map(String::from))
        .collect();
    let code = format!(
        r#"
import os
for p in {paths:?}:
    try:
        print("READ", p, open(p).read()[:80])
    except OSError as e:
        print("blocked", p, e.errno)
print("TMP", os.listdir("/tmp"), "ROOT", sorted(os.listdir("/")))
"#
    );
    let r = run_python(&code, &limits());
    assert_eq!(r.outcome, Outcome::Completed, "{r:#?}");
    let caps = sandbox_capabilities();
    if !caps.private_root {
        protection_missing(
            "escape_host_files_are_invisible",
            "no private root: host files are readable",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
        return;
    }
    assert!(!r.stdout.contains("READ"), "{r:#?}");
    {
        assert!(r.stdout.contains("TMP []"), "{r:#?}");
        assert!(
            !r.stdout.contains("'home'") && !r.stdout.contains("'root'"),
            "{r:#?}"
        );
    }
}

#[test]
fn escape_host_unix_sockets_are_unreachable() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::UnixListener;
    let caps = sandbox_capabilities();
    let secret = marker("sock");
    let path = std::env::temp_dir().join(format!("{secret}.sock"));
    let listener = UnixListener::bind(&path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
    listener.set_nonblocking(true).unwrap();
    // An abstract socket too (no path at all; reachable from the same network namespace).
    let abstract_name = format!("{secret}-abstract");
    let addr =
        <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
            abstract_name.as_bytes(),
        )
        .unwrap();
    let abstract_listener = UnixListener::bind_addr(&addr).unwrap();
    abstract_listener.set_nonblocking(true).unwrap();
    let code = format!(
        r#"
import socket, glob
targets = [{path:?}, "/proc/1/root" + {path:?}] + glob.glob("/tmp/*.sock") + glob.glob("/run/*.sock") + glob.glob("/var/run/*/*.sock")
for t in targets:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(t); s.sendall(b"escaped"); print("connected", t)
    except OSError as e:
        print("blocked", t, e.errno)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect("\0" + {abstract_name:?}); s.sendall(b"escaped"); print("connected abstract")
except OSError as e:
    print("blocked abstract", e.errno)
"#,
        path = path.display().to_string()
    );
    let r = run_python(&code, &limits());
    let _ = std::fs::remove_file(&path);
    if !caps.private_root || !caps.network_namespace {
        protection_missing(
            "escape_host_unix_sockets_are_unreachable",
            "no private root / network namespace: host sockets are reachable",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
        return;
    }
    assert!(!r.stdout.contains("connected"), "{r:#?}");
    assert!(listener.accept().is_err(), "the sandbox reached the socket");
    assert!(
        abstract_listener.accept().is_err(),
        "the sandbox reached the abstract socket"
    );
    // Graded: the same attempt inside a solution scores 0.
    let task = secret_task(&secret);
    assert_zero(&format!("{code}\ndef f(x):\n    return None\n"), &task);
}

#[test]
fn escape_tcp_to_localhost_is_blocked() {
    let caps = sandbox_capabilities();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let code = format!(
        "import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    s.sendall(b'x')\n    print('connected')\nexcept OSError as e:\n    print('blocked', e.errno)\n"
    );
    let r = run_python(&code, &limits());
    if !caps.network_namespace {
        protection_missing(
            "escape_tcp_to_localhost_is_blocked",
            "no network namespace",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
        return;
    }
    assert!(r.stdout.starts_with("blocked"), "{r:#?}");
    assert!(
        listener.accept().is_err(),
        "the sandbox reached the listener"
    );
}

#[test]
fn escape_writing_outside_the_working_copy_fails() {
    let secret = marker("write");
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let host_targets = [
        std::env::temp_dir().join(&secret),
        PathBuf::from(&home).join(&secret),
        PathBuf::from("/etc").join(&secret),
        PathBuf::from("/usr/local").join(&secret),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(&secret),
    ];
    let mut targets: Vec<String> = host_targets
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    targets.extend([
        format!("../{secret}"),
        format!("../../{secret}"),
        format!("/proc/self/cwd/../{secret}"),
        format!("/dev/shm/{secret}"),
        format!("/var/tmp/{secret}"),
    ]);
    let code = format!(
        r#"
import os
open("inside.txt", "w").write("ok")
for p in {targets:?}:
    try:
        open(p, "w").write("escaped")
        print("wrote", p)
    except OSError as e:
        print("blocked", p, e.errno)
"#
    );
    let r = run_python(&code, &limits());
    assert_eq!(r.outcome, Outcome::Completed, "{r:#?}");
    for p in &host_targets {
        assert!(!p.exists(), "{} was written on the host", p.display());
    }
    for p in ["/var/tmp", "/dev/shm"] {
        assert!(!PathBuf::from(p).join(&secret).exists());
    }
    let parent = std::env::temp_dir();
    for e in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
        assert!(
            !e.file_name().to_string_lossy().contains(&secret),
            "{}",
            e.path().display()
        );
    }
    // The working copy itself is writable and persists between runs of one sandbox.
    let sb = Sandbox::new(limits()).unwrap();
    let r = sb.run_shell(
        "echo hi > a.txt && mkdir -p d && echo x > d/b",
        Duration::from_secs(5),
    );
    assert_eq!(r.exit_code, Some(0), "{r:#?}");
    let r = sb.run_shell("cat a.txt d/b", Duration::from_secs(5));
    assert_eq!(r.stdout, "hi\nx\n", "{r:#?}");
    assert_eq!(sb.read_file("a.txt").unwrap(), b"hi\n");
    let host = sb.host_workdir().to_path_buf();
    drop(sb);
    assert!(!host.exists(), "working copy not removed");
}

#[test]
fn escape_processes_do_not_outlive_the_episode() {
    let secret = marker("linger");
    // Double fork + setsid + ignore signals + exec a long sleeper carrying the marker.
    let code = format!(
        r#"
import os, sys, signal
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            os.execv("/bin/sleep", ["/bin/sleep", "600", {secret:?}])
        os._exit(0)
print("spawned", flush=True)
"#
    );
    let r = run_python(&code, &limits());
    assert!(r.stdout.contains("spawned"), "{r:#?}");
    let sb = Sandbox::new(limits()).unwrap();
    let r = sb.run_shell(
        &format!("(setsid sleep 600 {secret} &) ; nohup sleep 600 {secret} >/dev/null 2>&1 & echo started"),
        Duration::from_secs(5),
    );
    assert!(r.stdout.contains("started"), "{r:#?}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        processes_with_marker(&secret),
        Vec::<String>::new(),
        "processes survived the run"
    );
    // Graded: a lingering helper started by the solution is gone too.
    let task = secret_task(&secret);
    assert_zero(&format!("{code}\ndef f(x):\n    return None\n"), &task);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(processes_with_marker(&secret), Vec::<String>::new());
}

#[test]
fn escape_fork_bomb_is_contained() {
    let lim = SandboxLimits {
        wall_time: Duration::from_secs(3),
        cpu_time_s: 2,
        max_processes: 16,
        ..SandboxLimits::default()
    };
    let code = "import os\nn = 0\nwhile n < 10000:\n    try:\n        if os.fork() == 0:\n            import time; time.sleep(30); os._exit(0)\n        n += 1\n    except OSError:\n        break\nprint('forked', n, flush=True)\n";
    let r = run_python(code, &lim);
    let forked: u64 = r
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("forked "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no fork count: {r:#?}"));
    assert!(forked < lim.max_processes, "forked {forked}");
    // The classic bomb: every process forks forever; contained, and this process is fine.
    let r = run_python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        &lim,
    );
    assert!(
        matches!(
            r.outcome,
            Outcome::TimedOut | Outcome::CpuLimit | Outcome::Killed { .. }
        ),
        "{r:#?}"
    );
    assert_eq!(run_python("print('alive')", &limits()).stdout, "alive\n");
}

#[test]
fn escape_memory_across_a_process_tree_is_capped() {
    let caps = sandbox_capabilities();
    // Each of 6 children takes 100 MB, which alone fits the tree's 256 MiB cap (and the
    // per-process address-space limit); together they would hold 600 MB. All allocate within
    // the first moments and then hold for 3 s, so the children that live through the hold held
    // their memory at the same time: at most 2 of them can (3 x 100 MB > 256 MiB).
    let lim = SandboxLimits {
        memory_bytes: 256 << 20,
        wall_time: Duration::from_secs(30),
        ..SandboxLimits::default()
    };
    let code = r#"
import os, time
N = 100 * 1000 * 1000
pids = []
for i in range(6):
    pid = os.fork()
    if pid == 0:
        try:
            block = bytearray(N)
            block[::4096] = b"x" * len(range(0, N, 4096))
        except MemoryError:
            print("child memoryerror", flush=True)
            os._exit(3)
        print("child holds 100 MB", flush=True)
        time.sleep(3)
        os._exit(0)
    pids.append(pid)
for pid in pids:
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        print("child survived", flush=True)
    else:
        print("child stopped %d" % status, flush=True)
print("done", flush=True)
"#;
    let r = run_python(code, &lim);
    if caps.cgroup.is_none() {
        protection_missing(
            "escape_memory_across_a_process_tree_is_capped",
            "no cgroup: only a per-process RLIMIT_AS",
            &[
                "COMPOSER_SANDBOX_NO_CGROUP",
                "COMPOSER_SANDBOX_NO_NAMESPACES",
            ],
            &caps,
        );
        return;
    }
    let survived = r.stdout.matches("child survived").count();
    assert!(
        survived <= 2,
        "{survived} children held 100 MB at once under a 256 MiB cap: {r:#?}"
    );
    let stopped = r.stdout.matches("child stopped").count();
    let killed_tree = r.outcome == Outcome::MemoryLimit;
    assert!(
        killed_tree || stopped >= 4,
        "the tree went over its cap without a kill or failed allocation: {r:#?}"
    );
    // Each child alone fits: the cap is on the total, not a per-process limit below 100 MB.
    assert!(
        r.stdout.contains("child holds 100 MB"),
        "no child could take 100 MB: {r:#?}"
    );
}

#[test]
fn escape_kernel_surface_is_filtered() {
    let caps = sandbox_capabilities();
    let code = r#"
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, fn):
    r = fn()
    print(name, "ok" if r == 0 else "blocked %d" % ctypes.get_errno(), flush=True)
attempt("unshare_user", lambda: libc.unshare(0x10000000))
attempt("unshare_net", lambda: libc.unshare(0x40000000))
attempt("ptrace", lambda: libc.ptrace(0, 0, 0, 0))
attempt("bpf", lambda: libc.syscall(321, 0, 0, 0))
attempt("userfaultfd", lambda: -1 if libc.syscall(323, 0) < 0 else 0)
attempt("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
# Address families beyond AF_UNIX/AF_INET/AF_INET6 (vsock reaches the hypervisor, past the
# network namespace).
import socket
def sock(name, *args):
    try:
        socket.socket(*args).close()
        print(name, "ok", flush=True)
    except OSError as e:
        print(name, "blocked %d" % e.errno, flush=True)
sock("af_vsock", 40, socket.SOCK_STREAM)
sock("af_netlink", 16, socket.SOCK_RAW, 0)
sock("af_packet", 17, socket.SOCK_RAW, 0)
sock("af_alg", 38, socket.SOCK_SEQPACKET)
sock("af_unix", socket.AF_UNIX, socket.SOCK_STREAM)
sock("af_inet", socket.AF_INET, socket.SOCK_DGRAM)
a, b = socket.socketpair()
print("socketpair ok", flush=True)
# Ordinary process creation still works (fork, posix_spawn/clone3 fallback, exec).
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print("spawn", subprocess.run(["/bin/echo", "hi"], capture_output=True).stdout.decode().strip())
"#;
    let r = run_python(code, &limits());
    assert_eq!(r.outcome, Outcome::Completed, "{r:#?}");
    assert!(r.stdout.contains("fork 7"), "{r:#?}");
    assert!(r.stdout.contains("spawn hi"), "{r:#?}");
    for name in ["af_unix", "af_inet", "socketpair"] {
        assert!(r.stdout.contains(&format!("{name} ok\n")), "{name}: {r:#?}");
    }
    if !caps.seccomp {
        protection_missing(
            "escape_kernel_surface_is_filtered",
            "no seccomp filter",
            &[
                "COMPOSER_SANDBOX_NO_SECCOMP",
                "COMPOSER_SANDBOX_NO_NAMESPACES",
            ],
            &caps,
        );
        return;
    }
    for name in [
        "unshare_user",
        "unshare_net",
        "ptrace",
        "bpf",
        "userfaultfd",
        "mount",
    ] {
        assert!(
            r.stdout.contains(&format!("{name} blocked 1\n")),
            "{name}: {r:#?}"
        );
    }
    for name in ["af_vsock", "af_netlink", "af_packet", "af_alg"] {
        assert!(
            r.stdout
                .contains(&format!("{name} blocked {}\n", libc::EAFNOSUPPORT)),
            "{name}: {r:#?}"
        );
    }
    // Graded: the same attempts inside a solution score 0 and break nothing.
    let task = secret_task(&marker("kernel"));
    assert_zero(&format!("{code}\ndef f(x):\n    return None\n"), &task);
}

#[test]
fn sandbox_runs_report_missing_commands_and_keep_only_stdio() {
    let sb = Sandbox::new(limits()).unwrap();
    let r = sb.run(&["/no/such/program"], b"", Duration::from_secs(5));
    assert!(
        matches!(r.outcome, Outcome::SandboxError(ref e) if e.contains("/no/such/program")),
        "{r:#?}"
    );
    // Only stdin, stdout and stderr are open in a plain run.
    let r = sb.run_shell("ls /proc/self/fd", Duration::from_secs(5));
    assert_eq!(r.exit_code, Some(0), "{r:#?}");
    let fds: Vec<&str> = r.stdout.split_whitespace().collect();
    // `ls` itself holds one more descriptor: the directory it lists.
    assert!(fds.len() <= 4, "inherited descriptors: {fds:?}");
}

/// System V IPC objects with `key`, and the POSIX shared memory object and message queue
/// `name`, in the host's IPC namespace: removed on drop (only a failed test leaves any).
struct HostIpc {
    key: libc::key_t,
    name: String,
}

impl HostIpc {
    /// The host's System V segment with this key, if any.
    fn sysv_segment(&self) -> Option<libc::c_int> {
        // SAFETY: a lookup only (no IPC_CREAT).
        let id = unsafe { libc::shmget(self.key, 0, 0) };
        (id >= 0).then_some(id)
    }

    /// Whether /proc/sysvipc/shm (what `ipcs -m` reads) lists the key.
    fn listed_in_proc(&self) -> bool {
        let table = std::fs::read_to_string("/proc/sysvipc/shm").unwrap_or_default();
        table
            .lines()
            .skip(1)
            .any(|l| l.split_whitespace().next() == Some(&self.key.to_string()))
    }

    fn posix_shm(&self) -> PathBuf {
        PathBuf::from("/dev/shm").join(&self.name)
    }

    /// Whether the host can open the POSIX message queue.
    fn message_queue(&self) -> bool {
        let name = std::ffi::CString::new(format!("/{}", self.name)).unwrap();
        // SAFETY: a NUL-terminated name; no O_CREAT, so no further arguments.
        let q = unsafe { libc::mq_open(name.as_ptr(), libc::O_RDONLY) };
        if q >= 0 {
            // SAFETY: the descriptor just opened.
            unsafe { libc::mq_close(q) };
        }
        q >= 0
    }
}

impl Drop for HostIpc {
    fn drop(&mut self) {
        if let Some(id) = self.sysv_segment() {
            // SAFETY: IPC_RMID takes no buffer.
            unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
        }
        let _ = std::fs::remove_file(self.posix_shm());
        let name = std::ffi::CString::new(format!("/{}", self.name)).unwrap();
        // SAFETY: a NUL-terminated name.
        unsafe { libc::mq_unlink(name.as_ptr()) };
    }
}

#[test]
fn escape_ipc_and_shared_memory_do_not_outlive_the_run() {
    let caps = sandbox_capabilities();
    let ipc = HostIpc {
        key: 0x5eed_0000 | (std::process::id() & 0xffff) as libc::key_t,
        name: marker("shm"),
    };
    let secret = marker("ipc");
    let prelude = format!(
        r#"
import ctypes, os, socket
from multiprocessing import shared_memory, resource_tracker
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
try:
    mq_open = libc.mq_open
except AttributeError:
    mq_open = ctypes.CDLL("librt.so.1", use_errno=True).mq_open
KEY, NAME, MARK = {key}, {name:?}, {secret:?}.encode()
print("hostname", socket.gethostname(), flush=True)
"#,
        key = ipc.key,
        name = ipc.name,
    );
    // One run leaves a System V segment (mode 1666: IPC_CREAT, readable by every uid), a POSIX
    // shared memory object kept from the resource tracker, and a POSIX message queue.
    let make = format!(
        r#"{prelude}
shmid = libc.shmget(KEY, 1 << 20, 0o1666)
if shmid >= 0:
    addr = libc.shmat(shmid, None, 0)
    ctypes.memmove(addr, MARK, len(MARK))
    print("sysv made", flush=True)
else:
    print("sysv failed", ctypes.get_errno(), flush=True)
try:
    shm = shared_memory.SharedMemory(name=NAME, create=True, size=4096)
    shm.buf[:len(MARK)] = MARK
    resource_tracker.unregister(shm._name, "shared_memory")
    print("posix shm made", flush=True)
except OSError as e:
    print("posix shm failed", e.errno, flush=True)
q = mq_open(("/" + NAME).encode(), os.O_CREAT | os.O_RDWR, 0o666, None)
if q >= 0:
    libc.mq_send(q, MARK, len(MARK), 0)
    print("mq made", flush=True)
else:
    print("mq failed", ctypes.get_errno(), flush=True)
"#
    );
    // A later run (another sandbox, another uid) looks for them.
    let look = format!(
        r#"{prelude}
shmid = libc.shmget(KEY, 0, 0)
if shmid >= 0:
    addr = libc.shmat(shmid, None, 0o10000)
    print("sysv seen", ctypes.string_at(addr, len(MARK)), flush=True)
else:
    print("sysv absent", flush=True)
try:
    shm = shared_memory.SharedMemory(name=NAME)
    print("posix shm seen", bytes(shm.buf[:len(MARK)]), flush=True)
except OSError:
    print("posix shm absent", flush=True)
print("dev shm", os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else None, flush=True)
q = mq_open(("/" + NAME).encode(), os.O_RDONLY)
print("mq seen" if q >= 0 else "mq absent", flush=True)
"#
    );
    let r = run_python(&make, &limits());
    assert_eq!(r.outcome, Outcome::Completed, "{r:#?}");
    for what in ["sysv made", "posix shm made", "mq made"] {
        assert!(
            r.stdout.contains(what),
            "the attack did not run ({what}): {r:#?}"
        );
    }
    let check_host = |when: &str| {
        assert!(
            ipc.sysv_segment().is_none() && !ipc.listed_in_proc(),
            "{when}: the System V segment outlived the run on the host"
        );
        assert!(
            !ipc.posix_shm().exists(),
            "{when}: the POSIX shared memory outlived the run in the host's /dev/shm"
        );
    };
    check_host("after the run");
    let seen = run_python(&look, &limits());
    assert_eq!(seen.outcome, Outcome::Completed, "{seen:#?}");
    assert!(!seen.stdout.contains(&secret), "{seen:#?}");
    assert!(seen.stdout.contains("sysv absent"), "{seen:#?}");
    assert!(seen.stdout.contains("posix shm absent"), "{seen:#?}");
    assert!(!seen.stdout.contains(&ipc.name), "{seen:#?}");
    if !caps.ipc_namespace {
        protection_missing(
            "escape_ipc_and_shared_memory_do_not_outlive_the_run",
            "no IPC namespace: POSIX message queues outlive the run (System V objects and \
             /dev/shm files are removed by uid)",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
        return;
    }
    assert!(seen.stdout.contains("mq absent"), "{seen:#?}");
    assert!(!ipc.message_queue(), "the message queue reached the host");
    if caps.uts_namespace {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        assert!(r.stdout.contains("hostname sandbox\n"), "{r:#?}");
        assert!(
            host.trim() == "sandbox" || !r.stdout.contains(&format!("hostname {}\n", host.trim())),
            "the host name is visible: {r:#?}"
        );
    }
    // Graded: a solution leaving them behind scores 0 and leaves nothing for a later run.
    let task = secret_task(&secret);
    assert_zero(&format!("{make}\ndef f(x):\n    return None\n"), &task);
    check_host("after grading");
    assert!(!ipc.message_queue(), "the message queue reached the host");
    let seen = run_python(&look, &limits());
    assert!(seen.stdout.contains("sysv absent"), "{seen:#?}");
    assert!(seen.stdout.contains("posix shm absent"), "{seen:#?}");
    assert!(seen.stdout.contains("mq absent"), "{seen:#?}");
}

/// The candidate code of a red-team run: 40,000 nested directories. Removing the sandbox's
/// directory with a recursive walk overflowed the stack and aborted the whole process (a
/// `serve-env` server lost every session); with a bigger stack it ran out of descriptors and
/// left the tree on the host.
const DEEP_TREE_PY: &str = "import os\nfor _ in range(40000):\n    os.mkdir('d'); os.chdir('d')\n";

#[test]
fn escape_deep_directory_tree_is_removed_without_crashing() {
    let python = sandbox_capabilities().python.expect("python3");
    // Room for all 40,000 levels (each `mkdir` costs the kernel up to ~0.25 ms on a slow disk).
    let lim = SandboxLimits {
        wall_time: Duration::from_secs(90),
        cpu_time_s: 60,
        ..limits()
    };
    let sb = Sandbox::new(lim.clone()).unwrap();
    sb.write_file("main.py", DEEP_TREE_PY.as_bytes()).unwrap();
    let r = sb.run(&[&python, "-I", "-S", "-B", "main.py"], b"", lim.wall_time);
    assert_eq!(
        (&r.outcome, r.exit_code),
        (&Outcome::Completed, Some(0)),
        "{r:#?}"
    );
    // A second run in the same sandbox (the working copy is given to the sandbox's uid first).
    let r = sb.run_shell("echo next run", Duration::from_secs(30));
    assert_eq!(r.stdout, "next run\n", "{r:#?}");
    let work = sb.host_workdir().to_path_buf();
    let base = work.parent().unwrap().to_path_buf();
    assert!(work.join("d/d/d").is_dir(), "no deep tree was made");
    drop(sb);
    assert!(!work.exists(), "the deep tree stayed on the host");
    assert!(!base.exists(), "{} stayed on the host", base.display());
    // Graded: a solution that nests directories until its CPU limit ends it (under a marker, to
    // find what is left among other tests' sandboxes) scores 0 and leaves nothing.
    let secret = marker("deep");
    let code = format!("import os\nos.mkdir({secret:?}); os.chdir({secret:?})\n{DEEP_TREE_PY}");
    assert_zero(
        &format!("{code}\ndef f(x):\n    return None\n"),
        &secret_task(&secret),
    );
    let left: Vec<PathBuf> = std::fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("work").join(&secret))
        .filter(|p| std::fs::symlink_metadata(p).is_ok())
        .collect();
    assert_eq!(left, Vec::<PathBuf>::new(), "deep trees stayed on the host");
    // This process is alive and the sandbox still works.
    assert_eq!(run_python("print('alive')", &limits()).stdout, "alive\n");
}
