# composer-env repository judge (trusted; never loads the candidate's code). The hidden test
# modules arrive on stdin (never on disk), then the parent's forwarded messages, one JSON line
# each; everything this process says goes on fd 3.
#
# Every import of a repository module gives a Remote: a stand-in whose attribute reads, calls
# and operators become requests ({"rpc": {...}}) that the parent forwards to the candidate's
# process of the current test (compute.py), whose replies come back as {"code": {...}}. The
# parent starts a fresh candidate process at each {"begin": test} and answers {"dead": why}
# when that process is gone. Replies decode into fresh built-in objects, or into Remotes for
# objects that stay in the candidate's process; repository classes become local classes (so
# `isinstance` and `except` work), repository exceptions are raised here as instances of them.
# What keeps the verdict honest:
# - a Remote is never equal, unequal-by-value or ordered with respect to a plain value (those
#   comparisons are not forwarded), so an object whose __eq__/__lt__ always answers True
#   cannot pass `assert f(x) == y` or `assert abs(f(x) - y) < eps`;
# - a failure of the candidate's process (no answer, a crash, a broken protocol, a time-out,
#   SystemExit) fails the test even when the test catches the exception;
# - a test passes only by returning from its function here, in a process the code never runs in;
# - the tests are the `test*` functions each hidden file defines (read from its source, before
#   anything runs), announced to the parent first: a star import cannot add tests or replace
#   one, nor shadow a built-in (`abs`) in the test module, and a module-level failure fails
#   each of the file's tests rather than counting once;
# - an operator between the code's object and a plain value (`f(x) - y`), or a unary numeric
#   operator on it (`abs`, `-`, `round`), counts only when its result is again the code's
#   object: a plain answer there would be the code's claim standing in for the arithmetic.
# (Follows composer-sandbox's plain_values.py prelude: enc, dec, send, describe.)
import ast
import types

OUT = 3
os.dup2(2, 1)
IN = sys.stdin.buffer


class CodeFailed(BaseException):
    """The candidate's process failed this test (not an exception the code raised)."""


STATE = {"file_names": frozenset(), "namespace": None, "module_level": False, "gen": 0, "file_gen": 0, "next_id": 0, "failure": None,
         "callbacks": [], "classes": {}, "module_log": [], "module_callbacks": []}
REAL_IMPORT = builtins.__import__


def fail(message):
    if STATE["failure"] is None:
        STATE["failure"] = message
    raise CodeFailed(message)


# ---- talking to the candidate's process -------------------------------------------------


def reply_value(reply, op):
    """The value of a reply, or the exception it reports raised here."""
    if type(reply) is not dict:
        fail("no answer from the code")
    if reply.get("ok") is True:
        return decode(reply.get("value"))
    raise exception_of(reply, op)


def rpc(msg):
    if STATE["failure"] is not None:
        raise CodeFailed(STATE["failure"])
    if STATE["module_level"]:
        STATE["module_log"].append(json.dumps(msg))
    STATE["next_id"] += 1
    rid = STATE["next_id"]
    msg["id"] = rid
    send({"rpc": msg})
    while True:
        m = read_message()
        if "malformed" in m:
            kill("the code sent a message this process cannot read (%s)" % m["malformed"])
        if "dead" in m:
            fail(str(m["dead"])[:2000])
        code = m.get("code")
        if type(code) is not dict:
            kill("a malformed message from the parent")
        if code.get("re") == rid:
            return code
        if code.get("op") == "callback":
            serve_callback(code)
            continue
        kill("the code's process broke the protocol")


MAX_INT_DIGITS = 100000


def bounded_int(text):
    # Python's str -> int is quadratic in the digits (plain_values lifts the interpreter's own
    # guard for exact round trips): a reply of millions of digits would stall this process.
    if len(text) > MAX_INT_DIGITS:
        raise ValueError("an integer of %d digits" % len(text))
    return int(text)


def read_message():
    line = IN.readline()
    if not line:
        os._exit(3)
    try:
        m = json.loads(line, parse_int=bounded_int)
    except (ValueError, RecursionError, MemoryError) as exc:
        # The parent's framing is its own; what can be malformed is the code's payload in it
        # (nested past the recursion limit, an endless integer): the code broke the protocol.
        return {"malformed": type(exc).__name__}
    return m if type(m) is dict else {}


