//! Per-run control groups: a memory and process cap for the whole process tree of one run, and
//! a way to kill every process in it. cgroup v2 (unified, `memory` + `pids` controllers) or
//! cgroup v1 (`memory` and `pids` hierarchies), created under this process's own cgroups.
//! Only used when the parent runs as root (unprivileged processes rarely get a delegated
//! subtree); otherwise the per-process rlimits are the only caps.

use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Where per-run cgroups are created.
#[derive(Debug, Clone)]
enum Layout {
    /// One unified directory (cgroup v2) with memory.max and pids.max.
    V2 { parent: PathBuf },
    /// Separate v1 hierarchies.
    V1 { memory: PathBuf, pids: PathBuf },
}

/// The probed cgroup layout, or why there is none.
fn layout() -> &'static Result<Layout, String> {
    static LAYOUT: OnceLock<Result<Layout, String>> = OnceLock::new();
    LAYOUT.get_or_init(probe_layout)
}

/// A short description of the cgroup support, for [`crate::Capabilities`].
pub(crate) fn describe() -> Result<String, String> {
    match layout() {
        Ok(Layout::V2 { parent }) => Ok(format!("cgroup v2 under {}", parent.display())),
        Ok(Layout::V1 { memory, pids }) => Ok(format!(
            "cgroup v1 (memory under {}, pids under {})",
            memory.display(),
            pids.display()
        )),
        Err(e) => Err(e.clone()),
    }
}

fn probe_layout() -> Result<Layout, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root: no cgroup (rlimits per process only)".into());
    }
    if std::env::var_os("COMPOSER_SANDBOX_NO_CGROUP").is_some() {
        return Err("cgroups disabled by COMPOSER_SANDBOX_NO_CGROUP".into());
    }
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("reading /proc/self/cgroup: {e}"))?;
    let path_of = |controller: &str| {
        own.lines().find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            (ctrls.split(',').any(|c| c == controller)).then(|| path.to_string())
        })
    };
    let rel = |p: &str| p.trim_start_matches('/').to_string();
    // cgroup v2 mounted at /sys/fs/cgroup with memory and pids.
    let v2_root = Path::new("/sys/fs/cgroup");
    if let Ok(ctrls) = std::fs::read_to_string(v2_root.join("cgroup.controllers")) {
        if ctrls.split_whitespace().any(|c| c == "memory")
            && ctrls.split_whitespace().any(|c| c == "pids")
        {
            if let Some(p) = path_of("") {
                let parent = v2_root.join(rel(&p)).join("composer-sandbox");
                if let Ok(()) = prepare_v2_parent(&parent) {
                    return Ok(Layout::V2 { parent });
                }
            }
        }
    }
    // cgroup v1 hierarchies.
    let memory = path_of("memory").map(|p| Path::new("/sys/fs/cgroup/memory").join(rel(&p)));
    let pids = path_of("pids").map(|p| Path::new("/sys/fs/cgroup/pids").join(rel(&p)));
    match (memory, pids) {
        (Some(m), Some(p))
            if m.join("memory.limit_in_bytes").exists() && p.join("cgroup.procs").exists() =>
        {
            let m = m.join("composer-sandbox");
            let p = p.join("composer-sandbox");
            for d in [&m, &p] {
                if let Err(e) = std::fs::create_dir_all(d) {
                    return Err(format!("creating {}: {e}", d.display()));
                }
            }
            Ok(Layout::V1 { memory: m, pids: p })
        }
        _ => Err("no usable cgroup v2 or v1 memory+pids hierarchy".into()),
    }
}

/// A v2 parent for per-run groups: its own directory (no processes) with memory and pids
/// enabled for its children.
fn prepare_v2_parent(parent: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(parent)?;
    if let Some(up) = parent.parent() {
        // May fail when `up` holds processes; then the check below fails too.
        let _ = std::fs::write(up.join("cgroup.subtree_control"), "+memory +pids");
    }
    std::fs::write(parent.join("cgroup.subtree_control"), "+memory +pids")?;
    let ctl = std::fs::read_to_string(parent.join("cgroup.subtree_control"))?;
    if ctl.contains("memory") && ctl.contains("pids") {
        Ok(())
    } else {
        Err(std::io::Error::other("controllers not enabled"))
    }
}

