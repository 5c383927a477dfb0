//! The process-level sandbox: spawning a command under resource limits, namespaces and a
//! private root file system, and killing everything it started.
//!
//! Process tree of one run (all set up in `pre_exec`, i.e. in the forked child before `exec`):
//!
//! ```text
//! parent (this process)
//!  └─ supervisor  (own session; joins the run's cgroup; when root: switches to the sandbox's
//!      │           unprivileged uid; when the kernel allows: new user+mount+pid+ipc+uts(+net)
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
//!
//! Modules, each depending only on those before it: `tree` (walking and removing a directory
//! tree without recursion), `config` (shared definitions), `child` (the forked child), `procs`
//! (readers and clean-up), `dirs` (the host directories), `running` (spawn and wait), `probe`
//! (the capability probe).

mod child;
mod config;
mod dirs;
mod probe;
mod procs;
mod running;
mod tree;

pub use config::Capabilities;
pub(crate) use config::{python_path, RawRun, SANDBOX_WORKDIR};
pub(crate) use dirs::{read_regular, SandboxDirs};
pub(crate) use probe::mode;
pub use probe::sandbox_capabilities;
pub(crate) use running::{refusal, spawn, Running};