def kill(why):
    send({"kill": why})
    fail(why)


def call_op(target, args, kwargs):
    enc_args = [encode(a) for a in args]
    enc_kwargs = [[k, encode(v)] for k, v in kwargs.items()]
    reply = rpc({"op": "call", "obj": target, "args": enc_args, "kwargs": enc_kwargs})
    value = reply_value(reply, "call")
    after = reply.get("after")
    if type(after) is list:
        for orig, new in zip(args, after):
            if new is not None:
                write_back(orig, decode(new))
    return value


PATH_CACHE = {}


def getattr_op(target, name):
    # Names reached by module paths (modules, functions, classes) are the same in every
    # test's process: asked once. Plain values are asked every time (module state can change).
    path = target.get("path")
    key = path + "." + name if type(path) is str else None
    if key in PATH_CACHE:
        return PATH_CACHE[key]
    try:
        value = reply_value(rpc({"op": "getattr", "obj": target, "name": name}), "getattr")
    except BaseException:
        if not STATE["module_level"] or key is None:
            raise
        # `from pkg.mod import f` at the top of a test file, where the code cannot give `f`
        # (its module is missing or broken): each test that uses it fails, as under pytest
        # the file's tests would, and the count of tests stays the same.
        STATE["failure"] = None
        return Remote({"path": key}, "unresolved", key)
    if key is not None and is_remote(value):
        PATH_CACHE[key] = value
    return value


def apply_op(fn, *args):
    return reply_value(rpc({"op": "apply", "fn": fn, "args": [encode(a) for a in args]}), fn)


def write_back(orig, new):
    """Mirrors in-place changes the code made to plain list/dict/set arguments."""
    t = type(orig)
    if t is list and type(new) is list:
        orig[:] = new
    elif (t is dict and type(new) is dict) or (t is set and type(new) is set):
        orig.clear()
        orig.update(new)


def serve_callback(req):
    """The code calls a callable of the test's (a key function, a predicate...)."""
    rid = req.get("id")
    try:
        n = req.get("cb")
        if type(n) is not int or not 0 <= n < len(STATE["callbacks"]):
            raise ValueError("no such callback")
        fn = STATE["callbacks"][n]
        args = [decode(a) for a in req.get("args", [])]
        kwargs = {str(k): decode(v) for k, v in req.get("kwargs", [])}
        reply = {"re": rid, "ok": True, "value": encode(fn(*args, **kwargs))}
    except CodeFailed:
        raise
    except BaseException as exc:
        reply = {"re": rid, "ok": False, "type": exc_type(exc), "error": describe(exc)}
    send({"rpc": reply})


# ---- values: plain, or references to the candidate's objects ----------------------------


