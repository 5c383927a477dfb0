//! The attack suite of `/work/shared/GRADING.md`: one test per class of attack on the grader,
//! each of which must score 0, plus the escape attempts on the sandbox itself. When a new trick
//! is found, add it here.

use std::path::PathBuf;
use std::time::Duration;

use composer_sandbox::*;

/// Whether `CI` is set (as the other crates' tests read it).
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// A protection `test` checks is missing on this machine: a failure under `CI` (a CI run
/// must prove the containment, never skip it), else a loud SKIPPED line. Only a protection
/// switched off on purpose by its variable (`disabled_by`, e.g. the README's
/// `COMPOSER_SANDBOX_NO_NAMESPACES=1` run) may skip under `CI`.
fn protection_missing(test: &str, what: &str, disabled_by: &[&str], caps: &Capabilities) {
    let on_purpose = disabled_by.iter().find(|v| std::env::var_os(v).is_some());
    assert!(
        !in_ci() || on_purpose.is_some(),
        "{test}: {what} is missing on this machine but CI is set: the containment cannot be \
         checked ({:?})",
        caps.notes
    );
    let why = on_purpose.map_or(String::new(), |v| format!(" ({v} is set)"));
    eprintln!("SKIPPED: {test}: {what}{why} ({:?})", caps.notes);
}

/// A marker no test file, process or path of this run shares with another.
fn marker(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("composer-secret-{tag}-{}-{nanos}", std::process::id())
}

/// A task whose expected values are secrets: only a grader leak can produce them.
fn secret_task(secret: &str) -> CodeTask {
    CodeTask {
        id: format!("attack/{secret}"),
        prompt: "Write f(x).".into(),
        entry_point: "f".into(),
        tests: (0..4)
            .map(|i| format!("assert f({i}) == '{secret}-{i}'"))
            .collect(),
    }
}

fn limits() -> SandboxLimits {
    SandboxLimits {
        wall_time: Duration::from_secs(10),
        cpu_time_s: 5,
        ..SandboxLimits::default()
    }
}

/// Grades `code` against `task` and asserts it scores exactly 0.
fn assert_zero(code: &str, task: &CodeTask) -> GradeReport {
    let report = grade(code, task, &limits(), RewardMode::FractionPassed);
    assert_eq!(
        (report.passed, report.reward),
        (0, 0.0),
        "the attack scored: {report:#?}"
    );
    assert!(
        !matches!(report.outcome, Outcome::SandboxError(_)),
        "{report:#?}"
    );
    report
}

/// Host processes whose command line contains `marker`.
fn processes_with_marker(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            if String::from_utf8_lossy(&cmd).contains(marker) {
                found.push(name);
            }
        }
    }
    found
}

/// A host file readable by everyone, removed on drop.
struct HostFile(PathBuf);

impl HostFile {
    fn new(path: PathBuf, text: &str) -> HostFile {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        HostFile(path)
    }
}

impl Drop for HostFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Python that searches everything it can reach for `MARK` (files under the working
/// directory, its parents, /proc/self/cwd, symlinks to /, /tmp, $HOME, /root, /home, the whole
/// file system, other processes' command lines and environments), then prints what it found.
const SEARCH_PY: &str = r#"
import os, re, stat, time
found = []
t0 = time.time()
WALK = globals().get("WALK", True)
def scan(p):
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):
            return
        with open(p, "rb") as fh:
            data = fh.read(1 << 20)
        if MARK.encode() in data:
            found.append((p, data))
    except Exception:
        pass
def walk(root, depth=6):
    if not WALK:
        return
    try:
        for dp, dn, fn in os.walk(root, followlinks=True):
            if time.time() - t0 > 4 or dp.count("/") > depth + root.count("/"):
                dn[:] = []
                continue
            dn[:] = [d for d in dn if os.path.join(dp, d) not in ("/usr", "/proc", "/sys", "/lib", "/lib64", "/bin", "/sbin")]
            for f in fn:
                scan(os.path.join(dp, f))
    except Exception:
        pass
for i, target in enumerate(["/", "..", "/proc/self/cwd/..", "/proc/1/root", "/proc/1/cwd", "/tmp", HOST_DIR]):
    try:
        os.symlink(target, "link%d" % i)
    except OSError:
        pass
for root in [".", "..", "../..", "/proc/self/cwd", "/proc/self/cwd/..", "/proc/self/root",
             "/proc/1/cwd", "/proc/1/root", "/tmp", "/var/tmp", "/dev/shm", "/root", "/home",
             os.path.expanduser("~"), HOST_DIR, "/"]:
    walk(root)
