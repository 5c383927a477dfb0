# composer-env repository compute harness (untrusted once the candidate's code is imported: it
# only computes). Requests arrive as one JSON list on stdin; each answer is one line
# {"id", "ok", "value" | "type", "error"} on the saved stdout descriptor. Values are encoded
# with exact-type checks, so an object with a custom __eq__ or a built-in subclass cannot be
# sent; whatever this process writes is at most a claim about what a call returned.
import importlib
import json
import os
import signal
import sys

if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)

OUT = os.dup(1)
os.dup2(2, 1)
sys.path.insert(0, os.getcwd())
MAX_DEPTH = 200


def send(obj):
    data = (json.dumps(obj) + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(OUT, data):]


def enc(v, depth=0):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return v if v == v and v not in (float("inf"), float("-inf")) else ["float", repr(v)]
    if t is list or t is tuple:
        return [t.__name__, [enc(x, depth + 1) for x in v]]
    if t is set or t is frozenset:
        return [t.__name__, [enc(x, depth + 1) for x in v]]
    if t is dict:
        return ["dict", [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]]
    if t is bytes:
        return ["bytes", v.hex()]
    raise TypeError("a value of type %s cannot be returned to the tests" % t.__name__)


def dec(x):
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    tag, items = x
    if tag == "bytes":
        return bytes.fromhex(items)
    if tag == "float":
        return float(items)
    if tag == "dict":
        return {dec(k): dec(v) for k, v in items}
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](
        dec(i) for i in items)


def resolve(path):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and ".".join(parts[:cut]).startswith(exc.name) and cut > 1:
                continue
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError("cannot resolve %s" % path)


def on_alarm(signum, frame):
    raise TimeoutError("the call took too long")


def main():
    requests = json.loads(sys.stdin.buffer.read())
    per_call = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    signal.signal(signal.SIGALRM, on_alarm)
    for r in requests:
        try:
            signal.setitimer(signal.ITIMER_REAL, per_call)
            fn = resolve(r["path"])
            value = fn(*[dec(a) for a in r["args"]], **{k: dec(v) for k, v in r["kwargs"]})
            signal.setitimer(signal.ITIMER_REAL, 0)
            reply = {"id": r["id"], "ok": True, "value": enc(value)}
        except BaseException as exc:
            signal.setitimer(signal.ITIMER_REAL, 0)
            try:
                reply = {"id": r["id"], "ok": False, "type": type(exc).__name__,
                         "error": ("%s: %s" % (type(exc).__name__, exc))[:2000]}
            except BaseException:
                reply = {"id": r["id"], "ok": False, "type": "", "error": "unprintable error"}
        send(reply)


main()
