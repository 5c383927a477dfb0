//! Walking a directory tree the sandboxed code wrote (to remove it, or to give it to the
//! sandbox's uid) without recursion: an explicit stack of levels, one open directory
//! descriptor at a time, every step relative to a descriptor (`openat` with `O_NOFOLLOW`,
//! `unlinkat`, `fchownat` with `AT_SYMLINK_NOFOLLOW`). Neither the depth of the tree nor the
//! length of the paths in it matters — a candidate can nest 40,000 directories with
//! `os.mkdir('d'); os.chdir('d')`, which overflows the stack of a recursive walk (std's
//! `remove_dir_all`) and the descriptor limit of one holding a descriptor per level — and no
//! symlink is ever followed out of the tree. Each directory is listed once (linear in the
//! number of entries). Failures are returned (the first one; the walk goes on past it), never
//! panics.
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// What the walk does to each entry.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    /// Unlink every entry, then each emptied directory (fixing directory modes the code may
    /// have taken away, e.g. `chmod 000`).
    Remove,
    /// `lchown` every entry to this uid (and gid), except files with several hard links.
    Chown(u32),
}

/// Removes `path` (a directory tree, or a single file or symlink, never followed). A missing
/// `path` is not an error.
pub(crate) fn remove_tree(path: &Path) -> io::Result<()> {
    walk(path, Op::Remove)
}

/// Gives `path` and everything under it to `uid` (uid and gid), without following symlinks
/// and without touching files with several hard links (they may be host files linked in where
/// there is no mount namespace).
pub(crate) fn chown_tree(path: &Path, uid: u32) -> io::Result<()> {
    walk(path, Op::Chown(uid))
}

/// One directory on the way down from the top of the walk.
struct Level {
    /// Its name in its parent.
    name: CString,
    /// Its device and inode, checked when coming back up through `..`.
    id: (u64, u64),
    /// Its subdirectories not visited yet.
    subdirs: Vec<CString>,
}

/// The first failure of a walk that goes on past failures.
#[derive(Default)]
struct FirstError(Option<io::Error>);

impl FirstError {
    fn note(&mut self, what: &str, name: &CStr, depth: usize, r: io::Result<()>) {
        if let (Err(e), None) = (r, &self.0) {
            self.0 = Some(io::Error::new(
                e.kind(),
                format!("{what} {:?} at depth {depth}: {e}", name.to_string_lossy()),
            ));
        }
    }

