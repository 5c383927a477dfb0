# composer-sandbox compute harness. It runs next to the candidate's code and is NOT trusted:
# the candidate can patch anything here. It only computes: it loads solution.py, then answers
# call requests (one JSON line each on stdin) with the entry point's return value in a plain
# tagged encoding on fd 3. The expected values never reach this process; the tests run in a
# separate trusted process that compares the decoded values, so whatever this process writes is
# at most a claim about what the function returned.
# (Follows the plain_values.py prelude: enc, dec, send, describe, failed_reply.)
OUT = 3


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
            reply = failed_reply(rid, exc)
        send(reply)


main()