for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
    if name.isdigit():
        for part in ("cmdline", "environ"):
            scan("/proc/%s/%s" % (name, part))
scan(HOST_FILE)
print("FOUND" if found else "NOTHING", [p for p, _ in found], flush=True)
def f(x):
    for _, data in found:
        m = re.search(rb"f\(%d\) == '([^']*)'" % x, data)
        if m:
            return m.group(1).decode()
    return None
"#;

// ---------------------------------------------------------------------------------------------
// Class 1: reading the tests
// ---------------------------------------------------------------------------------------------

#[test]
fn attack_reading_the_tests_finds_nothing_and_scores_zero() {
    let secret = marker("read");
    let task = secret_task(&secret);
    let caps = sandbox_capabilities();
    // The tests also lie on the host, world-readable, where a careless grader might put them
    // (only where a private root hides host files; the README documents the fallback).
    // (Host paths named without the secret, so that the solution's source holds no copy.)
    let place = marker("place").replace("secret", "leak");
    let host_dir = std::env::temp_dir().join(format!("{place}-dir"));
    std::fs::create_dir_all(&host_dir).unwrap();
    let spec = serde_json::json!({"tests": task.tests}).to_string();
    let host_file = std::env::temp_dir().join(format!("{place}.json"));
    let _planted = caps.private_root.then(|| {
        (
            HostFile::new(host_dir.join("tests.json"), &spec),
            HostFile::new(host_file.clone(), &spec),
        )
    });
    if !caps.private_root {
        eprintln!(
            "NOTE: no private root here: host files not planted ({:?})",
            caps.notes
        );
    }
    // The marker is split in the source, so that solution.py itself does not contain it.
    let (head, tail) = secret.split_at(10);
    let code = format!(
        "MARK = {head:?} + {tail:?}\nHOST_DIR = {:?}\nHOST_FILE = {:?}\n{SEARCH_PY}",
        host_dir.display().to_string(),
        host_file.display().to_string()
    );
    let report = assert_zero(&code, &task);
    assert!(report.feedback.contains("NOTHING"), "{}", report.feedback);
    // Control: the same search, run unsandboxed on the host, finds the tests and answers
    // every call, so the attack is a real one.
    let control = format!("WALK = False\n{code}\nprint([f(i) for i in range(4)])\n");
    let _control_file = HostFile::new(host_file.clone(), &spec);
    if let Ok(out) = std::process::Command::new("python3")
        .args(["-I", "-S", "-c", &control])
        .current_dir(&host_dir)
        .output()
    {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&format!("{secret}-3")), "control: {text}");
    }
    let _ = std::fs::remove_dir_all(&host_dir);
}