    fn into_result(self) -> io::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

fn last_err() -> io::Error {
    io::Error::last_os_error()
}

fn is_errno(e: &io::Error, errno: libc::c_int) -> bool {
    e.raw_os_error() == Some(errno)
}

fn fd_from(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(last_err());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(last_err())
    } else {
        Ok(())
    }
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

fn fstat(fd: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: stat is plain data that fstat fills.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a valid out pointer.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

/// `lstat` of `name` in `dir`.
fn lstat_at(dir: &OwnedFd, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: stat is plain data that fstatat fills.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, a NUL-terminated name and a valid out pointer.
    check(unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    Ok(st)
}

/// Opens the directory `name` of `dir` (not a symlink: `ELOOP`/`ENOTDIR` then).
fn open_dir_at(dir: &OwnedFd, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: a valid descriptor and a NUL-terminated name.
    fd_from(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    })
}

/// Gives the owner full access to the directory `name` of `dir`, which it cannot open (the
/// sandboxed code made it `chmod 000`). The directory is pinned with an `O_PATH` descriptor
/// (no symlink followed) and changed through `/proc/self/fd`; without /proc, by name.
fn chmod_dir_at(dir: &OwnedFd, name: &CStr) -> io::Result<()> {
    // SAFETY: a valid descriptor and a NUL-terminated name.
    let pinned = fd_from(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    })?;
    let proc_path = CString::new(format!("/proc/self/fd/{}", pinned.as_raw_fd()))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: a NUL-terminated path.
    match check(unsafe { libc::chmod(proc_path.as_ptr(), 0o700) }) {
        Err(e) if is_errno(&e, libc::ENOENT) || is_errno(&e, libc::ENOTDIR) => {}
        r => return r,
    }
    // No /proc: by name. `pinned` proved it a directory, and nothing of the sandbox runs
    // while its directory is walked.
    // SAFETY: a valid descriptor and a NUL-terminated name.
    check(unsafe { libc::fchmodat(dir.as_raw_fd(), name.as_ptr(), 0o700, 0) })
}

/// Opens the subdirectory `name` of `dir` for `op`; for removal, a directory the owner cannot
/// open or change (`chmod 000`, `chmod 500`) first gets mode 0700.
fn open_subdir(dir: &OwnedFd, name: &CStr, op: Op) -> io::Result<OwnedFd> {
    let fd = match open_dir_at(dir, name) {
        Err(e) if op == Op::Remove && is_errno(&e, libc::EACCES) => {
            chmod_dir_at(dir, name)?;
            open_dir_at(dir, name)?
        }
        r => r?,
    };
    if op == Op::Remove {
        fix_mode(&fd)?;
    }
    Ok(fd)
}

/// Mode 0700 on an opened directory whose owner lacks read, write or search permission on it
/// (needed to list it and unlink its entries when not root).
fn fix_mode(fd: &OwnedFd) -> io::Result<()> {
    let st = fstat(fd)?;
    if st.st_mode & 0o700 != 0o700 {
        // SAFETY: a valid descriptor. Fails for a directory of another owner, which then
        // fails to empty with the real reason.
        unsafe { libc::fchmod(fd.as_raw_fd(), 0o700) };
    }
    Ok(())
}

/// The entries of `dir` (not `.` and `..`), each with whether it is a directory (symlinks are
/// not), read once.
fn list(dir: &OwnedFd) -> io::Result<Vec<(CString, bool)>> {
    // A duplicate for the DIR stream (closedir closes it), rewound: it shares the offset.
    // SAFETY: a valid descriptor.
    let dup = fd_from(unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) })?;
    // SAFETY: `dup` is ours; on success the stream owns it.
    let stream = unsafe { libc::fdopendir(dup.as_raw_fd()) };
    if stream.is_null() {
        return Err(last_err());
    }
    std::mem::forget(dup);
    // SAFETY: `stream` is a valid DIR stream until the closedir below.
    unsafe { libc::rewinddir(stream) };
    let mut out = Vec::new();
    let result = loop {
        // SAFETY: errno is thread-local; reset to tell the end from an error.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: a valid DIR stream.
        let ent = unsafe { libc::readdir(stream) };
        if ent.is_null() {
            // SAFETY: reading the thread-local errno.
            let errno = unsafe { *libc::__errno_location() };
            break if errno == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(errno))
            };
        }
        // SAFETY: readdir returned a valid entry with a NUL-terminated name, valid until the
        // next readdir; the name is copied before that.
        let (name, d_type) = unsafe { (CStr::from_ptr((*ent).d_name.as_ptr()), (*ent).d_type) };
        if name.to_bytes() == b"." || name.to_bytes() == b".." {
            continue;
        }
        let name = name.to_owned();
        let dir_entry = match d_type {
            libc::DT_DIR => true,
            libc::DT_UNKNOWN => lstat_at(dir, &name).is_ok_and(|st| is_dir(&st)),
            _ => false,
        };
        out.push((name, dir_entry));
    };
    // SAFETY: closes the stream and its descriptor, once.
    unsafe { libc::closedir(stream) };
    result.map(|()| out)
}

/// Applies `op` to a non-directory `name` of `dir`.
fn on_file(dir: &OwnedFd, name: &CStr, op: Op) -> io::Result<()> {
    match op {
        Op::Remove => {
            // SAFETY: a valid descriptor and a NUL-terminated name.
            match check(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) }) {
                Err(e) if is_errno(&e, libc::ENOENT) => Ok(()),
                r => r,
            }
        }
        Op::Chown(uid) => {
            let st = lstat_at(dir, name)?;
            if !is_dir(&st) && st.st_nlink > 1 {
                return Ok(());
            }
            chown_at(dir, name, uid)
        }
    }
}

