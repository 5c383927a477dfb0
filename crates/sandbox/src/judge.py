# composer-sandbox judge (trusted; never loads the candidate's code). It runs each test
# statement with the entry point replaced by a proxy: a call encodes its arguments, asks the
# parent (fd 3) to have the candidate compute the result in its own sandbox, and decodes the
# answer (stdin) into fresh plain built-in objects, so every comparison the test makes runs on
# genuine int/str/list/... values, in a process the candidate cannot reach. Verdicts go to fd 3.
# (Follows the plain_values.py prelude: enc, dec, send, describe, answer, CodeCallFailed.)
OUT = 3
IN = sys.stdin.buffer


_calls = [0]


def _write_back(orig, new):
    """Mirrors in-place changes the candidate made to list/dict/set arguments."""
    t = type(orig)
    if t is list and type(new) is list:
        orig[:] = new
    elif t is dict and type(new) is dict:
        orig.clear()
        orig.update(new)
    elif t is set and type(new) is set:
        orig.clear()
        orig.update(new)


def proxy(*args, **kwargs):
    _calls[0] += 1
    rid = _calls[0]
    send({"call": rid, "args": [enc(a) for a in args],
          "kwargs": [[k, enc(v)] for k, v in kwargs.items()]})
    line = IN.readline()
    if not line:
        raise CodeCallFailed("no answer from the solution")
    reply = json.loads(line)
    if type(reply) is not dict or reply.get("id") != rid:
        raise CodeCallFailed("the solution's process answered out of protocol")
    value = answer(reply)
    after = reply.get("args")
    if type(after) is list and len(after) == len(args):
        for orig, new in zip(args, after):
            try:
                _write_back(orig, dec(new))
            except Exception:
                pass
    return value


def main():
    spec = json.loads(IN.readline())
    entry = spec["entry_point"]
    for index, test in enumerate(spec["tests"]):
        namespace = {"__name__": "tests", "__builtins__": builtins, entry: proxy}
        try:
            exec(compile(test, "test_%d" % index, "exec"), namespace)
            send({"verdict": index, "ok": True, "error": ""})
        except BaseException as exc:
            send({"verdict": index, "ok": False, "error": describe(exc)})
    send({"done": True})


main()