#[test]
fn attack_reading_hidden_tests_next_to_a_working_copy_fails() {
    // The repository-task layout: hidden tests on the host beside the working copy.
    let secret = marker("hidden");
    let task_dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(task_dir.path().join("hidden_tests")).unwrap();
    let _hidden = HostFile::new(
        task_dir.path().join("hidden_tests/test_x.py"),
        &format!("def test_x():\n    assert f(0) == '{secret}-0'\n"),
    );
    let sb = Sandbox::new(limits()).unwrap();
    sb.write_file("pkg/mod.py", b"x = 1\n").unwrap();
    let host = task_dir.path().display().to_string();
    let (head, tail) = secret.split_at(10);
    let caps = sandbox_capabilities();
    let r = sb.run_shell(
        &format!(
            "cat ../hidden_tests/* ../../hidden_tests/* ../*/hidden_tests/* \
             /proc/self/cwd/../hidden_tests/* {host}/hidden_tests/* 2>&1; \
             ln -s / rootlink; ln -s {host} tasklink; cat rootlink{host}/hidden_tests/* \
             tasklink/hidden_tests/* /proc/1/root{host}/hidden_tests/* 2>&1; \
             A={head}; B={tail}; grep -rl -e \"$A$B\" / --exclude-dir=proc --exclude-dir=sys \
             --exclude-dir=usr --exclude-dir=dev 2>/dev/null; echo done"
        ),
        Duration::from_secs(20),
    );
    assert!(r.stdout.contains("done"), "{r:#?}");
    if caps.private_root {
        assert!(
            !r.stdout.contains(&secret) && !r.stdout.contains("test_x"),
            "hidden tests leaked: {r:#?}"
        );
    } else {
        protection_missing(
            "attack_reading_hidden_tests_next_to_a_working_copy_fails",
            "no private root: host files are readable",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
    }
    // The symlinks the sandbox made do not fool the trusted side either.
    assert!(sb.read_file("rootlink/etc/hostname").is_err());
    assert!(sb.read_file("tasklink/hidden_tests/test_x.py").is_err());
    assert!(sb.write_file("rootlink/tmp/x", b"x").is_err());
    assert_eq!(sb.read_file("pkg/mod.py").unwrap(), b"x = 1\n");
}

// ---------------------------------------------------------------------------------------------
// Class 2: patching the grader in-process
// ---------------------------------------------------------------------------------------------

#[test]
fn attack_patching_the_grader_in_process_scores_zero() {
    let task = secret_task(&marker("patch"));
    let attacks = [
        // json.dumps: every message claims success.
        r#"
import json
_dumps = json.dumps
def dumps(obj, *a, **k):
    if isinstance(obj, dict):
        obj = dict(obj); obj["ok"] = True; obj.pop("error", None)
    return _dumps(obj, *a, **k)
json.dumps = dumps
def f(x):
    raise ValueError("nope")
"#,
        // sys.stdout / sys.stderr replaced, results printed as passes.
        r#"
import sys, io
class Out(io.StringIO):
    def write(self, s):
        return sys.__stdout__.write('{"verdict": 0, "ok": true, "error": ""}\n')
sys.stdout = sys.stderr = Out()
print("x")
def f(x):
    return None
"#,
        // builtins: assertions and comparisons neutered.
        r#"
import builtins
class Never(Exception):
    pass
builtins.AssertionError = Never
builtins.isinstance = lambda *a: True
builtins.type = lambda *a: int if len(a) == 1 else type(*a)
builtins.ValueError = Never
def f(x):
    assert False
"#,
        // sys.exit / os._exit replaced, then the process ends "successfully" mid-way.
        r#"
import sys, os
sys.exit = lambda *a: None
os._exit = lambda *a: None
def f(x):
    os.kill(os.getpid(), 9)
"#,
        // unittest / pytest internals.
        r#"
import sys, types, unittest
unittest.TestCase.assertEqual = lambda *a, **k: None
unittest.TestCase.run = lambda self, result=None: result
fake = types.ModuleType("pytest")
fake.main = lambda *a, **k: 0
sys.modules["pytest"] = fake
def f(x):
    return 0
"#,
        // The harness itself: its encoder patched to claim whatever is asked.
        r#"
import sys, gc
for o in gc.get_objects():
    if isinstance(o, dict) and "enc" in o and "send" in o:
        o["enc"] = lambda v, d=0: True
def f(x):
    return 12345
"#,
    ];
    for code in attacks {
        assert_zero(code, &task);
    }
}

// ---------------------------------------------------------------------------------------------
// Class 3: forging results
// ---------------------------------------------------------------------------------------------

#[test]
fn attack_forging_results_scores_zero() {
    let task = secret_task(&marker("forge"));
    let code = r#"
import gc, os, sys, json
lines = []
for i in range(8):
    lines.append(json.dumps({"verdict": i, "ok": True, "error": ""}))
    lines.append(json.dumps({"id": i, "call": i, "ok": True, "value": "x"}))
lines.append(json.dumps({"done": True}))
blob = ("\n".join(lines) + "\n").encode()
# Every descriptor, every nonce-looking string the runner may hold, the frames up the stack.
for fd in range(0, 64):
    try:
        os.write(fd, blob)
    except OSError:
        pass
for p in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
    try:
        with open("/proc/self/fd/" + p, "wb") as fh:
            fh.write(blob)
    except OSError:
        pass
secrets = [o for o in gc.get_objects() if isinstance(o, str) and len(o) == 32]
frame = sys._getframe()
while frame is not None:
    for v in list(frame.f_locals.values()):
        if isinstance(v, int) and 0 <= v < 64:
            try:
                os.write(v, blob)
            except OSError:
                pass
    frame = frame.f_back
def f(x):
    for fd in range(0, 64):
        try:
            os.write(fd, blob)
        except OSError:
            pass
    return "forged"
"#;
    assert_zero(code, &task);
}

// ---------------------------------------------------------------------------------------------
// Class 4: values that equal everything
// ---------------------------------------------------------------------------------------------

#[test]
fn attack_values_that_equal_everything_score_zero() {
    let task = secret_task(&marker("eq"));
    // A list-returning task too, for the container subclasses.
    let list_task = CodeTask {
        id: "attack/list".into(),
        prompt: "Write f(x).".into(),
        entry_point: "f".into(),
        tests: vec![
            "assert f(1) == [1, 2, 3]".into(),
            "assert f(2) == [5]".into(),
            "assert f(3) == (1,)".into(),
            "assert f(4) == {'a': 1}".into(),
        ],
    };
    let attacks = [
        "class E:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\ndef f(x):\n    return E()\n",
        "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\ndef f(x):\n    return I(7)\n",
        "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\ndef f(x):\n    return S('x')\n",
        "class L(list):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return L()\n",
        "class T(tuple):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return T()\n",
        "class D(dict):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return D()\n",
        // Hiding the subclass from the harness's type checks.
        "import builtins\nclass E(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n_t = type\nbuiltins.type = lambda *a: str if len(a) == 1 and isinstance(a[0], E) else _t(*a)\ndef f(x):\n    return E('x')\n",
        // Patching the comparison on the built-in side is impossible (immutable types), but try.
        "try:\n    int.__eq__ = lambda a, b: True\nexcept TypeError:\n    pass\ndef f(x):\n    return 0\n",
    ];
    for code in attacks {
        assert_zero(code, &task);
        assert_zero(code, &list_task);
    }
    // Exceptions with control-flow meaning: StopIteration would end `all(map(f, xs))` early.
    let flow_task = CodeTask {
        id: "attack/flow".into(),
        prompt: "Write f(x).".into(),
        entry_point: "f".into(),
        tests: vec![
            "assert all(map(f, [1, 2, 3]))".into(),
            "assert not hasattr(f(1), 'real')".into(),
            "assert any(True for _ in map(f, [1])) or True and f(0) == 5".into(),
            "assert sum(1 for _ in map(f, [1, 2])) == 0 and f(2) == 5".into(),
        ],
    };
    assert_zero("def f(x):\n    raise StopIteration\n", &flow_task);
    assert_zero("def f(x):\n    raise AttributeError('real')\n", &flow_task);
    // Genuine values still compare as values.
    let honest = "def f(x):\n    return {1: [1, 2, 3], 2: [5], 3: (1,), 4: {'a': 1}}[x]\n";
    let r = grade(honest, &list_task, &limits(), RewardMode::AllOrNothing);
    assert_eq!(r.reward, 1.0, "{r:#?}");
}

// ---------------------------------------------------------------------------------------------
// Class 5: test-runner configuration
// ---------------------------------------------------------------------------------------------

const RUNNER_CONFIG_PY: &str = r##"
import os
payload = "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
files = {
    "conftest.py": payload, "sitecustomize.py": payload, "usercustomize.py": payload,
    "evil.pth": "import builtins; builtins.AssertionError = KeyError\n",
    "pytest.ini": "[pytest]\naddopts = -p no:assertion\n", "setup.cfg": "[tool:pytest]\n",
    "tox.ini": "[pytest]\n", "pyproject.toml": "[tool.pytest.ini_options]\n",
}
wrote = []
for d in [".", "..", "/tmp", os.path.expanduser("~"), "/usr/lib/python3/dist-packages",
          "/usr/local/lib", "/usr/local/bin", "/etc"]:
    for name, text in files.items():
        try:
            with open(os.path.join(d, name), "w") as fh:
                fh.write(text)
            wrote.append(os.path.join(d, name))
        except OSError:
            pass
# A fake interpreter first on PATH (and where the grader's python lives).
for d in ["bin", "/tmp/bin", "/usr/local/bin", "/usr/bin"]:
    try:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "python3"), "w") as fh:
            fh.write("#!/bin/sh\necho '{\"verdict\": 0, \"ok\": true}'\n")
        os.chmod(os.path.join(d, "python3"), 0o755)
        wrote.append(os.path.join(d, "python3"))
    except OSError:
        pass