class Remote:
    """An object that lives in the candidate's process (a module, a function, an instance)."""
    __slots__ = ("_t", "_kind", "_name", "_gen")

    def __init__(self, target, kind, name):
        object.__setattr__(self, "_t", target)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_gen", None if "path" in target else STATE["gen"])

    def __getattr__(self, name):
        # `__all__` is what `from pkg.mod import *` asks for (the code lists the public names).
        if (name.startswith("__") and name.endswith("__")
                and name not in ("__name__", "__doc__", "__all__")):
            raise AttributeError(name)
        return getattr_op(target_of(self), name)

    def __setattr__(self, name, value):
        reply_value(rpc({"op": "setattr", "obj": target_of(self), "name": name,
                         "value": encode(value)}), "setattr")

    def __delattr__(self, name):
        apply_op("delattr", self, name)

    def __call__(self, *args, **kwargs):
        return call_op(target_of(self), args, kwargs)

    def __repr__(self):
        value = apply_op("repr", self)
        if type(value) is not str:
            raise TypeError("__repr__ returned non-string")
        return value

    def __str__(self):
        value = apply_op("str", self)
        if type(value) is not str:
            raise TypeError("__str__ returned non-string")
        return value

    def __format__(self, spec):
        value = apply_op("format", self, spec)
        if type(value) is not str:
            raise TypeError("__format__ returned non-string")
        return value

    def __bool__(self):
        return apply_op("bool", self) is True

    def __len__(self):
        value = apply_op("len", self)
        if type(value) is not int:
            raise TypeError("__len__ returned a non-integer")
        return value

    def __hash__(self):
        value = apply_op("hash", self)
        if type(value) is not int:
            raise TypeError("__hash__ returned a non-integer")
        return value

    def __iter__(self):
        return apply_op("iter", self)

    def __next__(self):
        return apply_op("next", self)

    def __reversed__(self):
        return apply_op("reversed", self)

    def __contains__(self, item):
        return apply_op("contains", self, item) is True

    def __getitem__(self, key):
        return apply_op("getitem", self, key)

    def __setitem__(self, key, value):
        apply_op("setitem", self, key, value)

    def __delitem__(self, key):
        apply_op("delitem", self, key)

    def __enter__(self):
        return apply_op("enter", self)

    def __exit__(self, *exc):
        # The code's clean-up runs, but it never learns of (or swallows) the test's exception:
        # an __exit__ returning True would hide a failed assert inside the `with` block.
        apply_op("exit", self, None, None, None)
        return False

    def __int__(self):
        value = apply_op("int", self)
        if type(value) is not int:
            raise TypeError("__int__ returned a non-integer")
        return value

    def __index__(self):
        value = apply_op("index", self)
        if type(value) is not int:
            raise TypeError("__index__ returned a non-integer")
        return value

    def __float__(self):
        value = apply_op("float", self)
        if type(value) is not float:
            raise TypeError("__float__ returned a non-float")
        return value

    def __round__(self, *nd):
        return not_plain("round", apply_op("round", self, *nd))

    def __abs__(self):
        return not_plain("abs", apply_op("abs", self))

    def __neg__(self):
        return not_plain("neg", apply_op("neg", self))

    def __pos__(self):
        return not_plain("pos", apply_op("pos", self))

    def __invert__(self):
        return not_plain("invert", apply_op("invert", self))

    # Comparisons: forwarded only between the code's own objects.
    def __eq__(self, other):
        return compare("eq", self, other)

    def __ne__(self, other):
        return compare("ne", self, other)

    def __lt__(self, other):
        return compare("lt", self, other)

    def __le__(self, other):
        return compare("le", self, other)

    def __gt__(self, other):
        return compare("gt", self, other)

    def __ge__(self, other):
        return compare("ge", self, other)


BUILTIN_NAMES = frozenset(vars(builtins))


def star_names(value):
    """The names `from pkg.mod import *` may bind in a test module, of those the code lists:
    public identifiers that neither look like tests (the judge runs the file's own `test*`
    functions, never the code's) nor shadow a built-in (`abs`, `len`) the tests rely on."""
    if type(value) not in (list, tuple):
        raise TypeError("__all__ must be a list of names")
    return [n for n in value
            if type(n) is str and n.isidentifier() and not n.startswith("_")
            and not n.lower().startswith("test") and n not in BUILTIN_NAMES]


def compare(fn, a, b):
    if not (is_remote(a) and is_remote(b)):
        return NotImplemented
    return apply_op(fn, a, b)


def not_plain(fn, value):
    """`value`, the code's answer to an operator on its own object with a plain operand (or a
    unary one), if it is again the code's object; a plain answer is refused: `f(x) - y` or
    `abs(f(x))` answering 0.0 would be the code's claim passing `abs(f(x) - y) < eps`."""
    if not is_remote(value):
        fail("the code's object answered the operator %s with a plain value; a test compares "
             "the code's results as plain values, not through operators on its objects" % fn)
    return value


def binary(fn):
    def forward(self, other):
        value = apply_op(fn, self, other)
        return value if is_remote(other) else not_plain(fn, value)

    def reflected(self, other):
        value = apply_op(fn, other, self)
        return value if is_remote(other) else not_plain(fn, value)
    return forward, reflected


# Arithmetic is the code's own behaviour: between two of its objects a result is plain or
# another Remote (which, again, is never equal to a plain value); with a plain operand only a
# Remote (see `not_plain`).
for _fn, _dunder in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "truediv"),
                     ("floordiv", "floordiv"), ("mod", "mod"), ("pow", "pow"),
                     ("matmul", "matmul"), ("and", "and"), ("or", "or"), ("xor", "xor"),
                     ("lshift", "lshift"), ("rshift", "rshift"), ("divmod", "divmod")):
    _forward, _reflected = binary(_fn)
    setattr(Remote, "__%s__" % _dunder, _forward)
    setattr(Remote, "__r%s__" % _dunder, _reflected)
