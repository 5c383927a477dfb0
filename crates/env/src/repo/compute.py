# composer-env repository compute harness (untrusted once the candidate's code is imported: it
# only computes). Requests arrive as one JSON list on stdin; each answer is one line
# {"id", "ok", "value" | "type", "error"} on the saved stdout descriptor. Values are encoded
# with exact-type checks, so an object with a custom __eq__ or a built-in subclass cannot be
# sent; whatever this process writes is at most a claim about what a call returned.
# (Follows composer-sandbox's plain_values.py prelude: enc, dec, send, failed_reply.)
import importlib
import signal

OUT = os.dup(1)
os.dup2(2, 1)
sys.path.insert(0, os.getcwd())


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
            reply = failed_reply(r["id"], exc)
        send(reply)


main()
