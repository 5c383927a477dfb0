# composer-env repository judge (trusted; never loads the candidate's code). The hidden test
# modules arrive on stdin (never on disk). Every import of a repository module gives a Ref
# proxy; calling a Ref consults the memo of answers the candidate's process already gave for
# this test (in call order). An unknown call ends the test as "pending" with the request; the
# parent has the candidate compute it in its own sandbox and runs the judge again. Answers are
# decoded into fresh built-in objects, so every assert compares genuine values here, in a
# process the candidate never reaches. Verdict lines go to the saved stdout descriptor.
# (Follows composer-sandbox's plain_values.py prelude: enc, dec, send, describe, answer,
# CodeCallFailed.)
OUT = os.dup(1)
os.dup2(2, 1)


class Pending(BaseException):
    def __init__(self, request):
        BaseException.__init__(self)
        self.request = request


class Ref:
    """A name in the repository (module, function, class) seen only through the parent."""
    __slots__ = ("_path",)

    def __init__(self, path):
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Ref(self._path + "." + name)

    def __repr__(self):
        return "<repository object %s>" % self._path

    def __call__(self, *args, **kwargs):
        req = {"path": self._path, "args": [enc(a) for a in args],
               "kwargs": [[k, enc(v)] for k, v in kwargs.items()]}
        if STATE["pending"] is not None:
            raise Pending(STATE["pending"])
        k = STATE["calls"]
        STATE["calls"] = k + 1
        memo = STATE["memo"]
        if k >= len(memo):
            # Remembered, so a test that swallows the exception (`except:`) still waits.
            STATE["pending"] = req
            raise Pending(req)
        known = memo[k]
        if json.dumps(known.get("req"), sort_keys=True) != json.dumps(req, sort_keys=True):
            raise CodeCallFailed("the test is not deterministic (call %d changed)" % k)
        return answer(known.get("res"))


STATE = {"calls": 0, "memo": [], "pending": None}
REAL_IMPORT = builtins.__import__


def main():
    spec = json.loads(sys.stdin.buffer.readline())
    repo_modules = set(spec["modules"])

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        top = name.split(".")[0]
        if level == 0 and top in repo_modules:
            return Ref(name) if fromlist else Ref(top)
        return REAL_IMPORT(name, globals, locals, fromlist, level)

    test_builtins = dict(vars(builtins))
    test_builtins["__import__"] = guarded_import
    for file_name, source in spec["files"]:
        module = os.path.splitext(os.path.basename(file_name))[0]
        namespace = {"__name__": module, "__builtins__": test_builtins}
        tests = []
        try:
            exec(compile(source, file_name, "exec"), namespace)
            tests = [n for n, v in namespace.items() if n.startswith("test") and callable(v)]
            header_error = None
        except BaseException as exc:
            header_error = describe(exc)
            if isinstance(exc, Pending):
                header_error = "a repository call at module level is not supported"
        if header_error is not None:
            send({"file": file_name, "error": header_error})
            continue
        for name in tests:
            key = module + "::" + name
            STATE["calls"] = 0
            STATE["memo"] = spec["memo"].get(key, [])
            STATE["pending"] = None
            try:
                namespace[name]()
                verdict = {"test": key, "status": "pass"}
            except BaseException as exc:
                verdict = {"test": key, "status": "fail", "error": describe(exc)}
            if STATE["pending"] is not None:
                verdict = {"test": key, "status": "pending", "request": STATE["pending"]}
            send(verdict)
    send({"done": True})


main()
