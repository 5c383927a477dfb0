# composer-sandbox test runner (trusted code; runs inside the sandbox next to the candidate).
# argv[1] = the result-channel fd. The per-run nonce arrives on stdin (never on disk, argv or
# env), and every result line is "<nonce> <json>", so text the candidate prints (or writes to
# the wrong fd) cannot pass for a result. Tests run one by one, each in its own copy of the
# candidate's namespace; a test counts as passed only when its result line arrived.
import json
import os
import sys
import traceback


def _main():
    nonce = sys.stdin.readline().strip()
    fd = int(sys.argv[1])
    del sys.argv[1:]

    def report(obj):
        os.write(fd, (nonce + " " + json.dumps(obj) + "\n").encode("utf-8", "replace"))

    def describe(exc):
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return text[-2000:]

    with open("tests.json", encoding="utf-8") as f:
        spec = json.load(f)
    with open("solution.py", encoding="utf-8", errors="replace") as f:
        source = f.read()
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the run goes on
        report({"kind": "load", "ok": False, "error": describe(exc)})
        return
    entry = spec["entry_point"]
    if entry not in namespace:
        report({"kind": "load", "ok": False,
                "error": "NameError: the solution does not define `%s`" % entry})
        return
    report({"kind": "load", "ok": True, "error": ""})
    for index, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, "test_%d" % index, "exec"), dict(namespace))
            report({"kind": "test", "index": index, "ok": True, "error": ""})
        except BaseException as exc:
            report({"kind": "test", "index": index, "ok": False, "error": describe(exc)})
    report({"kind": "done"})


_main()
