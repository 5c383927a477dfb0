# composer-sandbox plain values: the one encoding of values between a trusted judge and the
# untrusted process that runs candidate code, shared by both graders (function tasks:
# compute.py/judge.py here; repository tasks: composer-env's repo/compute.py and repo/judge.py).
# Each harness is this prelude followed by its own code, which sets OUT (the descriptor `send`
# writes to) before its first send.
#
# Exact built-in types only (`type(v) is int`, never isinstance): no subclass and no object
# with a custom __eq__ is ever encoded, and decoding builds fresh built-ins, so whatever a
# candidate sends is at most a claim about a plain value.
import builtins
import json
import os
import sys

if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)

MAX_DEPTH = 200
PLAIN_TAGS = ("bytes", "float", "list", "tuple", "set", "frozenset", "dict")
PLAIN_TYPES = "None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset"


def send(obj):
    data = (json.dumps(obj) + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(OUT, data):]


def enc(v, depth=0, other=None):
    """The tagged encoding of `v`. A value of any other type goes to `other` (which returns
    its own tagged encoding or raises); without `other` it is an error."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        # JSON has no NaN/inf: those travel tagged.
        return v if v == v and v not in (float("inf"), float("-inf")) else ["float", repr(v)]
    if t is list or t is tuple:
        return [t.__name__, [enc(x, depth + 1, other) for x in v]]
    if t is set or t is frozenset:
        # Sorted, so the same set always encodes the same (the repository judge compares
        # requests by their encoding).
        items = [enc(x, depth + 1, other) for x in v]
        items.sort(key=lambda i: json.dumps(i, sort_keys=True))
        return [t.__name__, items]
    if t is dict:
        return ["dict", [[enc(k, depth + 1, other), enc(x, depth + 1, other)] for k, x in v.items()]]
    if t is bytes:
        return ["bytes", v.hex()]
    if other is not None:
        return other(v)
    raise TypeError("a value of type %s is not a plain built-in value (%s)"
                    % (t.__name__, PLAIN_TYPES))


def dec(x, depth=0, tagged=None):
    """Fresh built-in objects from a tagged encoding. A tag that is not a plain type goes to
    `tagged(tag, payload)` when given (else it is an error)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if t is list and len(x) == 2 and type(x[0]) is str:
        tag, items = x
        if tag == "bytes" and type(items) is str:
            return bytes.fromhex(items)
        if tag == "float" and items in ("nan", "inf", "-inf"):
            return float(items)
        if type(items) is list:
            if tag == "list":
                return [dec(i, depth + 1, tagged) for i in items]
            if tag == "tuple":
                return tuple(dec(i, depth + 1, tagged) for i in items)
            if tag == "set":
                return {dec(i, depth + 1, tagged) for i in items}
            if tag == "frozenset":
                return frozenset(dec(i, depth + 1, tagged) for i in items)
            if tag == "dict":
                out = {}
                for pair in items:
                    if type(pair) is not list or len(pair) != 2:
                        raise ValueError("malformed dict entry")
                    out[dec(pair[0], depth + 1, tagged)] = dec(pair[1], depth + 1, tagged)
                return out
        if tagged is not None and tag not in PLAIN_TAGS:
            return tagged(tag, items)
    raise ValueError("malformed value from the code")


def exc_type(exc):
    """The name of the nearest built-in class of `exc` (what the judge may re-raise)."""
    for k in type(exc).__mro__:
        if getattr(builtins, k.__name__, None) is k:
            return k.__name__
    return "Exception"


def describe(exc):
    import traceback
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[-2000:]


def failed_reply(rid, exc):
    """The answer for a call that raised: the built-in type, the message, plain args."""
    try:
        exc_args = [enc(a) for a in exc.args][:8]
    except BaseException:
        exc_args = None
    try:
        return {"id": rid, "ok": False, "type": exc_type(exc), "error": describe(exc),
                "args": exc_args}
    except BaseException:
        return {"id": rid, "ok": False, "type": "", "error": "unprintable error"}


class CodeCallFailed(Exception):
    pass


def answer(reply):
    """Judge side: the decoded value of an answer, or its exception raised again. Only a
    built-in Exception class is re-raised (from plain args), and not those with control-flow
    meaning: a StopIteration would end `all(map(f, xs))` early (vacuously true), an
    AttributeError would make `hasattr` False. Anything else is a CodeCallFailed."""
    if type(reply) is not dict:
        raise CodeCallFailed("no answer from the code")
    if reply.get("ok") is True:
        return dec(reply.get("value"))
    message = reply.get("error")
    message = message[:2000] if type(message) is str else "the call failed"
    name = reply.get("type")
    cls = getattr(builtins, name, None) if type(name) is str else None
    if (isinstance(cls, type) and issubclass(cls, Exception)
            and not issubclass(cls, (StopIteration, StopAsyncIteration, AttributeError))):
        exc_args = reply.get("args")
        try:
            exc = cls(*[dec(a) for a in exc_args]) if type(exc_args) is list else cls(message)
        except Exception:
            exc = None
        if exc is not None:
            raise exc
    raise CodeCallFailed(message)
