//! The host side of one sandbox: its private directories, and safe reads and joins of paths
//! under the working copy.
use std::io::Read;
use std::path::{Path, PathBuf};

use super::config::{alloc_uid, Mode};
use super::procs::remove_dir_robust;

/// The host side of one sandbox: a private directory holding the working copy (`work/`) and
/// the mount point of the private root (`root/`), plus the uid its processes run under.
pub(crate) struct SandboxDirs {
    base: Option<tempfile::TempDir>,
    pub(super) work: PathBuf,
    pub(super) root: PathBuf,
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
    pub(super) fn base_path(&self) -> PathBuf {
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
/// earlier run under the same uid), without following symlinks, never chowning a hard-linked
/// file (it may be a host file, without a mount namespace), and without recursion (the tree
/// may be nested deeper than any stack; see [`super::tree`]).
pub(super) fn chown_tree(dir: &Path, uid: u32) {
    if let Err(e) = super::tree::chown_tree(dir, uid) {
        eprintln!(
            "composer-sandbox: giving {} to the sandbox's uid: {e}",
            dir.display()
        );
    }
}
