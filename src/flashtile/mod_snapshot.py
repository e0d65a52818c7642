"""What a mod reads besides its arguments, and whether it still holds.

Tracing or compiling a mod bakes in the values it reads from outside:
numbers and strings become constants, captured arrays become tables whose
layout the generated code assumes (NumPy mods: whose contents Numba froze).
:func:`snapshot` lists checks that those values are unchanged, so that a
cached trace or compile is reused only while it is still the mod's.
"""

from __future__ import annotations

import functools
import types


def snapshot(functions, leaf) -> list | None:
    """Checks that the values ``functions`` capture are still what they were.

    Tracing or compiling a mod bakes in what it reads besides its arguments:
    closure cells and the globals its code names, looked into through the
    functions it holds (``and_masks``' closures). Returns one zero-argument
    check per value (True while unchanged: numbers and strings equal, functions
    and modules the same objects, other values as ``leaf(value)`` says: a
    check, or None when it cannot tell), or None when some value cannot be
    checked (the caller then does not reuse its work)."""
    checks: list = []
    seen: set[int] = set()

    def place(holder, name):
        if isinstance(holder, dict):
            return lambda: holder.get(name, _MISSING)
        return lambda: getattr(holder, "cell_contents", _MISSING)

    def names(code) -> set[str]:
        """The names ``code`` reads, nested code (lambdas, comprehensions) too."""
        found = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found |= names(const)
        return found

    def value_check(get, value, depth, read) -> bool:
        """Add the checks of one captured value; False when it cannot be checked."""
        if isinstance(value, int | float | complex | str | bytes | bool | None.__class__):
            checks.append(lambda: (lambda now: type(now) is type(value) and now == value)(get()))
        elif isinstance(value, types.FunctionType):
            checks.append(lambda: get() is value)
            return visit(value, depth + 1)
        elif isinstance(value, types.ModuleType):
            checks.append(lambda: get() is value)
            for name in read:  # the module's attributes the code may read
                attr = getattr(value, name, _MISSING)
                if attr is not _MISSING and not isinstance(attr, types.ModuleType):
                    fetch = functools.partial(getattr, value, name, _MISSING)
                    plain = isinstance(attr, int | float | complex | str | bytes | bool)
                    if plain:
                        checks.append(lambda f=fetch, a=attr: type(f()) is type(a) and f() == a)
                    else:
                        checks.append(lambda f=fetch, a=attr: f() is a)
        elif isinstance(value, types.BuiltinFunctionType | type):
            checks.append(lambda: get() is value)
        elif isinstance(value, tuple | frozenset):  # and_masks' closures hold their masks so
            checks.append(lambda: get() is value)
            for item in value:
                if not value_check(lambda item=item: item, item, depth, read):
                    return False
        else:
            check = leaf(value)
            if check is None:
                return False
            checks.append(lambda: check(get()))
        return True

    def visit(fn, depth) -> bool:
        fn = getattr(fn, "py_func", fn)  # a Numba dispatcher: its Python function
        code = getattr(fn, "__code__", None)
        if code is None or depth > 6 or id(fn) in seen:
            return code is not None
        seen.add(id(fn))
        read = names(code)
        cells = [(cell, None) for cell in getattr(fn, "__closure__", None) or ()]
        places = cells + [(fn.__globals__, n) for n in read if n in fn.__globals__]
        for holder, name in places:
            get = place(holder, name)
            value = get()
            if value is not _MISSING and not value_check(get, value, depth, read):
                return False
        return True

    for fn in functions:
        if fn is not None and not visit(fn, 0):
            return None
    return checks


_MISSING = object()
