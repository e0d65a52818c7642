"""A user's own mods written in Python for the NumPy API, compiled by Numba.

``flashtile.attention(..., score_mod=, mask_mod=)`` takes plain Python
functions on scalars (``math``, NumPy scalar functions, NumPy arrays read by
index): :func:`numpy_mods` compiles them as they are into the row functions
of :mod:`flashtile.mods`. They run the forward only (no derivative: torch
mods, :mod:`flashtile.torch.flex_trace`, have one).
"""

from __future__ import annotations

import numpy as np

from .mod_snapshot import snapshot
from .mods import Mods, module_source

#: Scalar functions around a user's NumPy mods (``_user_score``/``_user_mask``).
_NUMPY_SCALARS = {
    "score": "@njit(inline='always', error_model='numpy')\ndef _score(x, b, h, qi, kv, F, I):\n"
    "    try:\n"
    "        return WORK(_user_score(x, b, h, qi, kv)), False\n"
    "    except Exception:  # an index out of range (bounds checked)\n"
    "        return WORK(0.0), True\n",
    "mask": "@njit(inline='always', error_model='numpy')\ndef _mask(b, h, qi, kv, F, I):\n"
    "    try:\n"
    "        return bool(_user_mask(b, h, qi, kv)), False\n"
    "    except Exception:\n"
    "        return False, True\n",
}


def numpy_mods(score_mod=None, mask_mod=None) -> Mods:
    """:class:`Mods` of plain Python mods, compiled by Numba as written
    (forward only: no derivative), indexing bounds-checked (an index out of
    range is reported as the torch mods' are). Not cached on disk: the
    arrays and values a mod captures are constants of its compiled code
    (Numba's rule for globals); :func:`cached_numpy_mods` compiles again
    when they change."""
    from numba import njit

    kinds, users = [], {}
    for kind, fn in (("score", score_mod), ("mask", mask_mod)):
        if fn is None:
            continue
        if not callable(fn):
            raise TypeError(f"{kind}_mod must be a function, got {type(fn).__name__}")
        kinds.append(kind)
        fn = getattr(fn, "py_func", fn)  # an @njit function: compiled again, bounds-checked
        users[f"_user_{kind}"] = njit(error_model="numpy", boundscheck=True)(fn)
    scalars = "".join(_NUMPY_SCALARS[k] for k in kinds)

    def load(bits: int) -> dict:
        namespace = dict(users)
        source = module_source(scalars, kinds, 1, 1, cache=False, bits=bits)
        exec(compile(source, "<flashtile mods>", "exec"), namespace)
        return namespace

    return Mods(
        tuple(kinds), np.zeros(1), np.zeros(1, dtype=np.int64), load,
        label=" and ".join(f"{k}_mod" for k in kinds),
    )  # fmt: skip


#: NumPy mods compiled per pair of functions, with the checks of what they
#: captured (:func:`snapshot`).
_NUMPY_MODS: dict = {}


def cached_numpy_mods(score_mod, mask_mod) -> Mods:
    """:func:`numpy_mods`, compiled again when a value the functions
    captured has changed (an array's contents included: Numba froze them)."""
    key = (score_mod, mask_mod)
    found = _NUMPY_MODS.get(key)
    if found is not None and all(check() for check in found[1]):
        return found[0]
    mods = numpy_mods(score_mod, mask_mod)
    checks = snapshot(key, _array_check)
    if checks is not None:
        if len(_NUMPY_MODS) >= 32:
            _NUMPY_MODS.pop(next(iter(_NUMPY_MODS)))
        _NUMPY_MODS[key] = (mods, checks)
    return mods


def _array_check(value):
    """A check that a NumPy mod's captured value is what it is now: an array
    with the same contents, a NumPy scalar equal, a compiled helper the same
    object (None for other values)."""
    if isinstance(value, np.ndarray):
        kept = value.copy()
        return lambda now: now is value and now.shape == kept.shape and np.array_equal(now, kept)
    if isinstance(value, np.generic):
        return lambda now: type(now) is type(value) and now == value
    if hasattr(value, "py_func"):  # a Numba dispatcher: its code is its own
        return lambda now: now is value
    return None
