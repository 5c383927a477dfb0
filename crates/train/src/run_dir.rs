//! Run-directory safety: a fresh run refuses a directory that already holds a run (unless
//! `--overwrite`), and one process at a time owns a run directory through an advisory
//! `flock` on `RUN_DIR/.lock` (released by the kernel when the owner exits, even on
//! `kill -9`, so a dead owner never leaves a stale lock).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The lock file inside a run directory.
pub const LOCK_FILE: &str = ".lock";

/// Files or directories whose presence means a directory already holds a run.
const RUN_MARKERS: [&str; 3] = ["metrics.jsonl", "checkpoint", "checkpoint.old"];

/// Everything a run writes into its run directory (the trainer, the report, a DiLoCo
/// replica): what `--overwrite` removes, so nothing of the old run can be resumed or mixed
/// into the new one.
pub const RUN_ARTEFACTS: [&str; 12] = [
    "metrics.jsonl",
    "checkpoint",
    "checkpoint.old",
    "checkpoint.tmp",
    "recipe.toml",
    "recipe.trainer.toml",
    "report.html",
    ".report.html.tmp",
    "samples",
    "traces",
    "diloco-state.safetensors",
    crate::checkpoint::LORA_BASE_DIR,
];

/// The held lock of a run directory; dropping it releases the lock.
#[derive(Debug)]
pub struct RunDirLock {
    file: File,
    path: PathBuf,
}

impl RunDirLock {
    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunDirLock {
    fn drop(&mut self) {
        // SAFETY: flock on a file descriptor this struct owns.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Takes `run_dir` for this process: creates it, takes its lock (refusing when another
/// process, or another session of this one, holds it, naming the owner's pid), and on a fresh
/// run (`resume == false`) refuses a directory that already holds a run unless `overwrite`,
/// which removes the old run's [`RUN_ARTEFACTS`] (under the lock, so never a live run's).
pub fn claim(run_dir: &Path, resume: bool, overwrite: bool) -> Result<RunDirLock> {
    std::fs::create_dir_all(run_dir)
        .with_context(|| format!("creating run dir {}", run_dir.display()))?;
    let lock = lock(run_dir)?;
    if overwrite && !resume {
        remove_run(run_dir)?;
    }
    if !resume && !overwrite {
        if let Some(found) = RUN_MARKERS
            .iter()
            .map(|m| run_dir.join(m))
            .find(|p| p.exists())
        {
            bail!(
                "run dir {} already holds a run ({} exists); continue it with `--resume {}` or \
                 start over with `--overwrite`",
                run_dir.display(),
                found.display(),
                run_dir.display()
            );
        }
    }
    Ok(lock)
}

/// Removes every artefact of an earlier run from `run_dir` (other files are left alone: the
/// directory may hold the user's own).
fn remove_run(run_dir: &Path) -> Result<()> {
    for name in RUN_ARTEFACTS {
        let p = run_dir.join(name);
        let removed = match std::fs::symlink_metadata(&p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => Err(e),
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&p),
            Ok(_) => std::fs::remove_file(&p),
        };
        removed
            .with_context(|| format!("--overwrite: removing the earlier run's {}", p.display()))?;
    }
    Ok(())
}

/// Takes the exclusive lock `run_dir/.lock` and writes this process's pid into it.
pub fn lock(run_dir: &Path) -> Result<RunDirLock> {
    let path = run_dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening lock file {}", path.display()))?;
    // SAFETY: flock on a valid, owned file descriptor.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut owner = String::new();
            let _ = file.read_to_string(&mut owner);
            let owner = owner.trim();
            let owner = if owner.is_empty() { "unknown" } else { owner };
            bail!(
                "run dir {} is in use by another training process (pid {owner}, lock {}); \
                 wait for it to finish or use another run directory",
                run_dir.display(),
                path.display()
            );
        }
        return Err(err).with_context(|| format!("locking {}", path.display()));
    }
    file.set_len(0)
        .and_then(|_| file.seek(SeekFrom::Start(0)))
        .and_then(|_| writeln!(file, "{}", std::process::id()))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(RunDirLock { file, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_claim_is_refused_with_the_owner_pid() {
        let dir = tempfile::tempdir().unwrap();
        let held = claim(dir.path(), false, false).unwrap();
        let err = format!("{:#}", claim(dir.path(), false, false).unwrap_err());
        assert!(err.contains(&std::process::id().to_string()), "{err}");
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        drop(held);
        claim(dir.path(), false, false).unwrap();
    }

    #[test]
    fn fresh_run_into_an_existing_run_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "{}\n").unwrap();
        let err = format!("{:#}", claim(dir.path(), false, false).unwrap_err());
        assert!(
            err.contains("--resume") && err.contains("--overwrite"),
            "{err}"
        );
        drop(claim(dir.path(), false, true).unwrap());
        drop(claim(dir.path(), true, false).unwrap());
    }
}
