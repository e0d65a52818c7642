"""Instrumented arrays that notice when a solution stops streaming.

A streaming solution looks at ``block_size`` entries of a score row (or
``block_size`` rows of K and V) at a time. :class:`Tracked` is an ndarray
subclass that carries a :class:`Probe`; every NumPy operation that sees a
tracked operand reports how many elements it touched, and the probe records
an operation that touched more than one block's worth.

Two modes:

- ``"reductions"`` (the score row ``x`` of ``online_softmax``): only
  reductions, sorts and contractions count (NumPy's, the array methods,
  and Python's ``max``/``min``/``sum``/``sorted``, see
  :func:`instrumented_builtins`), because the final
  normalisation ``exp(x - m) / ell`` is elementwise over the whole row by
  design. Elementwise results stay tracked, so ``e = np.exp(x); e.sum()`` is
  caught too.
- ``"everything"`` (K and V of the attention exercises): any ufunc on more
  than ``block_size`` keys means the full score matrix was formed.

:func:`keep_tracked` makes ``np.asarray``/``np.array`` keep the subclass for
tracked inputs, so the usual ``x = np.asarray(x)`` at the top of a solution
does not strip the instrumentation (it changes nothing for other inputs).
"""

from __future__ import annotations

import numpy as np

#: Functions reached through ``__array_function__`` that read a whole operand.
_WHOLE_READS = frozenset(
    {
        "amax",
        "amin",
        "argmax",
        "argmin",
        "argpartition",
        "argsort",
        "cumprod",
        "cumsum",
        "dot",
        "einsum",
        "inner",
        "max",
        "mean",
        "median",
        "min",
        "nanargmax",
        "nanmax",
        "nanmin",
        "nansum",
        "outer",
        "partition",
        "percentile",
        "prod",
        "ptp",
        "quantile",
        "sort",
        "sum",
        "tensordot",
        "vdot",
    }
)

_REDUCING_METHODS = ("reduce", "accumulate", "reduceat")

#: Functions whose result takes only the shape and dtype of a tracked input.
_FRESH_BUFFERS = frozenset({"empty_like", "full_like", "ones_like", "zeros_like"})


class Probe:
    """What one instrumented input allows and what the solution did with it."""

    def __init__(self, label: str, block_size: int, row_len: int, mode: str, unit: str):
        self.label = label
        self.block_size = block_size
        self.row_len = max(row_len, 1)
        self.mode = mode
        self.unit = unit
        self.violations: list[str] = []

    @property
    def budget(self) -> int:
        """Most elements one operation may touch: one block."""
        return self.block_size * self.row_len

    def note(self, what: str, size: int) -> None:
        """Record ``what`` if it touched more than one block (first few only)."""
        if size > self.budget and len(self.violations) < 3:
            count = size // self.row_len
            self.violations.append(
                f"{what} read {count} {self.unit} of {self.label} at once, "
                f"but block_size is {self.block_size}"
            )


def track(array: np.ndarray, probe: Probe) -> Tracked:
    """A tracked view of ``array`` that reports to ``probe``."""
    view = np.asarray(array).view(Tracked)
    view._probe = probe
    return view


def plain(x):
    """``x`` without instrumentation (tuples and lists element by element)."""
    if isinstance(x, Tracked):
        return x.view(np.ndarray)
    if isinstance(x, tuple | list):
        return type(x)(plain(item) for item in x)
    return x


def _probes(items) -> list[tuple[Probe, int]]:
    """``(probe, size)`` for every tracked operand in ``items`` (one level of lists)."""
    found = []
    for item in items:
        if isinstance(item, Tracked) and item._probe is not None:
            found.append((item._probe, item.size))
        elif isinstance(item, tuple | list):
            found.extend(_probes(item))
    return found


