//! The host side of one sandbox: its private directories, and safe reads and joins of paths
//! under the working copy.
use std::io::Read;
use std::path::{Path, PathBuf};

use super::config::{alloc_uid, Mode};
use super::procs::remove_dir_robust;
use crate::SandboxLimits;

/// The working copy's cap, where it is a tmpfs of its own.
///
/// Why a tmpfs mounted on the host: it is the only bound of the ones at hand that the kernel
/// enforces at every write, whoever writes and however. RLIMIT_FSIZE caps one file, not their
/// number; a watchdog measuring the tree during and after a run only notices after the fact
/// (a run writes 600 MB in 0.7 s, or millions of empty files, faster than a tree can be
/// walked) and its walk is itself an attack surface; a tmpfs mounted per run inside the mount
/// namespace would need copying in and out of every run. A tmpfs with `size=` and
/// `nr_inodes=` refuses the first byte and the first entry past the cap (`ENOSPC`; tmpfs also
/// counts hard links as entries, since each pins a dentry), and the code cannot remount it (no
/// capability over a mount of the host's namespace; `mount` is filtered anyway). It lives in
/// memory, not on the disk: pages written during a run are charged to the run's memory cgroup
/// (`memory_bytes`), and the whole file system is freed at once by unmounting it on drop.
/// Mounting on the host needs root (CAP_SYS_ADMIN); without it the probe reports
/// `workdir_cap: false` and the working copy is a plain host directory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkdirCap {
    /// Bytes (whole pages, at least one).
    pub bytes: u64,
    /// Entries, not counting the working copy's own directory.
    pub entries: u64,
}

/// The host side of one sandbox: a private directory holding the working copy (`work/`) and
/// the mount point of the private root (`root/`), plus the uid its processes run under.
pub(crate) struct SandboxDirs {
    base: Option<tempfile::TempDir>,
    pub(super) work: PathBuf,
    pub(super) root: PathBuf,
    /// The sandbox's own uid when the parent is root.
    pub uid: Option<u32>,
    /// The working copy's cap, when it is a tmpfs of its own (mounted on `work`).
    pub(super) cap: Option<WorkdirCap>,
}

