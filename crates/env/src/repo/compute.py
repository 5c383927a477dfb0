# composer-env repository compute harness: one process per hidden test, next to the
# candidate's code (untrusted once that code is imported: it only computes). The judge's
# requests arrive one JSON line each on stdin; every message back goes on fd 3, one line each.
#
# Requests {"id", "op", ...} name their target as {"path": "pkg.mod.name"} (resolved here by
# import) or {"h": n} (the n-th object this process handed out):
#   getattr {obj, name} | setattr {obj, name, value} | call {obj, args, kwargs}
#   apply {fn, args}    (a built-in or operator function from APPLY)
# Replies {"re": id, "ok": true, "value", "after"} or {"re": id, "ok": false, "type", "error",
# "args", "cls", "obj"}. A value is plain (exact built-in types) or a reference
# ["ref", {"h"|"path", "kind", ...}] to an object that stays here; a ["cb", n] argument is a
# callable of the judge's, called back through the parent ({"id", "op": "callback", "cb",
# "args", "kwargs"} out, its reply in), serving the judge's nested requests meanwhile.
# Whatever this process writes is at most a claim about what the code did: the judge never
# compares a reference with a plain value, and the expected values never come here.
# (Follows composer-sandbox's plain_values.py prelude: enc, dec, send, describe, failed_reply.)
import importlib
import operator
import types

OUT = 3
os.dup2(2, 1)
sys.path.insert(0, os.getcwd())
IN = sys.stdin.buffer

HANDLES = []
HANDLE_OF = {}
NEXT_ID = [0]

APPLY = {
    "len": len, "str": str, "repr": repr, "bool": bool, "hash": hash, "iter": iter,
    "next": next, "int": int, "float": float, "index": operator.index, "abs": abs,
    "neg": operator.neg, "pos": operator.pos, "invert": operator.invert, "round": round,
    "getitem": operator.getitem, "setitem": operator.setitem, "delitem": operator.delitem,
    "contains": operator.contains, "eq": operator.eq, "ne": operator.ne, "lt": operator.lt,
    "le": operator.le, "gt": operator.gt, "ge": operator.ge, "add": operator.add,
    "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": pow, "divmod": divmod,
    "matmul": operator.matmul, "and": operator.and_, "or": operator.or_,
    "xor": operator.xor, "lshift": operator.lshift, "rshift": operator.rshift,
    "iadd": operator.iadd, "isub": operator.isub, "imul": operator.imul,
    "isinstance": isinstance, "format": format, "reversed": reversed, "delattr": delattr,
    "enter": lambda o: o.__enter__(), "exit": lambda o, *a: o.__exit__(*a),
}


class Broken(BaseException):
    """The judge's side broke the protocol or went away: stop at once."""


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


def builtin_exceptions(cls):
    """The built-in exception classes `cls` derives from, most derived first."""
    return [k.__name__ for k in cls.__mro__
            if getattr(builtins, k.__name__, None) is k and issubclass(k, BaseException)]


def canonical(obj):
    """`module.qualname` when that path leads back to `obj` (so the judge can tell classes
    apart by it), else None."""
    try:
        name = "%s.%s" % (obj.__module__, obj.__qualname__)
        return name if resolve(name) is obj else None
    except BaseException:
        return None


def handle(obj):
    key = id(obj)
    n = HANDLE_OF.get(key)
    if n is None or HANDLES[n] is not obj:
        n = len(HANDLES)
        HANDLES.append(obj)
        HANDLE_OF[key] = n
    return n


def reference(obj, path=None):
    """The tagged reference to a non-plain object; `path` when it was reached by one."""
    if isinstance(obj, types.ModuleType):
        desc = {"kind": "module", "name": obj.__name__, "path": path or obj.__name__}
    elif isinstance(obj, type):
        desc = {"kind": "class", "name": obj.__qualname__, "canon": canonical(obj)}
        if issubclass(obj, BaseException):
            desc["exc"] = builtin_exceptions(obj)
    elif callable(obj):
        desc = {"kind": "callable", "name": getattr(obj, "__qualname__", type(obj).__name__)}
    else:
        desc = {"kind": "object", "name": type(obj).__qualname__}
    if "path" not in desc:
        if path is not None:
            desc["path"] = path
        else:
            desc["h"] = handle(obj)
    return ["ref", desc]


