//! The reusable sandbox: a working copy that commands run in, many times, each run with every
//! process killed at its end.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::exec::{self, SandboxDirs};
use crate::{ExecResult, SandboxLimits};

/// A sandbox owning a private working copy (a host directory, seen as
/// [`Sandbox::SANDBOX_WORKDIR`] by the commands), removed when dropped.
///
/// Each [`Sandbox::run`] starts the command in fresh namespaces (private read-only root, no
/// network, own pid namespace), in its own cgroup (memory and process cap for the whole tree)
/// where available, under the sandbox's own uid when the parent is root; at its end every
/// process it started is killed. Only the working copy persists between runs.
///
/// For grading, make a fresh `Sandbox`, put only the graded files into it
/// ([`Sandbox::copy_files_from`], [`Sandbox::write_file`]) and judge the results outside it.
pub struct Sandbox {
    dirs: SandboxDirs,
    limits: SandboxLimits,
}

impl Sandbox {
    /// The working copy's path inside the sandbox (also the commands' working directory where
    /// namespaces are available; without them it is the host path, [`Sandbox::host_workdir`]).
    pub const SANDBOX_WORKDIR: &'static str = exec::SANDBOX_WORKDIR;

    /// Creates a sandbox with an empty working copy (as root, a tmpfs capped at
    /// `max_workdir_bytes` and `max_workdir_entries`). Fails (with the reason) when this machine
    /// cannot sandbox untrusted code at all (see [`crate::sandbox_capabilities`]), or when a
    /// working-copy cap is 0.
    pub fn new(limits: SandboxLimits) -> Result<Sandbox> {
        if let Some(reason) = exec::refusal(exec::mode()) {
            bail!("{reason}");
        }
        let dirs = SandboxDirs::new(exec::mode(), &limits)?;
        Ok(Sandbox { dirs, limits })
    }

    /// The working copy on the host (for the trusted side only; never give this path to the
    /// sandboxed code).
    pub fn host_workdir(&self) -> &Path {
        self.dirs.work()
    }

    /// The sandbox's host directories (for starting commands in it).
    pub(crate) fn dirs(&self) -> &SandboxDirs {
        &self.dirs
    }

    /// The limits every run of this sandbox gets (the timeout is per call).
    pub fn limits(&self) -> &SandboxLimits {
        &self.limits
    }

    /// Writes `contents` to `rel` (a plain relative path; parent directories are created) in
    /// the working copy. Refuses absolute paths, `..` and symlinks on the way.
    pub fn write_file(&self, rel: &str, contents: &[u8]) -> Result<()> {
        self.dirs.write_file(rel, contents)
    }

    /// Reads the regular file `rel` of the working copy (symlinks are refused, so a link the
    /// sandboxed code planted cannot make the trusted side read a host file).
    pub fn read_file(&self, rel: &str) -> Result<Vec<u8>> {
        self.dirs.read_file(rel)
    }

    /// Copies the named regular files (plain relative paths) from `src_root` into the same
    /// paths of the working copy. Symlinks, hard-linked files and anything that is not a regular
    /// file are refused:
    /// use this to build a grading copy from an untrusted working copy.
    pub fn copy_files_from(&self, src_root: &Path, rel_paths: &[&str]) -> Result<()> {
        for rel in rel_paths {
            let bytes =
                exec::read_regular(src_root, rel).with_context(|| format!("copying {rel}"))?;
            self.write_file(rel, &bytes)?;
        }
        Ok(())
    }

    /// Copies the whole tree under `src_root` (e.g. a task's trusted `repo/`) into the working
    /// copy under `dest` (a plain relative directory, `""` for the root): directories and
    /// regular files; a symlink or special file is an error. Returns the number of files
    /// copied. For grading, copy the trusted tree first, then overlay the graded files with
    /// [`Sandbox::copy_files_from`].
    pub fn copy_tree_from(&self, src_root: &Path, dest: &str) -> Result<usize> {
        fn walk(sb: &Sandbox, root: &Path, rel: &Path, dest: &Path, n: &mut usize) -> Result<()> {
            let dir = root.join(rel);
            let mut entries: Vec<_> = std::fs::read_dir(&dir)
                .with_context(|| format!("reading {}", dir.display()))?
                .collect::<std::io::Result<_>>()
                .with_context(|| format!("reading {}", dir.display()))?;
            entries.sort_by_key(|e| e.file_name());
            for e in entries {
                let child = rel.join(e.file_name());
                let meta = std::fs::symlink_metadata(e.path())
                    .with_context(|| format!("reading {}", e.path().display()))?;
                let target = dest.join(&child);
                let Some(child_str) = target.to_str() else {
                    bail!("{}: not a UTF-8 path", target.display());
                };
                if meta.is_dir() {
                    walk(sb, root, &child, dest, n)?;
                } else if meta.is_file() {
                    let bytes = std::fs::read(e.path())
                        .with_context(|| format!("reading {}", e.path().display()))?;
                    sb.write_file(child_str, &bytes)?;
                    *n += 1;
                } else {
                    bail!("{child_str}: not a regular file or directory");
                }
            }
            Ok(())
        }
        let mut n = 0;
        walk(self, src_root, Path::new(""), Path::new(dest), &mut n)?;
        Ok(n)
    }

    /// Runs `argv` (`argv[0]` an absolute path or a name looked up on
    /// `/usr/local/bin:/usr/bin:/bin` inside the sandbox) in the working copy, feeding
    /// `stdin`, with a wall-clock `timeout` (the other limits are the sandbox's). Every process of the run is killed when it returns. Never panics: sandbox
    /// failures come back as [`crate::Outcome::SandboxError`].
    pub fn run(&self, argv: &[&str], stdin: &[u8], timeout: Duration) -> ExecResult {
        let cpu = self.limits.cpu_time_s;
        let running = match exec::spawn(
            &self.dirs,
            argv,
            &self.limits,
            timeout,
            cpu,
            false,
            exec::mode(),
        ) {
            Ok(r) => r,
            Err(e) => return crate::exec_result(exec::RawRun::sandbox_error(e, 0.0)),
        };
        let mut running = running;
        if let Some(mut input) = running.stdin.take() {
            // The write may block on a large input: do it beside the wait.
            let data = stdin.to_vec();
            std::thread::spawn(move || {
                let _ = std::io::Write::write_all(&mut input, &data);
            });
        }
        crate::exec_result(running.finish())
    }

    /// Runs `command` with `/bin/sh -c` (see [`Sandbox::run`]).
    pub fn run_shell(&self, command: &str, timeout: Duration) -> ExecResult {
        self.run(&["/bin/sh", "-c", command], b"", timeout)
    }
}
