//! Class 3: forging results.

use super::*;

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
