//! Class 2: patching the grader in-process.

use super::*;

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