fn chown_at(dir: &OwnedFd, name: &CStr, uid: u32) -> io::Result<()> {
    // SAFETY: a valid descriptor and a NUL-terminated name.
    check(unsafe {
        libc::fchownat(
            dir.as_raw_fd(),
            name.as_ptr(),
            uid,
            uid,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
}

/// Applies `op` to the directory `name` of `dir` once its contents are done.
fn on_dir_done(dir: &OwnedFd, name: &CStr, op: Op) -> io::Result<()> {
    match op {
        Op::Remove => {
            // SAFETY: a valid descriptor and a NUL-terminated name.
            let r = unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) };
            match check(r) {
                Err(e) if is_errno(&e, libc::ENOENT) => Ok(()),
                r => r,
            }
        }
        Op::Chown(uid) => chown_at(dir, name, uid),
    }
}

/// Lists the directory `dir` (at `depth`), applies `op` to its non-directories and returns its
/// subdirectories.
fn visit(dir: &OwnedFd, depth: usize, op: Op, errors: &mut FirstError) -> Vec<CString> {
    let entries = match list(dir) {
        Ok(entries) => entries,
        Err(e) => {
            errors.note("listing a directory", c"", depth, Err(e));
            return Vec::new();
        }
    };
    let mut subdirs = Vec::new();
    for (name, is_subdir) in entries {
        if is_subdir {
            subdirs.push(name);
        } else {
            let r = on_file(dir, &name, op);
            errors.note("at", &name, depth, r);
        }
    }
    subdirs
}

fn walk(path: &Path, op: Op) -> io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a path to walk", path.display()),
        ));
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let to_c = |p: &std::ffi::OsStr| {
        CString::new(p.as_encoded_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    };
    let (parent_c, name) = (to_c(parent.as_os_str())?, to_c(name)?);
    // The (trusted) path down to the top of the walk is opened as it is.
    // SAFETY: a NUL-terminated path.
    let top_parent = fd_from(unsafe {
        libc::open(
            parent_c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    })?;
    let st = match lstat_at(&top_parent, &name) {
        Err(e) if op == Op::Remove && is_errno(&e, libc::ENOENT) => return Ok(()),
        r => r?,
    };
    if !is_dir(&st) {
        return on_file(&top_parent, &name, op);
    }
    let mut errors = FirstError::default();
    let mut cur = open_subdir(&top_parent, &name, op)?;
    let top = fstat(&cur)?;
    // Never into another file system (a mount point: nothing the sandbox can make here).
    let dev = top.st_dev;
    let subdirs = visit(&cur, 0, op, &mut errors);
    let mut stack = vec![Level {
        name,
        id: (top.st_dev, top.st_ino),
        subdirs,
    }];
    loop {
        let depth = stack.len();
        let next = match stack.last_mut() {
            Some(level) => level.subdirs.pop(),
            None => break,
        };
        if let Some(child) = next {
            // Down into the next subdirectory.
            let opened = open_subdir(&cur, &child, op).and_then(|fd| {
                let st = fstat(&fd)?;
                if st.st_dev != dev {
                    return Err(io::Error::other("another file system is mounted there"));
                }
                Ok((fd, st))
            });
            match opened {
                Ok((fd, st)) => {
                    let subdirs = visit(&fd, depth, op, &mut errors);
                    stack.push(Level {
                        name: child,
                        id: (st.st_dev, st.st_ino),
                        subdirs,
                    });
                    cur = fd;
                }
                Err(e) if is_errno(&e, libc::ENOENT) => {}
                // No longer a directory (replaced by a file or symlink): an ordinary entry.
                Err(e) if is_errno(&e, libc::ELOOP) || is_errno(&e, libc::ENOTDIR) => {
                    let r = on_file(&cur, &child, op);
                    errors.note("at", &child, depth, r);
                }
                Err(e) => errors.note("opening", &child, depth, Err(e)),
            }
            continue;
        }
        // The deepest level is done: back up to its parent and finish it there.
        let Some(done) = stack.pop() else { break };
        let Some(parent) = stack.last() else {
            drop(cur);
            let r = on_dir_done(&top_parent, &done.name, op);
            errors.note("at", &done.name, 0, r);
            break;
        };
        let up = open_dir_at(&cur, c"..")?;
        let st = fstat(&up)?;
        if (st.st_dev, st.st_ino) != parent.id {
            // Moved while being walked: stop rather than act outside the tree.
            return Err(io::Error::other(format!(
                "the tree under {} changed while being walked",
                path.display()
            )));
        }
        cur = up;
        let r = on_dir_done(&cur, &done.name, op);
        errors.note("at", &done.name, depth - 1, r);
    }
    errors.into_result()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// `depth` nested directories `d` under `top`, each with a file, made without long paths
    /// (the same way the sandboxed code does: one `chdir`-like step at a time).
    fn deep_tree(top: &Path, depth: usize) {
        let c = |s: &str| CString::new(s).unwrap();
        std::fs::create_dir(top).unwrap();
        let mut cur = fd_from(unsafe {
            libc::open(
                c(top.to_str().unwrap()).as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })
        .unwrap();
        for _ in 0..depth {
            let fd = cur.as_raw_fd();
            // SAFETY: valid descriptor and NUL-terminated names.
            unsafe {
                assert_eq!(libc::mkdirat(fd, c"d".as_ptr(), 0o755), 0);
                let f = libc::openat(fd, c"f".as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644);
                assert!(f >= 0);
                libc::close(f);
            }
            cur = open_dir_at(&cur, c"d").unwrap();
        }
    }

    #[test]
    fn removes_a_tree_deeper_than_any_stack_or_path_limit() {
        let base = tempfile::tempdir().unwrap();
        let top = base.path().join("deep");
        deep_tree(&top, 50_000);
        // On a small stack, as a server's worker thread may have: no recursion.
        let t = top.clone();
        std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || remove_tree(&t))
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
        assert!(!top.exists());
        assert_eq!(std::fs::read_dir(base.path()).unwrap().count(), 0);
        // Missing: nothing to do.
        remove_tree(&top).unwrap();
    }

    /// Runs `f` on a thread of its own whose credentials (that thread's only: raw system
    /// calls) are `uid`'s, with no capabilities, so permissions apply as to a non-root parent.
    fn on_thread_as<T: Send + 'static>(
        uid: Option<u32>,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        std::thread::spawn(move || {
            if let Some(uid) = uid {
                // SAFETY: plain system calls changing this thread's credentials only.
                unsafe {
                    assert_eq!(libc::syscall(libc::SYS_setresgid, uid, uid, uid), 0);
                    assert_eq!(libc::syscall(libc::SYS_setresuid, uid, uid, uid), 0);
                }
            }
            f()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn removes_chmod_000_directories_and_files_but_never_follows_symlinks() {
        let base = tempfile::tempdir().unwrap();
        // As root, the removal runs as the tree's (foreign) owner: root would pass every
        // permission check and prove nothing about the mode fixes.
        // SAFETY: no preconditions.
        let uid = (unsafe { libc::geteuid() } == 0).then_some(0x5A00_0002u32);
        let outside = base.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), "host file").unwrap();
        let top = base.path().join("tree");
        std::fs::create_dir_all(top.join("a/b/c")).unwrap();
        std::fs::create_dir_all(top.join("x/y")).unwrap();
        std::fs::write(top.join("a/b/c/f"), "x").unwrap();
        std::fs::write(top.join("a/b/g"), "x").unwrap();
        std::fs::write(top.join("x/y/h"), "x").unwrap();
        std::os::unix::fs::symlink(&outside, top.join("a/link")).unwrap();
        std::os::unix::fs::symlink(&outside, top.join("x/y/link")).unwrap();
        if let Some(uid) = uid {
            // Everything the removal could reach by following a link is its own too.
            chown_tree(base.path(), uid).unwrap();
        }
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        mode(&top.join("a/b/c/f"), 0o000);
        mode(&top.join("a/b/c"), 0o000);
        mode(&top.join("a/b"), 0o000);
        mode(&top.join("x/y"), 0o500);
        mode(&top.join("x"), 0o100);
        mode(&top, 0o000);
        let t = top.clone();
        on_thread_as(uid, move || remove_tree(&t)).unwrap();
        assert!(!top.exists());
        assert_eq!(
            std::fs::read_to_string(outside.join("keep")).unwrap(),
            "host file"
        );
        // A symlink given as the top is removed itself, not what it points to.
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        let l = link.clone();
        on_thread_as(uid, move || remove_tree(&l)).unwrap();
        assert!(std::fs::symlink_metadata(&link).is_err());
        assert!(outside.join("keep").exists());
        // A failure is an error, not a panic: a directory of someone else's it cannot change.
        if uid.is_some() {
            let foreign = base.path().join("foreign");
            std::fs::create_dir_all(foreign.join("sub")).unwrap();
            std::fs::write(foreign.join("sub/f"), "x").unwrap();
            chown_tree(&foreign, 0x5A00_0003).unwrap();
            mode(&foreign.join("sub"), 0o000);
            let f = foreign.clone();
            let err = on_thread_as(uid, move || remove_tree(&f)).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
            assert!(foreign.join("sub/f").exists());
        }
    }

    #[test]
    fn chowns_a_deep_tree_without_following_symlinks_or_hard_links() {
        use std::os::unix::fs::MetadataExt;
        let base = tempfile::tempdir().unwrap();
        let top = base.path().join("deep");
        deep_tree(&top, 5_000);
        let host = base.path().join("host");
        std::fs::write(&host, "x").unwrap();
        std::fs::hard_link(&host, top.join("hard")).unwrap();
        std::os::unix::fs::symlink(&host, top.join("sym")).unwrap();
        // SAFETY: no preconditions.
        let me = unsafe { libc::geteuid() };
        let before = std::fs::metadata(&host).unwrap().uid();
        // Our own uid is always allowed; as root, also a foreign one.
        let uid = if me == 0 { 0x5A00_0001 } else { me };
        chown_tree(&top, uid).unwrap();
        assert_eq!(std::fs::metadata(&top).unwrap().uid(), uid);
        assert_eq!(std::fs::metadata(top.join("d/d/d/f")).unwrap().uid(), uid);
        assert_eq!(
            std::fs::symlink_metadata(top.join("sym")).unwrap().uid(),
            uid
        );
        assert_eq!(std::fs::metadata(&host).unwrap().uid(), before);
        remove_tree(&top).unwrap();
        assert!(!top.exists());
    }
}