impl SandboxDirs {
    /// Creates the directories (owned by the sandbox's uid when root); the working copy is a
    /// tmpfs capped by `limits` where `mode` allows (see [`WorkdirCap`]). Refuses caps of 0.
    pub(crate) fn new(mode: Mode, limits: &SandboxLimits) -> anyhow::Result<SandboxDirs> {
        use anyhow::Context;
        if limits.max_workdir_bytes == 0 || limits.max_workdir_entries == 0 {
            anyhow::bail!(
                "invalid limits: max_workdir_bytes and max_workdir_entries must be > 0 \
                 (got {} and {})",
                limits.max_workdir_bytes,
                limits.max_workdir_entries
            );
        }
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
            // The sandbox's directory stays root's (search only for others): were it the
            // sandbox uid's, code running on the host's paths (no mount namespace) could move
            // it away and plant `work -> /etc` at its path, and the trusted side would read,
            // replace and unmount host files through it.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o711))
                .context("chmod the sandbox directory")?;
            // ...and what is in it the sandbox uid's alone (another sandbox's code, running on
            // the host's paths too, must not read this working copy).
            for p in [&work, &root] {
                std::os::unix::fs::lchown(p, Some(uid), Some(uid))
                    .with_context(|| format!("chown {}", p.display()))?;
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700))
                    .with_context(|| format!("chmod {}", p.display()))?;
            }
        }
        let mut dirs = SandboxDirs {
            base: Some(base),
            work,
            root,
            uid,
            cap: None,
        };
        if mode.workdir_cap {
            let cap = WorkdirCap {
                bytes: (limits.max_workdir_bytes / page_size() * page_size()).max(page_size()),
                entries: limits.max_workdir_entries,
            };
            // On failure `dirs` is dropped: nothing was mounted, the directories go.
            mount_capped(&dirs.work, cap, uid).context("mounting the working copy's tmpfs")?;
            dirs.cap = Some(cap);
        }
        Ok(dirs)
    }

    /// The working copy, when it is a capped tmpfs (for [`workdir_full`] after a run).
    pub(super) fn capped_work(&self) -> Option<PathBuf> {
        self.cap.map(|_| self.work.clone())
    }

    /// `e` (a failed write of `rel`), saying so when the working copy is full.
    fn write_error(&self, rel: &str, e: std::io::Error) -> anyhow::Error {
        match self.cap {
            Some(cap) if e.raw_os_error() == Some(libc::ENOSPC) => anyhow::anyhow!(
                "writing {rel}: {e}: the working copy is full (cap: {} bytes, {} entries)",
                cap.bytes,
                cap.entries
            ),
            _ => anyhow::anyhow!("writing {rel}: {e}"),
        }
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
            .map_err(|e| self.write_error(rel, e))?;
        if let Err(e) = f.write_all(contents) {
            // No half-written file left behind (a full working copy is the usual cause).
            drop(f);
            let _ = std::fs::remove_file(&path);
            return Err(self.write_error(rel, e));
        }
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
                    std::fs::create_dir(&cur).map_err(|e| {
                        let rel = cur.strip_prefix(&self.work).unwrap_or(&cur);
                        self.write_error(&rel.display().to_string(), e)
                            .context(format!("mkdir {}", cur.display()))
                    })?;
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
        if self.cap.is_some() {
            // Frees the whole tmpfs at once (every process of every run is dead by now).
            if let Err(e) = unmount(&self.work) {
                eprintln!(
                    "composer-sandbox: unmounting the working copy {}: {e}",
                    self.work.display()
                );
            }
        }
        if let Some(base) = self.base.take() {
            remove_dir_robust(base);
        }
    }
}

/// Whether the capped working copy `work` is full (no byte or no entry left).
pub(super) fn workdir_full(work: &Path) -> bool {
    let Ok(path) = std::ffi::CString::new(work.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statvfs is plain data that statvfs fills; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return false;
    }
    st.f_bavail == 0 || st.f_favail == 0
}

/// The page size, in which the tmpfs's `size=` counts (it rounds up to whole pages; the cap
/// is rounded down here, so that it stays a cap).
fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).unwrap_or(4096).max(4096)
}

/// Mounts the working copy's tmpfs on `work` (host mount namespace, root only): `cap.bytes`
/// and `cap.entries` + 1 inodes (its root directory is one), owned by `uid` and only
/// accessible to it, no set-uid, no devices. Its propagation is left as the parent's on purpose: where the host's `/` is shared
/// (systemd), the mount is copied into peer and slave namespaces, and only the unmount on
/// drop propagating to them removes those copies (a private mount would leave them, holding
/// the file system's memory, for as long as those namespaces live). Runs never see them:
/// each run makes its own namespace private and detaches the host's tree.
fn mount_capped(work: &Path, cap: WorkdirCap, uid: Option<u32>) -> std::io::Result<()> {
    use std::ffi::CString;
    let owner = uid.map_or(String::new(), |u| format!(",uid={u},gid={u}"));
    let opts = format!(
        "size={},nr_inodes={},mode=0700{owner}",
        cap.bytes,
        cap.entries.saturating_add(1)
    );
    let bad = |e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
    let target = CString::new(work.as_os_str().as_encoded_bytes()).map_err(bad)?;
    let opts = CString::new(opts).map_err(bad)?;
    // SAFETY: NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Detaches the tmpfs on `work` (lazily: freed once nothing uses it; the unmount propagates
/// to the copies in peer and slave namespaces, see [`mount_capped`]).
fn unmount(work: &Path) -> std::io::Result<()> {
    let target = std::ffi::CString::new(work.as_os_str().as_encoded_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: a NUL-terminated path. No symlink followed (belt and braces: the path is the
    // trusted side's, see `SandboxDirs::new`).
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
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