for _fn in ("iadd", "isub", "imul"):
    setattr(Remote, "__%s__" % _fn, binary(_fn)[0])


class RemoteClass(type):
    """The metaclass of the local stand-ins for the repository's classes."""

    def __call__(cls, *args, **kwargs):
        return call_op(target_of(cls), args, kwargs)

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr_op(target_of(cls), name)

    def __instancecheck__(cls, obj):
        if is_remote(obj):
            return apply_op("isinstance", obj, cls) is True
        return type.__instancecheck__(cls, obj)

    def __repr__(cls):
        return "<repository class %s>" % type.__getattribute__(cls, "_name")


def is_remote(v):
    return (isinstance(v, Remote) or isinstance(type(v), RemoteClass)
            or isinstance(v, RemoteClass))


def target_of(v):
    """The target of a Remote, a repository class or a raised repository exception."""
    if isinstance(v, RemoteClass):
        t, gen = type.__getattribute__(v, "_t"), type.__getattribute__(v, "_gen")
    elif isinstance(v, Remote):
        t, gen = object.__getattribute__(v, "_t"), object.__getattribute__(v, "_gen")
    else:
        t, gen = v.__dict__.get("_remote"), v.__dict__.get("_gen")
        if t is None:
            raise TypeError("this exception was not raised by the repository's code")
    if gen is not None and gen not in (STATE["gen"], STATE["file_gen"]):
        fail("an object of the repository made in another test cannot be used here")
    return t


def class_of(desc):
    """The local class standing in for a repository class (one per class, so `except` and
    `isinstance` see the same class however it was reached)."""
    target = {"path": desc["path"]} if "path" in desc else {"h": desc.get("h")}
    key = desc.get("canon") or json.dumps(target, sort_keys=True) + str(STATE["gen"])
    cls = STATE["classes"].get(key)
    if cls is not None:
        return cls
    name = str(desc.get("name", "?")).rsplit(".", 1)[-1]
    bases = ()
    if type(desc.get("exc")) is list:
        # The code's claim: deduplicated and bounded (the leaves below are quadratic in it).
        names = list(dict.fromkeys(n for n in desc["exc"][:64] if type(n) is str))
        found = [getattr(builtins, n, None) for n in names]
        found = [k for k in found if isinstance(k, type) and issubclass(k, BaseException)]
        leaves = [k for k in found if not any(o is not k and issubclass(o, k) for o in found)]
        for candidate in (tuple(leaves), tuple(leaves[:1]), (Exception,)):
            try:
                type("probe", candidate, {})
                bases = candidate
                break
            except TypeError:
                continue
    ns = {"_t": target, "_gen": None if "path" in target or desc.get("canon") else STATE["gen"],
          "_name": str(desc.get("name", "?"))}
    if bases:
        ns["__str__"] = lambda self: self.__dict__.get("_text", "")
        ns["__getattr__"] = lambda self, name: (getattr_op(target_of(self), name)
                                                if not name.startswith("__")
                                                else object.__getattribute__(self, name))
    cls = RemoteClass(name, bases, ns)
    STATE["classes"][key] = cls
    return cls


def remote_of(desc):
    if type(desc) is not dict:
        raise ValueError("malformed reference from the code")
    if desc.get("kind") == "class":
        return class_of(desc)
    if "path" in desc and type(desc["path"]) is str:
        target = {"path": desc["path"]}
    elif type(desc.get("h")) is int:
        target = {"h": desc["h"]}
    else:
        raise ValueError("malformed reference from the code")
    return Remote(target, str(desc.get("kind")), str(desc.get("name")))


def tagged(tag, payload):
    if tag == "ref":
        return remote_of(payload)
    if tag == "cb" and type(payload) is int and 0 <= payload < len(STATE["callbacks"]):
        return STATE["callbacks"][payload]
    raise ValueError("malformed value from the code")


