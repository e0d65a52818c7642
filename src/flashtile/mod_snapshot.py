"""What a mod reads besides its arguments, and whether it still holds.

Tracing or compiling a mod bakes in the values it reads from outside:
numbers and strings become constants, captured arrays become tables whose
layout the generated code assumes (NumPy mods: whose contents Numba froze).
One walk over those values (:func:`captured`) serves two purposes:

- :func:`snapshot` lists checks that the values are unchanged, so that a
  cached trace or compile is reused only while it is still the mod's;
- :func:`fingerprint` describes them by structure (code, numbers, the
  layout of captured tensors, not their identity), so that the same mod
  defined again (a closure made on every step, a second process) finds the
  trace made before (:mod:`flashtile.torch.trace_cache`).
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import sys
import types

#: Values compared by equality (their value is baked into the trace).
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
#: Module attributes known by their names.
_NAMED = (types.FunctionType, types.BuiltinFunctionType, type)


def captured(functions):
    """Yield ``(get, value, kind, text)`` for every value ``functions`` read
    besides their arguments: closure cells, defaults (keyword-only too),
    attributes of the function itself, and the globals their code names,
    looked into through the user's functions, classes, modules and tuples
    they hold (``and_masks``' closures; a helper in the user's module and
    the globals it reads). Library code (the standard library, torch,
    NumPy, Numba, flashtile) is named, not walked: its versions key the
    caches that use this.

    ``get()`` reads the value's place again; ``kind`` is ``"equal"`` (a
    number or string: compare values), ``"same"`` (a function, module, type
    or tuple: compare identity), ``"attribute"`` (another attribute of a
    module or class: identity, or the caller's description), ``"leaf"``
    (anything else: the caller decides), ``"opaque"`` (no code to look into:
    nothing can be said) or ``"deep"`` (nested past the walk's depth: not
    looked into); ``text`` describes the place and, for the first two
    kinds, the value."""
    seen: set[int] = set()

    def names(code) -> set[str]:
        """The names ``code`` reads, nested code (lambdas, comprehensions) too."""
        found = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found |= names(const)
        return found

    def value(get, where, v, depth, read, member=False):
        if isinstance(v, _PLAIN):
            yield get, v, "equal", f"{where}={type(v).__name__}:{v!r}"
        elif isinstance(v, types.FunctionType) and not _library(v):
            yield get, v, "same", f"{where}=function {_code_digest(v)}"
            yield from visit(v, depth + 1, where)
        elif isinstance(v, types.ModuleType | type) and not _library(v):
            yield get, v, "same", f"{where}={_describe_object(v)}"
            yield from members(v, where, depth + 1, read)
        elif isinstance(v, types.ModuleType):
            yield get, v, "same", f"{where}=module {v.__name__}"
            yield from members(v, where, depth + 1, read, library=True)
        elif isinstance(v, _NAMED):
            yield get, v, "same", f"{where}={_describe_object(v)}"
        elif isinstance(v, tuple | frozenset):
            yield get, v, "same", f"{where}={type(v).__name__} of {len(v)}"
            for n, item in enumerate(v):
                yield from value(lambda item=item: item, f"{where}[{n}]", item, depth, read)
        else:  # (a module's or class's tensor, dtype: compared as the same object)
            yield get, v, "attribute" if member else "leaf", where

    def members(holder, where, depth, read, library=False):
        """The attributes of a module or class that the code may read."""
        if depth > _DEPTH:
            yield None, holder, "deep", where
            return
        for name in sorted(read):
            attr = getattr(holder, name, _MISSING)
            if attr is _MISSING or (library and isinstance(attr, types.ModuleType)):
                continue
            fetch = functools.partial(getattr, holder, name, _MISSING)
            yield from value(fetch, f"{where}.{name}", attr, depth, read, member=True)

    def visit(fn, depth, where="mod"):
        fn = getattr(fn, "py_func", fn)  # a Numba dispatcher: its Python function
        code = getattr(fn, "__code__", None)
        if code is None:
            yield None, fn, "opaque", where
            return
        if id(fn) in seen:
            return
        if depth > _DEPTH:
            yield None, fn, "deep", where
            return
        seen.add(id(fn))
        read = names(code)
        cells = [
            (functools.partial(getattr, cell, "cell_contents", _MISSING), f"{where}:cell{n}")
            for n, cell in enumerate(getattr(fn, "__closure__", None) or ())
        ]
        if getattr(fn, "__defaults__", None):  # (a tuple: replaced, never changed)
            cells.append((functools.partial(getattr, fn, "__defaults__"), f"{where}:defaults"))
        for name in sorted(getattr(fn, "__kwdefaults__", None) or ()):
            kw = functools.partial(_item, fn, "__kwdefaults__", name)
            cells.append((kw, f"{where}:kw {name}"))
        for name in sorted(read & vars(fn).keys()):  # (fn.scale read as mod.scale)
            cells.append((functools.partial(_item, fn, "__dict__", name), f"{where}.{name}"))
        for name in sorted(read & getattr(fn, "__globals__", {}).keys()):
            cells.append((functools.partial(fn.__globals__.get, name, _MISSING), f"{where}:{name}"))
        for get, at in cells:
            v = get()
            if v is not _MISSING:  # (an empty cell; a name the code reads as an attribute only)
                yield from value(get, at, v, depth, read)

    for n, fn in enumerate(functions):
        if fn is not None:
            yield from visit(fn, 0, f"mod{n}")


#: How deep the walk looks into functions, modules and classes.
_DEPTH = 6
#: Packages whose code is named, not walked (besides the standard library).
_LIBRARIES = frozenset({"torch", "numpy", "numba", "llvmlite", "flashtile", "triton", "scipy"})


def _library(v) -> bool:
    """Whether ``v`` (a function, module or class) is library code."""
    name = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
    root = (name or "builtins").split(".")[0]
    return root in _LIBRARIES or root in sys.stdlib_module_names


def _item(holder, attribute: str, name: str):
    """``getattr(holder, attribute)[name]``, or :data:`_MISSING`."""
    return (getattr(holder, attribute, None) or {}).get(name, _MISSING)


def snapshot(functions, leaf) -> list | None:
    """Checks that the values ``functions`` capture are still what they were.

    Returns one zero-argument check per value (True while unchanged: numbers
    and strings equal, functions, modules and types the same objects, other
    values as ``leaf(value)`` says: a check, or None when it cannot tell), or
    None when some value cannot be checked (the caller then does not reuse
    its work)."""
    checks: list = []
    for get, v, kind, _ in captured(functions):
        if kind == "opaque":
            return None
        if kind == "deep":
            continue
        if kind == "equal":
            checks.append(functools.partial(_equal, get, v))
        elif kind in ("same", "attribute"):
            checks.append(lambda get=get, v=v: get() is v)
        else:
            check = leaf(v)
            if check is None:
                return None
            checks.append(lambda get=get, check=check: check(get()))
    return checks


def fingerprint(functions, describe) -> tuple[str, list] | None:
    """``(digest, leaves)``: a digest of what ``functions`` are and capture,
    by structure, and the leaf values in the order the digest lists them
    (``describe(value)`` writes a leaf, a tensor by its layout; None when it
    cannot, and then the result is None). Two mods with the same digest
    trace to the same graph, their leaves taking each other's places. Only
    plain functions qualify (a bound method's object is not looked into)."""
    if any(f is not None and type(f) is not types.FunctionType for f in functions):
        return None
    parts = [f"mod{n}={'none' if f is None else _code_digest(f)}" for n, f in enumerate(functions)]
    leaves: list = []
    for _, v, kind, text in captured(functions):
        if kind in ("opaque", "deep"):
            return None
        if kind in ("leaf", "attribute"):
            described = describe(v)
            if described is None:
                return None
            # (the same tensor in two places is one table of the trace)
            same = next((n for n, leaf in enumerate(leaves) if leaf is v), None)
            text = f"{text}=leaf {len(leaves)} {described} same as {same}"
            leaves.append(v)
        parts.append(text)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest(), leaves


def _equal(get, value) -> bool:
    now = get()
    return type(now) is type(value) and now == value


def _code_digest(fn) -> str:
    """A digest of a function's code (its constants and nested code too)."""
    # (version 2: no references, whose use depends on reference counts)
    return hashlib.sha256(marshal.dumps(fn.__code__, 2)).hexdigest()[:20]


def _describe_object(v) -> str:
    """A module, type or builtin by its name (a Python function also by its
    code's digest)."""
    if isinstance(v, types.ModuleType):
        return f"module {v.__name__}"
    name = f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', type(v).__qualname__)}"
    return f"{name} {_code_digest(v)}" if isinstance(v, types.FunctionType) else name


_MISSING = object()
