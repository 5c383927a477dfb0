//! Escaping through the trusted side's paths: the parent reads, writes and finally removes the
//! working copy by its host path (`<sandbox dir>/work`). Where the code runs on the host's
//! paths (no mount namespace, column C), the sandbox's directory was the code's own: it could
//! move it away and put a directory with `work -> <any host directory>` in its place, so the
//! parent (root) read host files for the model, replaced them, or unmounted whatever host file
//! system the link named when the sandbox was dropped.
use super::*;

/// Moves the sandbox's directory away and plants `work -> VICTIM` at its path.
const SWAP_PY: &str = r#"
import os
base = os.path.dirname(os.getcwd())
try:
    os.rename(base, base + ".moved")
    os.mkdir(base)
    os.symlink(VICTIM, os.path.join(base, "work"))
    print("swapped", base)
except OSError as e:
    print("refused", e)
"#;

#[test]
fn escape_swapping_the_sandbox_directory_for_a_link_reaches_no_host_file() {
    // A host directory of root's (not world-writable), with a file readable by all.
    let victim = std::env::temp_dir().join(marker("victim"));
    std::fs::create_dir(&victim).unwrap();
    let secret = HostFile::new(victim.join("secret.txt"), "host secret");
    let python = python_interpreter().expect("python3").display().to_string();
    let sb = Sandbox::new(limits()).unwrap();
    let code = format!("VICTIM = {:?}\n{SWAP_PY}", victim.display().to_string());
    let r = sb.run(&[&python, "-c", &code], b"", Duration::from_secs(10));
    let read = sb.read_file("secret.txt");
    let wrote = sb.write_file("secret.txt", b"overwritten by the sandbox");
    let host = std::fs::read_to_string(&secret.0).unwrap_or_default();
    drop(sb);
    let _ = std::fs::remove_file(&secret.0);
    let _ = std::fs::remove_dir(&victim);
    assert!(
        read.as_ref()
            .map_or(true, |b| !b.starts_with(b"host secret")),
        "the trusted side read a host file through the swapped directory: {r:?}"
    );
    assert_eq!(
        host, "host secret",
        "the trusted side wrote a host file through the swapped directory ({wrote:?}): {r:?}"
    );
}

/// Another sandbox's working copy (another episode's files, another candidate's solution) is
/// out of reach, also by its host path where the code runs on the host's paths.
#[test]
fn escape_reading_another_sandboxs_working_copy_fails() {
    let secret = marker("neighbour");
    let other = Sandbox::new(limits()).unwrap();
    other
        .write_file("pkg/solution.py", secret.as_bytes())
        .unwrap();
    let host = other.host_workdir().display().to_string();
    let sb = Sandbox::new(limits()).unwrap();
    let r = sb.run_shell(
        &format!(
            "cat {host}/pkg/solution.py 2>&1; ls -la {host} {host}/.. 2>&1; \
             cat /tmp/composer-sandbox-*/work/pkg/solution.py 2>&1; echo done"
        ),
        Duration::from_secs(10),
    );
    assert!(r.stdout.contains("done"), "{r:?}");
    assert!(
        !r.stdout.contains(&secret),
        "read another sandbox's working copy: {r:?}"
    );
}