def decode(x):
    try:
        return dec(x, 0, tagged)
    except (ValueError, TypeError, KeyError, RecursionError, MemoryError) as exc:
        kill("the code sent a malformed value (%s)" % type(exc).__name__)


def other_value(v):
    """Encodes what is not a plain value: the code's own objects by reference, the test's
    callables as callbacks."""
    if is_remote(v) or (isinstance(v, BaseException) and "_remote" in v.__dict__):
        return ["ref", target_of(v)]
    if callable(v):
        STATE["callbacks"].append(v)
        return ["cb", len(STATE["callbacks"]) - 1]
    raise TypeError("a value of type %s cannot be passed to the repository's code"
                    % type(v).__name__)


def encode(v):
    return enc(v, 0, other_value)


CONTROL = (StopIteration, StopAsyncIteration, AttributeError, GeneratorExit)


def exception_of(reply, op):
    """The exception to raise here for a failed request. Exceptions that steer control flow
    (StopIteration, AttributeError) count only where they mean that: `next` and attribute
    reads; elsewhere they would let a test pass vacuously (`all(map(f, xs))`)."""
    message = reply.get("error")
    message = message[:2000] if type(message) is str else "the call failed"
    name = reply.get("type")
    builtin = getattr(builtins, name, None) if type(name) is str else None
    if not (isinstance(builtin, type) and issubclass(builtin, BaseException)):
        fail(message)
    allowed = {"next": (StopIteration,), "getattr": (AttributeError,)}.get(op, ())
    if not issubclass(builtin, Exception) or (issubclass(builtin, CONTROL)
                                               and not issubclass(builtin, allowed)):
        fail(message)
    try:
        args = [decode(a) for a in reply.get("args") or []]
    except CodeFailed:
        args = []
    desc = reply.get("cls")
    cls = None
    if type(desc) is list and len(desc) == 2 and desc[0] == "ref" and type(desc[1]) is dict:
        canon = desc[1].get("canon")
        if type(canon) is str and not canon.startswith("builtins."):
            cls = class_of(desc[1])
    if cls is None:
        try:
            return builtin(*args)
        except Exception:
            return builtin(message)
    # The class's bases are the code's claim: a `ValueError` that also derives from
    # StopIteration would end `all(map(f, xs))` early; the class raised here obeys the same
    # rule as the built-in named.
    if not issubclass(cls, Exception) or (issubclass(cls, CONTROL)
                                          and not issubclass(cls, allowed)):
        fail(message)
    exc = BaseException.__new__(cls)
    exc.args = tuple(args)
    exc.__dict__["_text"] = message.split(": ", 1)[-1] if ": " in message else message
    obj = reply.get("obj")
    if type(obj) is list and len(obj) == 2 and type(obj[1]) is dict and "h" in obj[1]:
        exc.__dict__["_remote"] = {"h": obj[1]["h"]}
        exc.__dict__["_gen"] = STATE["gen"]
    return exc


# ---- running the tests -------------------------------------------------------------------


def begin(key):
    """Starts a test: a fresh process of the code, in which the module level's requests are
    made again in the same order, so the objects the test module made at its top are there
    (under the same references) in every test's process, fresh each time."""
    STATE["gen"] += 1
    STATE["failure"] = None
    # Classes reached by handle belong to their test's process: drop those of earlier tests.
    STATE["classes"] = {k: c for k, c in STATE["classes"].items()
                        if type.__getattribute__(c, "_gen") in (None, STATE["file_gen"])}
    STATE["callbacks"] = list(STATE["module_callbacks"])
    send({"begin": key})
    for msg in STATE["module_log"]:
        try:
            rpc(json.loads(msg))
        except CodeFailed:
            return
        except BaseException:
            pass


def begin_file(key):
    STATE["module_log"] = []
    STATE["module_callbacks"] = []
    begin(key)
    STATE["file_gen"] = STATE["gen"]
    STATE["module_level"] = True


