# composer-sandbox compute harness. It runs next to the candidate's code and is NOT trusted:
# the candidate can patch anything here. It only computes: it loads solution.py, then answers
# call requests (one JSON line each on stdin) with the entry point's return value in a plain
# tagged encoding on fd 3. The expected values never reach this process; the tests run in a
# separate trusted process that compares the decoded values, so whatever this process writes is
# at most a claim about what the function returned.
import builtins
import json
import os
import sys

if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)

OUT = 3
MAX_DEPTH = 200


def send(obj):
    data = (json.dumps(obj) + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(OUT, data):]


def enc(v, depth=0):
    """Exact built-in types only: no subclasses, so no custom __eq__ ever leaves here."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if t is list or t is tuple or t is set or t is frozenset:
        items = [enc(x, depth + 1) for x in v]
        return [t.__name__, items]
    if t is dict:
        return ["dict", [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]]
    if t is bytes:
        return ["bytes", v.hex()]
    raise TypeError(
        "the function returned a value of type %s; only plain built-in types "
        "(None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset) are accepted"
        % t.__name__
    )


def dec(x):
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if t is list and len(x) == 2 and type(x[0]) is str and type(x[1]) is list:
        tag, items = x
        if tag == "list":
            return [dec(i) for i in items]
        if tag == "tuple":
            return tuple(dec(i) for i in items)
        if tag == "set":
            return {dec(i) for i in items}
        if tag == "frozenset":
            return frozenset(dec(i) for i in items)
        if tag == "dict":
            return {dec(k): dec(v) for k, v in items}
    if t is list and len(x) == 2 and x[0] == "bytes" and type(x[1]) is str:
        return bytes.fromhex(x[1])
    raise ValueError("malformed value")


def exc_type(exc):
    for k in type(exc).__mro__:
        if getattr(builtins, k.__name__, None) is k:
            return k.__name__
    return "Exception"


def describe(exc):
    import traceback
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[-2000:]


def main():
    entry = sys.argv[1]
    with open("solution.py", encoding="utf-8", errors="replace") as f:
        source = f.read()
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too
        send({"load": False, "error": describe(exc)})
        return
    fn = namespace.get(entry)
    if not callable(fn):
        send({"load": False, "error": "NameError: the solution does not define `%s`" % entry})
        return
    send({"load": True, "error": ""})
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return
        try:
            req = json.loads(line)
            rid = req["call"]
        except Exception:
            return
        try:
            args = [dec(a) for a in req["args"]]
            kwargs = {k: dec(v) for k, v in req["kwargs"]}
            value = enc(fn(*args, **kwargs))
            try:
                after = [enc(a) for a in args]
            except BaseException:
                after = None
            reply = {"id": rid, "ok": True, "value": value, "args": after}
        except BaseException as exc:
            try:
                exc_args = [enc(a) for a in exc.args][:8]
            except BaseException:
                exc_args = None
            reply = {"id": rid, "ok": False, "type": exc_type(exc), "error": describe(exc),
                     "args": exc_args}
        send(reply)


main()