os.environ["PATH"] = "bin:/tmp/bin:" + os.environ.get("PATH", "")
print("WROTE", wrote)
def f(x):
    return None
"##;

#[test]
fn attack_test_runner_configuration_scores_zero() {
    let task = secret_task(&marker("config"));
    let report = assert_zero(RUNNER_CONFIG_PY, &task);
    // Nothing outside the candidate's own working copy and private /tmp was writable.
    for system in ["/usr/lib/python3", "/usr/local", "/etc"] {
        assert!(
            !report.feedback.contains(&format!("'{system}")),
            "{}",
            report.feedback
        );
    }
    // And nothing persists into the next grading (a fresh sandbox for every run).
    assert_zero(RUNNER_CONFIG_PY, &task);
    for host in [
        "/usr/local/bin/python3",
        "/etc/evil.pth",
        "/etc/conftest.py",
    ] {
        assert!(!std::path::Path::new(host).exists(), "{host} was written");
    }
}

#[test]
fn grading_copy_takes_only_the_named_source_files() {
    // A working copy the agent filled with runner configuration and a symlink to a host file.
    let work = Sandbox::new(limits()).unwrap();
    work.write_file("pkg/mod.py", b"def f(x):\n    return x\n")
        .unwrap();
    for name in [
        "conftest.py",
        "sitecustomize.py",
        "usercustomize.py",
        "x.pth",
        "pytest.ini",
    ] {
        work.write_file(name, b"import os\n").unwrap();
    }
    work.write_file("pkg/other.py", b"y = 2\n").unwrap();
    let r = work.run_shell(
        "ln -s /etc/hostname pkg/link.py; ln pkg/other.py pkg/hard.py; echo ok",
        Duration::from_secs(10),
    );
    assert_eq!(r.stdout.trim(), "ok", "{r:#?}");
    // The grading copy: the task's trusted tree, then only the graded source file.
    let trusted = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(trusted.path().join("pkg")).unwrap();
    std::fs::write(trusted.path().join("pkg/__init__.py"), "").unwrap();
    std::fs::write(
        trusted.path().join("pkg/mod.py"),
        "raise NotImplementedError\n",
    )
    .unwrap();
    let grading = Sandbox::new(limits()).unwrap();
    assert_eq!(grading.copy_tree_from(trusted.path(), "").unwrap(), 2);
    grading
        .copy_files_from(work.host_workdir(), &["pkg/mod.py"])
        .unwrap();
    assert_eq!(
        grading.read_file("pkg/mod.py").unwrap(),
        b"def f(x):\n    return x\n"
    );
    assert!(grading
        .copy_files_from(work.host_workdir(), &["pkg/link.py"])
        .is_err());
    assert!(grading
        .copy_files_from(work.host_workdir(), &["../../etc/hostname"])
        .is_err());
    // A hard-linked file is refused too (it could be a host file where there is no mount
    // namespace), and so is a directory.
    assert!(grading
        .copy_files_from(work.host_workdir(), &["pkg/hard.py"])
        .is_err());
    assert!(grading
        .copy_files_from(work.host_workdir(), &["pkg"])
        .is_err());
    let r = grading.run_shell("find . | sort", Duration::from_secs(10));
    assert_eq!(
        r.stdout, ".\n./pkg\n./pkg/__init__.py\n./pkg/mod.py\n",
        "{r:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Class 6: escaping the sandbox
// ---------------------------------------------------------------------------------------------

#[test]
fn escape_host_files_are_invisible() {
    let secret = marker("hostfile");
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let in_tmp = HostFile::new(std::env::temp_dir().join(&secret), &secret);
    let in_home = HostFile::new(PathBuf::from(&home).join(&secret), &secret);
    let paths: Vec<String> = [&in_tmp.0, &in_home.0]
        .iter()
        .flat_map(|p| {
            let p = p.display().to_string();
            vec![
                p.clone(),
                format!("/proc/self/root{p}"),
                format!("/proc/1/root{p}"),
            ]
        })
        .chain(["/etc/passwd", "/etc/hostname", "/etc/shadow"].map(String::from))
        .collect();
    let code = format!(
        r#"
import os
for p in {paths:?}:
    try:
        print("READ", p, open(p).read()[:80])
    except OSError as e:
        print("blocked", p, e.errno)
print("TMP", os.listdir("/tmp"), "ROOT", sorted(os.listdir("/")))
"#
    );
    let r = run_python(&code, &limits());
    assert_eq!(r.outcome, Outcome::Completed, "{r:#?}");
    let caps = sandbox_capabilities();
    if !caps.private_root {
        protection_missing(
            "escape_host_files_are_invisible",
            "no private root: host files are readable",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
        return;
    }
    assert!(!r.stdout.contains("READ"), "{r:#?}");
    {
        assert!(r.stdout.contains("TMP []"), "{r:#?}");
        assert!(
            !r.stdout.contains("'home'") && !r.stdout.contains("'root'"),
            "{r:#?}"
        );
    }
}

#[test]
fn escape_host_unix_sockets_are_unreachable() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::UnixListener;
    let caps = sandbox_capabilities();
    let secret = marker("sock");
    let path = std::env::temp_dir().join(format!("{secret}.sock"));
    let listener = UnixListener::bind(&path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
    listener.set_nonblocking(true).unwrap();
    // An abstract socket too (no path at all; reachable from the same network namespace).
    let abstract_name = format!("{secret}-abstract");
    let addr =
        <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
            abstract_name.as_bytes(),
        )
        .unwrap();
    let abstract_listener = UnixListener::bind_addr(&addr).unwrap();
    abstract_listener.set_nonblocking(true).unwrap();
    let code = format!(
        r#"
import socket, glob
targets = [{path:?}, "/proc/1/root" + {path:?}] + glob.glob("/tmp/*.sock") + glob.glob("/run/*.sock") + glob.glob("/var/run/*/*.sock")
for t in targets:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(t); s.sendall(b"escaped"); print("connected", t)
    except OSError as e:
        print("blocked", t, e.errno)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect("\0" + {abstract_name:?}); s.sendall(b"escaped"); print("connected abstract")
except OSError as e:
    print("blocked abstract", e.errno)
"#,
        path = path.display().to_string()
    );
    let r = run_python(&code, &limits());
    let _ = std::fs::remove_file(&path);
    if !caps.private_root || !caps.network_namespace {
        protection_missing(
            "escape_host_unix_sockets_are_unreachable",
            "no private root / network namespace: host sockets are reachable",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
        return;
    }
    assert!(!r.stdout.contains("connected"), "{r:#?}");
    assert!(listener.accept().is_err(), "the sandbox reached the socket");
    assert!(
        abstract_listener.accept().is_err(),
        "the sandbox reached the abstract socket"
    );
    // Graded: the same attempt inside a solution scores 0.
    let task = secret_task(&secret);
    assert_zero(&format!("{code}\ndef f(x):\n    return None\n"), &task);
}

#[test]
fn escape_tcp_to_localhost_is_blocked() {
    let caps = sandbox_capabilities();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let code = format!(
        "import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    s.sendall(b'x')\n    print('connected')\nexcept OSError as e:\n    print('blocked', e.errno)\n"
    );
    let r = run_python(&code, &limits());
    if !caps.network_namespace {
        protection_missing(
            "escape_tcp_to_localhost_is_blocked",
            "no network namespace",
            &["COMPOSER_SANDBOX_NO_NAMESPACES"],
            &caps,
        );
        return;
    }
    assert!(r.stdout.starts_with("blocked"), "{r:#?}");
    assert!(
        listener.accept().is_err(),
        "the sandbox reached the listener"
    );
}

#[test]
fn escape_writing_outside_the_working_copy_fails() {
    let secret = marker("write");
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let host_targets = [
        std::env::temp_dir().join(&secret),
        PathBuf::from(&home).join(&secret),
        PathBuf::from("/etc").join(&secret),
        PathBuf::from("/usr/local").join(&secret),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(&secret),
    ];
    let mut targets: Vec<String> = host_targets
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    targets.extend([
        format!("../{secret}"),
        format!("../../{secret}"),
        format!("/proc/self/cwd/../{secret}"),
        format!("/dev/shm/{secret}"),
        format!("/var/tmp/{secret}"),
    ]);
    let code = format!(
        r#"
import os
open("inside.txt", "w").write("ok")
for p in {targets:?}:
    try:
        open(p, "w").write("escaped")
        print("wrote", p)
    except OSError as e:
        print("blocked", p, e.errno)
"#
    );
    let r = run_python(&code, &limits());
    assert_eq!(r.outcome, Outcome::Completed, "{r:#?}");
    for p in &host_targets {
        assert!(!p.exists(), "{} was written on the host", p.display());
    }
    for p in ["/var/tmp", "/dev/shm"] {
        assert!(!PathBuf::from(p).join(&secret).exists());
    }
    let parent = std::env::temp_dir();
    for e in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
        assert!(
            !e.file_name().to_string_lossy().contains(&secret),
            "{}",
            e.path().display()
        );
    }
    // The working copy itself is writable and persists between runs of one sandbox.
    let sb = Sandbox::new(limits()).unwrap();
    let r = sb.run_shell(
        "echo hi > a.txt && mkdir -p d && echo x > d/b",
        Duration::from_secs(5),
    );
    assert_eq!(r.exit_code, Some(0), "{r:#?}");
    let r = sb.run_shell("cat a.txt d/b", Duration::from_secs(5));
    assert_eq!(r.stdout, "hi\nx\n", "{r:#?}");
    assert_eq!(sb.read_file("a.txt").unwrap(), b"hi\n");
    let host = sb.host_workdir().to_path_buf();
    drop(sb);
    assert!(!host.exists(), "working copy not removed");
}

#[test]
fn escape_processes_do_not_outlive_the_episode() {
    let secret = marker("linger");
    // Double fork + setsid + ignore signals + exec a long sleeper carrying the marker.
    let code = format!(
        r#"
import os, sys, signal
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            os.execv("/bin/sleep", ["/bin/sleep", "600", {secret:?}])
        os._exit(0)
print("spawned", flush=True)
"#
    );
    let r = run_python(&code, &limits());
    assert!(r.stdout.contains("spawned"), "{r:#?}");
    let sb = Sandbox::new(limits()).unwrap();
    let r = sb.run_shell(
        &format!("(setsid sleep 600 {secret} &) ; nohup sleep 600 {secret} >/dev/null 2>&1 & echo started"),
        Duration::from_secs(5),
    );
    assert!(r.stdout.contains("started"), "{r:#?}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        processes_with_marker(&secret),
        Vec::<String>::new(),
        "processes survived the run"
    );
    // Graded: a lingering helper started by the solution is gone too.
    let task = secret_task(&secret);
    assert_zero(&format!("{code}\ndef f(x):\n    return None\n"), &task);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(processes_with_marker(&secret), Vec::<String>::new());
}

#[test]
fn escape_fork_bomb_is_contained() {
    let lim = SandboxLimits {
        wall_time: Duration::from_secs(3),
        cpu_time_s: 2,
        max_processes: 16,
        ..SandboxLimits::default()
    };
    let code = "import os\nn = 0\nwhile n < 10000:\n    try:\n        if os.fork() == 0:\n            import time; time.sleep(30); os._exit(0)\n        n += 1\n    except OSError:\n        break\nprint('forked', n, flush=True)\n";
    let r = run_python(code, &lim);
    let forked: u64 = r
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("forked "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no fork count: {r:#?}"));
    assert!(forked < lim.max_processes, "forked {forked}");
    // The classic bomb: every process forks forever; contained, and this process is fine.
    let r = run_python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        &lim,
    );
    assert!(
        matches!(
            r.outcome,
            Outcome::TimedOut | Outcome::CpuLimit | Outcome::Killed { .. }
        ),
        "{r:#?}"
    );
    assert_eq!(run_python("print('alive')", &limits()).stdout, "alive\n");
}

#[test]
fn escape_memory_across_a_process_tree_is_capped() {
    let caps = sandbox_capabilities();
    // Each of 6 children takes 100 MB, which alone fits the tree's 256 MiB cap (and the
    // per-process address-space limit); together they would hold 600 MB. All allocate within
    // the first moments and then hold for 3 s, so the children that live through the hold held
    // their memory at the same time: at most 2 of them can (3 x 100 MB > 256 MiB).
    let lim = SandboxLimits {
        memory_bytes: 256 << 20,
        wall_time: Duration::from_secs(30),
        ..SandboxLimits::default()
    };
    let code = r#"
import os, time
N = 100 * 1000 * 1000
pids = []
for i in range(6):
    pid = os.fork()
    if pid == 0:
        try:
            block = bytearray(N)
            block[::4096] = b"x" * len(range(0, N, 4096))
        except MemoryError:
            print("child memoryerror", flush=True)
            os._exit(3)
        print("child holds 100 MB", flush=True)
        time.sleep(3)
        os._exit(0)
    pids.append(pid)
for pid in pids:
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        print("child survived", flush=True)
    else:
        print("child stopped %d" % status, flush=True)
print("done", flush=True)
"#;
    let r = run_python(code, &lim);
    if caps.cgroup.is_none() {
        protection_missing(
            "escape_memory_across_a_process_tree_is_capped",
            "no cgroup: only a per-process RLIMIT_AS",
            &[
                "COMPOSER_SANDBOX_NO_CGROUP",
                "COMPOSER_SANDBOX_NO_NAMESPACES",
            ],
            &caps,
        );
        return;
    }
    let survived = r.stdout.matches("child survived").count();
    assert!(
        survived <= 2,
        "{survived} children held 100 MB at once under a 256 MiB cap: {r:#?}"
    );
    let stopped = r.stdout.matches("child stopped").count();
    let killed_tree = r.outcome == Outcome::MemoryLimit;
    assert!(
        killed_tree || stopped >= 4,
        "the tree went over its cap without a kill or failed allocation: {r:#?}"
    );
    // Each child alone fits: the cap is on the total, not a per-process limit below 100 MB.
    assert!(
        r.stdout.contains("child holds 100 MB"),
        "no child could take 100 MB: {r:#?}"
    );
}

#[test]
fn escape_kernel_surface_is_filtered() {
    let caps = sandbox_capabilities();
    let code = r#"
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, fn):
    r = fn()
    print(name, "ok" if r == 0 else "blocked %d" % ctypes.get_errno(), flush=True)
attempt("unshare_user", lambda: libc.unshare(0x10000000))
attempt("unshare_net", lambda: libc.unshare(0x40000000))
attempt("ptrace", lambda: libc.ptrace(0, 0, 0, 0))
attempt("bpf", lambda: libc.syscall(321, 0, 0, 0))
attempt("userfaultfd", lambda: -1 if libc.syscall(323, 0) < 0 else 0)
attempt("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
# Ordinary process creation still works (fork, posix_spawn/clone3 fallback, exec).
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print("spawn", subprocess.run(["/bin/echo", "hi"], capture_output=True).stdout.decode().strip())
"#;
    let r = run_python(code, &limits());
    assert_eq!(r.outcome, Outcome::Completed, "{r:#?}");
    assert!(r.stdout.contains("fork 7"), "{r:#?}");
    assert!(r.stdout.contains("spawn hi"), "{r:#?}");
    if !caps.seccomp {
        protection_missing(
            "escape_kernel_surface_is_filtered",
            "no seccomp filter",
            &[
                "COMPOSER_SANDBOX_NO_SECCOMP",
                "COMPOSER_SANDBOX_NO_NAMESPACES",
            ],
            &caps,
        );
        return;
    }
    for name in [
        "unshare_user",
        "unshare_net",
        "ptrace",
        "bpf",
        "userfaultfd",
        "mount",
    ] {
        assert!(
            r.stdout.contains(&format!("{name} blocked 1\n")),
            "{name}: {r:#?}"
        );
    }
    // Graded: the same attempts inside a solution score 0 and break nothing.
    let task = secret_task(&marker("kernel"));
    assert_zero(&format!("{code}\ndef f(x):\n    return None\n"), &task);
}

#[test]
fn sandbox_runs_report_missing_commands_and_keep_only_stdio() {
    let sb = Sandbox::new(limits()).unwrap();
    let r = sb.run(&["/no/such/program"], b"", Duration::from_secs(5));
    assert!(
        matches!(r.outcome, Outcome::SandboxError(ref e) if e.contains("/no/such/program")),
        "{r:#?}"
    );
    // Only stdin, stdout and stderr are open in a plain run.
    let r = sb.run_shell("ls /proc/self/fd", Duration::from_secs(5));
    assert_eq!(r.exit_code, Some(0), "{r:#?}");
    let fds: Vec<&str> = r.stdout.split_whitespace().collect();
    // `ls` itself holds one more descriptor: the directory it lists.
    assert!(fds.len() <= 4, "inherited descriptors: {fds:?}");
}

/// Run by `a_missing_protection_fails_under_ci_and_skips_elsewhere` in a child process.
#[test]
#[ignore = "run in a child process by a_missing_protection_fails_under_ci_and_skips_elsewhere"]
fn missing_protection_child() {
    protection_missing(
        "missing_protection_child",
        "no seccomp filter",
        &["COMPOSER_SANDBOX_NO_SECCOMP"],
        &sandbox_capabilities(),
    );
    println!("MISSING_PROTECTION_CHILD_SKIPPED");
}

#[test]
fn a_missing_protection_fails_under_ci_and_skips_elsewhere() {
    // (CI value, COMPOSER_SANDBOX_NO_SECCOMP set) -> the child skips.
    for (ci, off, skips) in [
        (Some("true"), false, false),
        (Some("1"), false, false),
        (None, false, true),
        (Some("false"), false, true),
        (Some("true"), true, true),
    ] {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--ignored",
            "--exact",
            "missing_protection_child",
            "--nocapture",
        ]);
        cmd.env_remove("CI")
            .env_remove("COMPOSER_SANDBOX_NO_SECCOMP");
        if let Some(v) = ci {
            cmd.env("CI", v);
        }
        if off {
            cmd.env("COMPOSER_SANDBOX_NO_SECCOMP", "1");
        }
        let out = cmd.output().expect("the test binary runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let case = format!("CI={ci:?} off={off}\n{stdout}\n{stderr}");
        if skips {
            assert!(out.status.success(), "{case}");
            assert!(
                stdout.contains("MISSING_PROTECTION_CHILD_SKIPPED"),
                "{case}"
            );
            assert!(
                stderr.contains("SKIPPED: missing_protection_child: no seccomp filter"),
                "{case}"
            );
        } else {
            assert!(!out.status.success(), "{case}");
            assert!(
                stdout.contains("no seccomp filter is missing on this machine but CI is set")
                    || stderr
                        .contains("no seccomp filter is missing on this machine but CI is set"),
                "{case}"
            );
        }
    }
}