def encode(value, path=None):
    if path is not None:
        try:
            return enc(value)
        except TypeError:
            return reference(value, path)
    return enc(value, 0, reference)


class Callback:
    """A callable of the judge's: each call goes back to the judge."""
    __slots__ = ("n",)

    def __init__(self, n):
        self.n = n

    def __call__(self, *args, **kwargs):
        NEXT_ID[0] += 1
        rid = NEXT_ID[0]
        send({"id": rid, "op": "callback", "cb": self.n,
              "args": [encode(a) for a in args],
              "kwargs": [[k, encode(v)] for k, v in kwargs.items()]})
        reply = wait(rid)
        if reply.get("ok") is True:
            return decode(reply.get("value"))
        name = reply.get("type")
        cls = getattr(builtins, name, None) if type(name) is str else None
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = RuntimeError
        raise cls(str(reply.get("error"))[:2000])


def tagged(tag, payload):
    if tag == "ref" and type(payload) is dict:
        return target(payload)
    if tag == "cb" and type(payload) is int:
        return Callback(payload)
    raise ValueError("malformed value from the judge")


def decode(x):
    return dec(x, 0, tagged)


def target(t):
    if type(t) is not dict:
        raise ValueError("malformed target")
    n = t.get("h")
    if type(n) is int and 0 <= n < len(HANDLES):
        return HANDLES[n]
    path = t.get("path")
    if type(path) is str:
        return resolve(path)
    raise ValueError("no such object")


def get_attribute(obj, name):
    if name == "__all__" and isinstance(obj, types.ModuleType) and not hasattr(obj, name):
        # What `from module import *` takes when the module does not say.
        return sorted(n for n in vars(obj) if not n.startswith("_"))
    try:
        return getattr(obj, name)
    except AttributeError:
        if isinstance(obj, types.ModuleType):
            # A submodule its package does not import itself.
            try:
                return importlib.import_module(obj.__name__ + "." + name)
            except ModuleNotFoundError:
                pass
        raise


def serve(req):
    rid = req.get("id")
    try:
        op = req.get("op")
        if op == "getattr":
            t = req.get("obj")
            name = req.get("name")
            if type(name) is not str:
                raise ValueError("malformed request")
            value = get_attribute(target(t), name)
            path = t.get("path") if type(t) is dict else None
            reply = {"re": rid, "ok": True,
                     "value": encode(value, path + "." + name if type(path) is str else None)}
        elif op == "setattr":
            setattr(target(req.get("obj")), str(req.get("name")), decode(req.get("value")))
            reply = {"re": rid, "ok": True, "value": None}
        elif op == "call":
            fn = target(req.get("obj"))
            args = [decode(a) for a in req.get("args", [])]
            kwargs = {str(k): decode(v) for k, v in req.get("kwargs", [])}
            value = encode(fn(*args, **kwargs))
            after = []
            for a in args:
                # In-place changes to plain containers the judge passed, sent back.
                try:
                    after.append(encode(a) if type(a) in (list, dict, set) else None)
                except BaseException:
                    after.append(None)
            reply = {"re": rid, "ok": True, "value": value, "after": after}
        elif op == "apply":
            fn = APPLY[req.get("fn")]
            args = [decode(a) for a in req.get("args", [])]
            reply = {"re": rid, "ok": True, "value": encode(fn(*args))}
        else:
            raise ValueError("unknown request")
    except Broken:
        raise
    except BaseException as exc:
        reply = failed_reply(rid, exc)
        reply["re"] = reply.pop("id")
        try:
            reply["args"] = [encode(a) for a in exc.args][:8]
        except BaseException:
            pass
        try:
            reply["cls"] = reference(type(exc))
            reply["obj"] = reference(exc)
        except BaseException:
            pass
    send(reply)


def wait(rid):
    """Reads messages until the reply to our request `rid`, serving requests meanwhile."""
    while True:
        line = IN.readline()
        if not line:
            raise Broken()
        try:
            msg = json.loads(line)
        except ValueError:
            raise Broken()
        if type(msg) is not dict:
            raise Broken()
        if rid is not None and msg.get("re") == rid:
            return msg
        if "op" in msg:
            serve(msg)
        else:
            raise Broken()


try:
    wait(None)
except Broken:
    os._exit(0)