/// One run's cgroup(s). Dropping it kills every process left in it and removes it.
pub(crate) struct Cgroup {
    dirs: Vec<PathBuf>,
    /// `cgroup.procs` of each directory, opened for the child to write "0" (join) into.
    procs: Vec<std::fs::File>,
    memory_dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    /// Creates a cgroup capped at `memory` bytes and `pids` processes for one run. `Ok(None)`
    /// when this machine has no usable cgroup (see [`describe`]).
    pub(crate) fn create(memory: u64, pids: u64) -> std::io::Result<Option<Cgroup>> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let Ok(layout) = layout() else {
            return Ok(None);
        };
        let name = format!(
            "run-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let mut cg = Cgroup {
            dirs: Vec::new(),
            procs: Vec::new(),
            memory_dir: PathBuf::new(),
            v2: matches!(layout, Layout::V2 { .. }),
        };
        let open_procs = |d: &Path| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(d.join("cgroup.procs"))
        };
        match layout {
            Layout::V2 { parent } => {
                let d = parent.join(&name);
                std::fs::create_dir(&d)?;
                cg.dirs.push(d.clone());
                std::fs::write(d.join("memory.max"), memory.to_string())?;
                let _ = std::fs::write(d.join("memory.swap.max"), "0");
                std::fs::write(d.join("pids.max"), pids.to_string())?;
                cg.procs.push(open_procs(&d)?);
                cg.memory_dir = d;
            }
            Layout::V1 { memory: m, pids: p } => {
                let md = m.join(&name);
                std::fs::create_dir(&md)?;
                cg.dirs.push(md.clone());
                std::fs::write(md.join("memory.limit_in_bytes"), memory.to_string())?;
                // Absent without swap accounting; then there is no swap to limit.
                let _ = std::fs::write(md.join("memory.memsw.limit_in_bytes"), memory.to_string());
                let pd = p.join(&name);
                std::fs::create_dir(&pd)?;
                cg.dirs.push(pd.clone());
                std::fs::write(pd.join("pids.max"), pids.to_string())?;
                cg.procs.push(open_procs(&md)?);
                cg.procs.push(open_procs(&pd)?);
                cg.memory_dir = md;
            }
        }
        Ok(Some(cg))
    }

    /// Raw descriptors of the `cgroup.procs` files (the forked child writes "0" to join).
    pub(crate) fn procs_fds(&self) -> Vec<RawFd> {
        self.procs.iter().map(|f| f.as_raw_fd()).collect()
    }

    /// Whether the kernel's OOM killer fired inside this group.
    pub(crate) fn oom_killed(&self) -> bool {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.memory_dir.join(file))
            .map(|t| {
                t.lines().any(|l| {
                    l.strip_prefix("oom_kill ")
                        .and_then(|n| n.trim().parse::<u64>().ok())
                        .is_some_and(|n| n > 0)
                })
            })
            .unwrap_or(false)
    }

    /// SIGKILLs every process in the group until it is empty (bounded retries).
    pub(crate) fn kill_all(&self) {
        if self.v2 {
            let kill = self.dirs[0].join("cgroup.kill");
            if let Ok(mut f) = std::fs::OpenOptions::new().write(true).open(kill) {
                let _ = f.write_all(b"1");
            }
        }
        for _ in 0..200 {
            let mut any = false;
            for d in &self.dirs {
                let Ok(text) = std::fs::read_to_string(d.join("cgroup.procs")) else {
                    continue;
                };
                for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    any = true;
                    // SAFETY: plain syscall on a pid listed in our own per-run cgroup.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            if !any {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        self.procs.clear();
        self.kill_all();
        for d in &self.dirs {
            for _ in 0..100 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}