class StarImport:
    """What `from pkg.mod import *` gets: the module, whose `__all__` is the code's list less
    what `star_names` drops (test names, built-ins) and every name the test file binds itself
    (`import math`, a helper `close`, ...) or has bound already, so the code cannot swap the
    test's own tools for agreeable ones. The one place a star import's names are decided."""
    __slots__ = ("_module", "_bound")

    def __init__(self, module, bound):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_bound", frozenset(bound))

    def __getattr__(self, name):
        module = object.__getattribute__(self, "_module")
        if name == "__all__":
            bound = object.__getattribute__(self, "_bound")
            return [n for n in star_names(module.__all__) if n not in bound]
        return getattr(module, name)


def bound_names(tree):
    """Every name a test file binds at module level (imports, functions, classes, assignment,
    loop and `with` targets — also under `if`/`try`, not inside functions or classes), which a
    star import must leave alone."""
    names = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif not isinstance(node, ast.Lambda):
            pending.extend(ast.iter_child_nodes(node))
    return names


# CO_GENERATOR | CO_COROUTINE | CO_ITERABLE_COROUTINE | CO_ASYNC_GENERATOR
GENERATOR_FLAGS = 0x20 | 0x80 | 0x100 | 0x200


def test_names(file_name, source):
    """The file's tests: the `test*` functions its source defines at the top, in order (None
    when it does not parse: the file then fails as one)."""
    try:
        body = ast.parse(source, file_name).body
    except (SyntaxError, ValueError):
        return None
    names = []
    for node in body:
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name.startswith("test") and node.name not in names):
            names.append(node.name)
    return names


def main():
    spec = json.loads(IN.readline())
    repo_modules = set(spec["modules"])

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        top = name.split(".")[0]
        if level == 0 and top in repo_modules:
            path = name if fromlist else top
            module = Remote({"path": path}, "module", path)
            if fromlist and "*" in fromlist:
                # Into the test module: none of the names the file binds (also those bound
                # later); into any namespace: none already bound there.
                bound = set(globals or ())
                if globals is STATE["namespace"]:
                    bound |= STATE["file_names"]
                return StarImport(module, bound)
            return module
        return REAL_IMPORT(name, globals, locals, fromlist, level)

    test_builtins = dict(vars(builtins))
    test_builtins["__import__"] = guarded_import
    files = []
    for file_name, source in spec["files"]:
        module = os.path.splitext(os.path.basename(file_name))[0]
        names = test_names(file_name, source)
        files.append((file_name, source, module, names))
    # The parent counts these, before any of the code's answers can reach this process.
    send({"plan": [key for file_name, _, module, names in files
                   for key in ([file_name + "::<module>"] if names is None
                               else [module + "::" + n for n in names])]})
    for file_name, source, module, names in files:
        namespace = {"__name__": module, "__builtins__": test_builtins}
        STATE["namespace"] = namespace
        try:
            STATE["file_names"] = frozenset(bound_names(ast.parse(source, file_name)))
        except (SyntaxError, ValueError):
            STATE["file_names"] = frozenset()
        begin_file(module + "::<module>")
        try:
            if names is None:
                compile(source, file_name, "exec")
                raise SyntaxError("the test file does not parse")
            exec(compile(source, file_name, "exec"), namespace)
            header_error = STATE["failure"]
        except BaseException as exc:
            header_error = describe(exc)
        STATE["module_level"] = False
        STATE["module_callbacks"] = list(STATE["callbacks"])
        if names is None:
            send({"file": file_name, "error": header_error})
            continue
        for name in names:
            key = module + "::" + name
            if header_error is not None:
                send({"test": key, "status": "fail", "error": "the test module's top failed: "
                      + str(header_error)[:2000]})
                continue
            fn = namespace.get(name)
            if type(fn) is not types.FunctionType or fn.__code__.co_filename != file_name:
                send({"test": key, "status": "fail",
                      "error": "the test function was replaced (by an import?)"})
                continue
            if fn.__code__.co_flags & GENERATOR_FLAGS:
                # Calling it would run none of its body: it could only "pass".
                send({"test": key, "status": "fail",
                      "error": "a test that is a generator or a coroutine is never run"})
                continue
            begin(key)
            try:
                fn()
                verdict = {"test": key, "status": "pass"}
            except BaseException as exc:
                verdict = {"test": key, "status": "fail", "error": describe(exc)}
            if STATE["failure"] is not None:
                verdict = {"test": key, "status": "fail", "error": STATE["failure"]}
            send(verdict)
    send({"done": True})


main()
