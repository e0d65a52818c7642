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

import enum
import functools
import hashlib
import marshal
import os
import sys
import sysconfig
import types

#: Values compared by equality (their value is baked into the trace).
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
#: Module attributes known by their names.
_NAMED = (types.FunctionType, types.BuiltinFunctionType, type)


def captured(functions):
    """Yield ``(get, value, kind, text)`` for every value ``functions`` read
    besides their arguments: closure cells, defaults (keyword-only too),
    attributes of the function itself, and the globals their code names,
    looked into through the functions, classes, modules and tuples they
    hold (``and_masks``' closures and the masks in them; a helper in the
    user's module and the globals it reads). Library code (the standard
    library, torch, NumPy, Numba, flashtile) is named and its closures
    walked, but not its globals: its versions key the caches that use this.

    ``get()`` reads the value's place again; ``kind`` is ``"equal"`` (a
    number or string: compare values), ``"same"`` (a function, module, type
    or tuple: compare identity), ``"attribute"`` (another attribute of a
    module or class: identity, or the caller's description), ``"leaf"``
    (anything else: the caller decides), ``"opaque"`` (no code to look into:
    nothing can be said) or ``"deep"`` (nested past the walk's depth: not
    looked into); ``text`` describes the place and, for the first two
    kinds, the value."""
    walk = _Walk()
    for n, fn in enumerate(functions):
        if fn is not None:
            yield from walk.visit(fn, 0, f"mod{n}")


class _Walk:
    """:func:`captured`'s walk; ``seen`` holds what it has looked into."""

    def __init__(self):
        self.seen: set = set()

    @staticmethod
    def names(code) -> set[str]:
        """The names ``code`` reads, nested code (lambdas, comprehensions) too."""
        found = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found |= _Walk.names(const)
        return found

    def value(self, get, where, v, depth, read, member=False):
        if isinstance(v, (*_PLAIN, enum.Enum)):
            yield get, v, "equal", f"{where}={type(v).__name__}:{v!r}"
        elif isinstance(v, types.FunctionType):
            library = _library(v)  # (its closure is still walked: and_masks' masks)
            yield get, v, "same", f"{where}={_describe_object(v)}"
            yield from self.visit(v, depth + 1, where, library)
        elif isinstance(v, types.ModuleType | type):
            library = _library(v)
            yield get, v, "same", f"{where}={_describe_object(v)}"
            yield from self.members(v, where, depth + 1, read, library)
        elif isinstance(v, _NAMED):
            yield get, v, "same", f"{where}={_describe_object(v)}"
        elif isinstance(v, tuple | frozenset):
            yield get, v, "same", f"{where}={type(v).__name__} of {len(v)}"
            for n, item in enumerate(v):
                yield from self.value(lambda item=item: item, f"{where}[{n}]", item, depth, read)
        else:  # (a library's dtype: the same object; a user's object: the caller decides)
            yield get, v, "attribute" if member == "library" else "leaf", where

    def members(self, holder, where, depth, read, library):
        """The attributes of a module or class that the code may read."""
        if (id(holder), library) in self.seen:  # (modules that import each other)
            return
        self.seen.add((id(holder), library))
        if depth > _DEPTH:
            yield None, holder, "deep", where
            return
        for name in sorted(read):
            fetch = functools.partial(_attribute, holder, name)
            attr = fetch()
            if attr is _RAISED:  # (a metaclass's __getattr__ or property that raised)
                yield None, holder, "opaque", f"{where}.{name}"
                return
            if attr is _MISSING or (library and isinstance(attr, types.ModuleType)):
                continue
            if isinstance(attr, types.MethodType):  # (a classmethod: a new bound method each time)
                fetch = functools.partial(_function_of, fetch)
                attr = fetch()
            kind = "library" if library else True
            yield from self.value(fetch, f"{where}.{name}", attr, depth, read, member=kind)

    def visit(self, fn, depth, where, library=False):
        """A function's cells, defaults and attributes, and (for the user's
        code) the globals it reads."""
        fn = getattr(fn, "py_func", fn)  # a Numba dispatcher: its Python function
        code = getattr(fn, "__code__", None)
        if code is None:
            yield None, fn, "opaque", where
            return
        if id(fn) in self.seen:
            return
        if depth > _DEPTH:
            yield None, fn, "deep", where
            return
        self.seen.add(id(fn))
        read = self.names(code)
        for get, at in _places(fn, read, where, library):
            v = get()
            if v is not _MISSING:  # (an empty cell; a name the code reads as an attribute only)
                yield from self.value(get, at, v, depth, read)


def _places(fn, read, where, library) -> list:
    """``(get, where)`` of what ``fn`` reads: closure cells, defaults, its
    own attributes, and (unless ``library``) its globals."""
    places = [
        (functools.partial(getattr, cell, "cell_contents", _MISSING), f"{where}:cell{n}")
        for n, cell in enumerate(getattr(fn, "__closure__", None) or ())
    ]
    if getattr(fn, "__defaults__", None):  # (a tuple: replaced, never changed)
        places.append((functools.partial(getattr, fn, "__defaults__"), f"{where}:defaults"))
    for name in sorted(getattr(fn, "__kwdefaults__", None) or ()):
        places.append((functools.partial(_item, fn, "__kwdefaults__", name), f"{where}:kw {name}"))
    for name in sorted(read & vars(fn).keys()):  # (fn.scale read as mod.scale)
        places.append((functools.partial(_item, fn, "__dict__", name), f"{where}.{name}"))
    for name in [] if library else sorted(read & getattr(fn, "__globals__", {}).keys()):
        places.append((functools.partial(fn.__globals__.get, name, _MISSING), f"{where}:{name}"))
    return places


#: How deep the walk looks into functions, modules and classes.
_DEPTH = 6
#: Packages whose code is named, not walked (besides the standard library).
_LIBRARIES = frozenset({"torch", "numpy", "numba", "llvmlite", "flashtile", "triton", "scipy"})


def _library(v) -> bool:
    """Whether ``v`` (a function, module or class) is library code: from
    :data:`_LIBRARIES`, or the standard library's own files (a user's module
    that shares a standard name is the user's; code without a module is)."""
    name = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
    if not isinstance(name, str) or not name:
        return False
    root = name.split(".")[0]
    if root in _LIBRARIES:
        return True
    if root not in sys.stdlib_module_names:
        return False
    if isinstance(v, types.FunctionType):  # (its own file: a user's module may be "signal")
        file = v.__code__.co_filename
    else:
        file = getattr(
            v if isinstance(v, types.ModuleType) else sys.modules.get(name), "__file__", None
        )
    return file is None or os.path.realpath(file).startswith(_STDLIB)


_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"])


def _attribute(holder, name: str):
    """``getattr(holder, name)``: :data:`_MISSING` when absent, :data:`_RAISED`
    when looking it up raised something else."""
    try:
        return getattr(holder, name, _MISSING)
    except Exception:
        return _RAISED


def _function_of(fetch):
    """The function of the bound method ``fetch()`` gives (a classmethod)."""
    method = fetch()
    return getattr(method, "__func__", method)


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
        if kind in ("opaque", "deep"):  # (nothing to check by, or too deep to look)
            return None
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
_RAISED = object()
