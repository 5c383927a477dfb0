//! composer-fsutil: the one crash-safe write of the workspace.
//!
//! Checkpoints, reports, metrics rewrites and replica state must never be left half-written by
//! a kill or power loss: a reader must see either the old file or the new one. The recipe is
//! the classic one — write a temporary file in the *same directory* (so the rename cannot cross
//! file systems), fsync it (so the rename cannot reach the disk before the data), rename it over
//! the target (atomic on POSIX), then fsync the directory (so the rename itself is durable).
//! It lives in its own dependency-free crate so model, telemetry, diloco and train can all
//! share it without depending on one another.
#![deny(missing_docs)]

use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// The temporary sibling used while `path` is being written: `.NAME.tmp` in the same
/// directory. Hidden, so listings and globs (`*.safetensors`) do not pick up a partial file.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".to_string());
    path.with_file_name(format!(".{name}.tmp"))
}

/// Writes `bytes` to `path` atomically and durably (see the crate docs). Errors name the file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// Like [`write_atomic`], but the content is streamed by `fill` into a buffered writer, for
/// files too large (or too incremental) to build in memory first. On any error the temporary
/// file is removed and the target is left untouched.
pub fn write_atomic_with<F>(path: &Path, fill: F) -> io::Result<()>
where
    F: FnOnce(&mut BufWriter<File>) -> io::Result<()>,
{
    let tmp = temp_path(path);
    let result = (|| {
        let file = File::create(&tmp).map_err(|e| named(&tmp, "creating", e))?;
        let mut out = BufWriter::new(file);
        fill(&mut out).map_err(|e| named(&tmp, "writing", e))?;
        let file = out
            .into_inner()
            .map_err(|e| named(&tmp, "flushing", e.into_error()))?;
        file.sync_all().map_err(|e| named(&tmp, "syncing", e))?;
        fs::rename(&tmp, path).map_err(|e| named(path, "renaming into", e))
    })();
    if result.is_err() {
        // Best effort: a stale temp file is harmless (the next write truncates it) but untidy.
        let _ = fs::remove_file(&tmp);
    }
    result?;
    sync_parent(path)
}

/// Fsyncs the directory `dir`, making renames and creations inside it durable. A no-op where
/// directories cannot be opened for syncing (Windows).
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    if cfg!(unix) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| named(dir, "syncing directory", e))?;
    }
    Ok(())
}

/// Fsyncs the directory holding `path` (the current directory for a bare file name).
pub fn sync_parent(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => sync_dir(p),
        _ => sync_dir(Path::new(".")),
    }
}

/// Wraps an I/O error so its message names the operation and the file, keeping its kind.
fn named(path: &Path, what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_replaces_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert!(!temp_path(&p).exists());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_failing_writer_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.jsonl");
        write_atomic(&p, b"old").unwrap();
        let err = write_atomic_with(&p, |w| {
            w.write_all(b"partial")?;
            Err(io::Error::other("boom"))
        })
        .unwrap_err();
        assert!(err.to_string().contains("boom"), "{err}");
        assert_eq!(fs::read(&p).unwrap(), b"old");
        assert!(!temp_path(&p).exists());
    }

    #[test]
    fn errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("missing-dir").join("x");
        let err = write_atomic(&p, b"x").unwrap_err();
        assert!(err.to_string().contains("missing-dir"), "{err}");
    }
}
