//! Escaping the sandbox's resources through the working copy: it is the one writable place
//! that outlives a run, on the host, so code that fills it (big files each under
//! `max_file_bytes`, or millions of empty files, directories, links and FIFOs that use up the
//! inodes) could fill the host's disk and take the trainer down. Both its bytes and its
//! entries are capped (`max_workdir_bytes`, `max_workdir_entries`).
use std::path::Path;

use super::*;

/// Small caps, so the attack is quick.
fn capped() -> SandboxLimits {
    SandboxLimits {
        max_workdir_bytes: 8 << 20,
        max_workdir_entries: 500,
        ..limits()
    }
}

/// (bytes allocated, entries) under `dir`, not counting `dir` itself.
fn usage(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut bytes, mut entries) = (0, 0);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            entries += 1;
            bytes += m.blocks() * 512;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    (bytes, entries)
}

/// Writes 64 files of 1 MiB each (every one under `max_file_bytes`), also by `fallocate`,
/// and keeps going after errors.
const FILL_BYTES: &str = r#"
import os
done = 0
for i in range(64):
    try:
        with open("big%d" % i, "wb") as fh:
            if i % 2:
                os.posix_fallocate(fh.fileno(), 0, 1 << 20)
            else:
                fh.write(b"x" * (1 << 20))
        done += 1
    except OSError as e:
        err = e
print("wrote", done, "files of 1 MiB")
"#;

/// Makes 5,000 entries of every kind that costs an inode and no bytes.
const FILL_ENTRIES: &str = r#"
import os
done = 0
for i in range(5000):
    try:
        kind = i % 4
        if kind == 0:
            open("e%d" % i, "w").close()
        elif kind == 1:
            os.mkdir("d%d" % i)
        elif kind == 2:
            os.symlink("nowhere", "l%d" % i)
        else:
            os.mkfifo("p%d" % i)
        done += 1
    except OSError:
        pass
print("made", done, "entries")
"#;

#[test]
fn escape_filling_the_disk_through_the_working_copy_is_capped() {
    let caps = sandbox_capabilities();
    if !caps.workdir_cap {
        protection_missing(
            "escape_filling_the_disk_through_the_working_copy_is_capped",
            "no size-capped working copy (needs root to mount its tmpfs)",
            &["COMPOSER_SANDBOX_NO_WORKDIR_CAP"],
            &caps,
        );
        return;
    }
    let python = python_interpreter().expect("python3").display().to_string();
    let limits = capped();
    let timeout = Duration::from_secs(20);

    // Bytes: 64 MiB in files of 1 MiB into an 8 MiB working copy.
    let sb = Sandbox::new(limits.clone()).unwrap();
    let r = sb.run(&[&python, "-c", FILL_BYTES], b"", timeout);
    let (bytes, _) = usage(sb.host_workdir());
    assert!(
        bytes <= limits.max_workdir_bytes,
        "{bytes} bytes in the working copy, over the cap: {r:?}"
    );
    assert_eq!(r.outcome, Outcome::WorkdirLimit, "{r:?}");
    // The trusted side cannot write past the cap either, and says why.
    let err = sb
        .write_file("more.bin", &vec![0u8; 1 << 20])
        .expect_err("the working copy is full");
    assert!(format!("{err:#}").contains("working copy"), "{err:#}");
    let host = sb.host_workdir().to_path_buf();
    drop(sb);
    assert!(!host.exists(), "{} left behind", host.display());

    // Entries: 5,000 files, directories, symlinks and FIFOs into a cap of 500.
    let sb = Sandbox::new(limits.clone()).unwrap();
    let r = sb.run(&[&python, "-c", FILL_ENTRIES], b"", timeout);
    let (_, entries) = usage(sb.host_workdir());
    assert!(
        entries <= limits.max_workdir_entries,
        "{entries} entries in the working copy, over the cap: {r:?}"
    );
    assert_eq!(r.outcome, Outcome::WorkdirLimit, "{r:?}");
    // Deleting frees the room again: later runs and writes work.
    let r = sb.run_shell("rm -rf ./* && echo emptied", timeout);
    assert!(r.stdout.contains("emptied"), "{r:?}");
    assert_eq!(r.outcome, Outcome::Completed, "{r:?}");
    sb.write_file("ok.txt", b"fits").unwrap();

    // A run that stays under the cap is an ordinary run.
    let r = sb.run_shell("head -c 1000000 /dev/zero > one_mb && echo fine", timeout);
    assert_eq!(
        (r.outcome.clone(), r.stdout.trim()),
        (Outcome::Completed, "fine"),
        "{r:?}"
    );

    // Grading: a solution that fills the disk when loaded is bounded the same way.
    let task = CodeTask {
        id: "attack/fill".into(),
        prompt: "f".into(),
        entry_point: "f".into(),
        tests: vec!["assert f(1) == 1".into()],
    };
    let code = format!("{FILL_BYTES}\ndef f(x):\n    return x\n");
    let report = grade(&code, &task, &limits, RewardMode::FractionPassed);
    assert_eq!(report.outcome, Outcome::WorkdirLimit, "{report:#?}");
    assert!(
        report.feedback.contains("working copy reached its cap"),
        "{report:#?}"
    );
}

#[test]
fn limits_without_a_workdir_cap_are_refused() {
    for limits in [
        SandboxLimits {
            max_workdir_bytes: 0,
            ..limits()
        },
        SandboxLimits {
            max_workdir_entries: 0,
            ..limits()
        },
    ] {
        let err = Sandbox::new(limits).err().expect("refused");
        assert!(format!("{err:#}").contains("max_workdir"), "{err:#}");
    }
}

/// Makes up to 100,000 empty files in `/tmp` and in `/dev/shm`: no bytes, so the tmpfs
/// `size=` never stops it, but each costs an inode and a dentry of kernel memory (without a
/// cgroup, nothing else counts them).
const FILL_TMP_INODES: &str = r#"
import os
for d in ("/tmp", "/dev/shm"):
    n = 0
    try:
        for i in range(100000):
            os.close(os.open("%s/i%d" % (d, i), os.O_CREAT | os.O_WRONLY, 0o600))
            n += 1
    except OSError as e:
        pass
    print(d, n)
"#;

#[test]
fn escape_filling_tmp_with_empty_files_is_capped() {
    let caps = sandbox_capabilities();
    if !caps.private_tmp {
        protection_missing(
            "escape_filling_tmp_with_empty_files_is_capped",
            "no private /tmp",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
        return;
    }
    let python = python_interpreter().expect("python3").display().to_string();
    let sb = Sandbox::new(limits()).unwrap();
    let r = sb.run(
        &[&python, "-c", FILL_TMP_INODES],
        b"",
        Duration::from_secs(20),
    );
    for dir in ["/tmp", "/dev/shm"] {
        let made: u64 = r
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{dir} ")))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no count for {dir}: {r:?}"));
        assert!(
            made <= 16_384,
            "{made} empty files in the private {dir}: its inodes are not capped: {r:?}"
        );
    }
}