class Tracked(np.ndarray):
    """An ndarray that reports to its :class:`Probe` what touches it."""

    _probe: Probe | None = None

    def __array_finalize__(self, obj):
        # Slices, views and astype copies inherit the probe of their source.
        self._probe = getattr(obj, "_probe", None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        found = _probes(inputs)
        name = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
        for probe, size in found:
            if method in _REDUCING_METHODS or ufunc is np.matmul or probe.mode == "everything":
                probe.note(name, size)
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = plain(tuple(out))
        result = getattr(ufunc, method)(*plain(list(inputs)), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        # Elementwise results of a row stay tracked (reductions mode only), so a
        # later whole-row sum of exp(x - c) is still seen.
        keep = [p for p, _ in found if p.mode == "reductions"]
        if method == "__call__" and keep:
            if isinstance(result, tuple):
                return tuple(_rewrap(r, keep[0]) for r in result)
            return _rewrap(result, keep[0])
        return result

    def __array_function__(self, func, types, args, kwargs):
        name = getattr(func, "__name__", "")
        if name in _WHOLE_READS:
            for probe, size in _probes(list(args) + list(kwargs.values())):
                probe.note(f"np.{name}", size)
        result = super().__array_function__(func, types, args, kwargs)
        # zeros_like(v) of K or V is an output buffer holding nothing read from
        # them: not part of their stream. (A score row's copies stay tracked,
        # so a buffer filled from x and reduced whole is still caught.)
        found = _probes(list(args))
        if name in _FRESH_BUFFERS and found and all(p.mode == "everything" for p, _ in found):
            return plain(result)
        return result

    # Methods implemented in C that never reach the ufunc machinery.
    def _whole(self, name: str) -> None:
        if self._probe is not None:
            self._probe.note(f".{name}()", self.size)

    def argmax(self, *args, **kwargs):
        self._whole("argmax")
        return self.view(np.ndarray).argmax(*args, **kwargs)

    def argmin(self, *args, **kwargs):
        self._whole("argmin")
        return self.view(np.ndarray).argmin(*args, **kwargs)

    def sort(self, *args, **kwargs):
        self._whole("sort")
        return self.view(np.ndarray).sort(*args, **kwargs)

    def argsort(self, *args, **kwargs):
        self._whole("argsort")
        return self.view(np.ndarray).argsort(*args, **kwargs)

    def cumsum(self, *args, **kwargs):
        self._whole("cumsum")
        return self.view(np.ndarray).cumsum(*args, **kwargs)

    def dot(self, *args, **kwargs):
        self._whole("dot")
        return self.view(np.ndarray).dot(*plain(list(args)), **kwargs)

    def tolist(self):
        self._whole("tolist")
        return self.view(np.ndarray).tolist()


def instrumented_builtins() -> dict:
    """``max``, ``min``, ``sum`` and ``sorted`` that report a whole tracked
    array, for the learner's module namespace: Python's built-ins walk an
    array element by element and never reach NumPy's hooks."""
    import builtins

    def wrap(name):
        original = getattr(builtins, name)

        def reporting(*args, **kwargs):
            for probe, size in _probes(list(args)):
                probe.note(f"{name}()", size)
            return original(*args, **kwargs)

        reporting.__name__ = name
        return reporting

    return {name: wrap(name) for name in ("max", "min", "sum", "sorted")}


def _rewrap(result, probe: Probe):
    if isinstance(result, np.ndarray) and result.ndim > 0:
        return track(result, probe)
    return result


_ORIGINAL = {"asarray": np.asarray, "array": np.array, "ascontiguousarray": np.ascontiguousarray}


def _asarray(a, dtype=None, *args, **kwargs):
    if isinstance(a, Tracked):
        return np.asanyarray(a, dtype=dtype, *args, **kwargs)  # noqa: B026
    return _ORIGINAL["asarray"](a, dtype, *args, **kwargs)


def _array(a, dtype=None, *args, **kwargs):
    if isinstance(a, Tracked):
        kwargs["subok"] = True
    return _ORIGINAL["array"](a, dtype, *args, **kwargs)


def _ascontiguousarray(a, dtype=None, **kwargs):
    if isinstance(a, Tracked):
        return np.require(a, dtype=dtype, requirements="C")
    return _ORIGINAL["ascontiguousarray"](a, dtype, **kwargs)


def keep_tracked() -> None:
    """Let ``np.asarray``/``np.array`` keep :class:`Tracked` inputs (grader process only).

    The grader runs in its own process, so patching the numpy module there
    touches nothing else; behaviour for every other input is unchanged.
    """
    np.asarray = _asarray
    np.array = _array
    np.ascontiguousarray = _ascontiguousarray
