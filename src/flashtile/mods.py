"""A user's own score and mask functions, compiled into the kernels.

FlexAttention's convention (PyTorch): ``score_mod(score, b, h, q_idx,
kv_idx) -> score`` changes each score (``score = scale * q . k``, before the
softmax) and ``mask_mod(b, h, q_idx, kv_idx) -> bool`` keeps a key (True) or
hides it. ``b`` is the batch entry, ``h`` the query head, ``q_idx``/``kv_idx``
the query's and the key's positions.

A pair of mods becomes a :class:`Mods` record: the row functions the
kernels call through :func:`flashtile.cpu.mod_calls.call_row` (their
addresses, for float32 or float64 work, each compiled on its first use), the
captured tables the mods read
(flattened into one float64 and one int64 buffer), and, with a mask, the
block map (``TILE_*`` states per tile) that lets the kernels skip empty
tiles and leave full ones unmasked. The kernels are compiled once for every
mod; a mod compiles only its row functions.

Mods come from two places:

- :mod:`flashtile.numpy_mods`: plain Python functions on scalars
  (``math``, NumPy scalar functions, NumPy arrays read by index), compiled
  with Numba as they are. The NumPy API's forward (``flashtile.attention(...,
  score_mod=, mask_mod=)``). They have no derivative.
- :mod:`flashtile.torch.flex_trace`: torch mods, traced and translated into
  the same scalar functions, with their derivatives (taken by
  ``torch.func``), and cached on disk by their source
  (:func:`compiled_module`); the traces themselves by what the mods are
  (:mod:`flashtile.torch.trace_cache`).

Either way the scalar functions are ``_score(x, b, h, qi, kv, F, I) ->
(value, bad)``, ``_score_grad(...) -> (value, d value / d x, bad)``,
``_score_capture(x, g, b, h, qi, kv, F, I, G) -> (0, bad)`` (adds ``g``
times the derivative by each captured float entry it read to ``G``, laid
out like ``F``) and ``_mask(b, h, qi, kv, F, I) -> (keep, bad)``;
:data:`LOOPS` and :data:`ROW_TEMPLATE` wrap them into row functions. Scores
are computed in the call's work dtype, ``WORK`` in the generated code
(float32 or float64: a module per dtype), with captured float tables read
as that dtype and integers promoted to it, as torch computes. ``bad`` says
a captured table was indexed out of range (the read was clamped to the
table); a row that saw one sets ``I[0]``, an error flag the caller checks
after the call and raises on.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .masks import TILE_EMPTY, TILE_FULL, TILE_PARTIAL

#: The row functions around the scalar functions; ``{T}`` is 32 or 64 (the
#: work dtype of the scores), ``{CACHE}`` whether Numba caches them on disk.
#: Units: the kernels hold scores in log2 units (``s = x * log2(e)``).
ROW_TEMPLATE = """
@cfunc(row_signature(float{T}), cache={CACHE})
def score_row_{T}(s_p, aux_p, n, b, h, qi, col0, f_p, i_p, g_p):
    _score_loop(carray(s_p, n), b, h, qi, col0, carray(f_p, NF), carray(i_p, NI))


@cfunc(row_signature(float{T}), cache={CACHE})
def score_grad_row_{T}(s_p, aux_p, n, b, h, qi, col0, f_p, i_p, g_p):
    s, chain = carray(s_p, n), carray(aux_p, n)
    _score_grad_loop(s, chain, b, h, qi, col0, carray(f_p, NF), carray(i_p, NI))


@cfunc(row_signature(float{T}), cache={CACHE})
def capture_row_{T}(s_p, aux_p, n, b, h, qi, col0, f_p, i_p, g_p):
    raw, grad = carray(s_p, n), carray(aux_p, n)
    F, I, G = carray(f_p, NF), carray(i_p, NI), carray(g_p, NF)
    _capture_loop(raw, grad, b, h, qi, col0, F, I, G)


@cfunc(row_signature(float{T}), cache={CACHE})
def mask_row_{T}(s_p, aux_p, n, b, h, qi, col0, f_p, i_p, g_p):
    _mask_loop(carray(s_p, n), b, h, qi, col0, carray(f_p, NF), carray(i_p, NI))


@cfunc(row_signature(float64), cache={CACHE})
def mask_count_row(s_p, aux_p, n, b, h, qi, col0, f_p, i_p, g_p):
    # (block maps) aux[0] = how many of the row's n keys are kept (float64
    # whatever the module's work dtype: the counter is the same in each)
    kept = _count_loop(n, b, h, qi, col0, carray(f_p, NF), carray(i_p, NI))
    carray(aux_p, 1)[0] = kept
"""

#: The mask function over keys ``[lo, hi)`` of a row (both mask loops'):
#: hidden keys become -inf, by a select (a branch that stores stays scalar).
_MASK_SPAN = """
@njit(cache={CACHE}, error_model="numpy")
def _mask_span(s, lo, hi, b, h, qi, col0, F, I):
    bad = False
    for c in range(lo, hi):
        keep, out = _mask(b, h, qi, col0 + c, F, I)
        s[c] = s[c] if keep else NEG_INF_W
        bad |= out
    return bad

"""

#: The loops of the row functions, compiled as ordinary Numba functions and
#: called by the C-callable wrappers of :data:`ROW_TEMPLATE`: Numba does not
#: vectorise a ``cfunc``'s own loops (docs/design.md, performance notes).
LOOPS = {
    "score": """
@njit(cache={CACHE}, error_model="numpy")
def _score_loop(s, b, h, qi, col0, F, I):
    bad = False
    for c in range(s.shape[0]):
        y, out = _score(s[c] * LN2_W, b, h, qi, col0 + c, F, I)
        s[c] = y * LOG2E_W
        bad |= out
    if bad:
        I[0] = 1
""",
    "score_grad": """
@njit(cache={CACHE}, error_model="numpy")
def _score_grad_loop(s, chain, b, h, qi, col0, F, I):
    bad = False
    for c in range(s.shape[0]):
        y, dy, out = _score_grad(s[c] * LN2_W, b, h, qi, col0 + c, F, I)
        s[c] = y * LOG2E_W
        chain[c] = dy
        bad |= out
    if bad:
        I[0] = 1
""",
    "capture": """
@njit(cache={CACHE}, error_model="numpy")
def _capture_loop(raw, grad, b, h, qi, col0, F, I, G):
    bad = False
    for c in range(raw.shape[0]):
        if grad[c] != 0.0:
            _, out = _score_capture(raw[c] * LN2_W, grad[c], b, h, qi, col0 + c, F, I, G)
            bad |= out
    if bad:
        I[0] = 1
""",
    "mask": _MASK_SPAN
    + """
@njit(cache={CACHE}, error_model="numpy")
def _mask_loop(s, b, h, qi, col0, F, I):
    if _mask_span(s, 0, s.shape[0], b, h, qi, col0, F, I):
        I[0] = 1
""",
    "mask_mapped": _MASK_SPAN
    + """
@njit(cache={CACHE}, error_model="numpy")
def _mask_loop(s, b, h, qi, col0, F, I):
    # A block map's state read once per map block of the row's keys (its
    # block indices are divisions, costly per key): FlexAttention's rule, a
    # full block keeps its keys, a partial one asks the mask, any other
    # hides them.
    bad, n, c = False, s.shape[0], 0
    row = MAP + ((b % BM) * HM + h % HM) * (NQ * NK) + (qi // BQ) * NK
    while c < n:
        block = (col0 + c) // BK
        end = min(n, (block + 1) * BK - col0)
        state = I[np.uintp(row + block)]
        if state == PARTIAL:
            bad |= _mask_span(s, c, end, b, h, qi, col0, F, I)
        elif state != FULL:
            s[c:end] = NEG_INF_W
        c = end
    if bad:
        I[0] = 1
""",
    "mask_count": """
@njit(cache={CACHE}, error_model="numpy")
def _count_loop(n, b, h, qi, col0, F, I):
    kept, bad = 0, False  # (an integer sum: a float one waits on each add's latency)
    for c in range(n):
        keep, out = _mask(b, h, qi, col0 + c, F, I)
        kept += keep
        bad |= out
    if bad:
        I[0] = 1
    return kept
""",
}

#: What a generated module imports (before its scalar functions).
PRELUDE = """
import math

import numpy as np
from numba import carray, cfunc, njit
from numba.types import float32, float64

from flashtile.cpu import FASTMATH
from flashtile.cpu.rowops import tanh_of
from flashtile.mods import row_signature
from flashtile.units import LN2, LOG2E


@njit(error_model="numpy", fastmath=FASTMATH)
def tanh_pair(x):
    # tanh and its derivative, as the softcap flag computes them. (A call
    # LLVM inlines: inlined in Numba's IR as well, within the inlined scalar
    # functions, it upset Numba's variable scoping.)
    return tanh_of(x)
"""

#: The kinds of row functions, in :class:`RowFunctions` order (a mask also
#: has ``mask_count``, which only :func:`mask_block_states` calls).
KINDS = ("score", "score_grad", "capture", "mask")
_TEMPLATE_KINDS = KINDS + ("mask_count",)


def row_signature(dtype):
    """The C signature of every row function for scores of Numba ``dtype``
    (see :mod:`flashtile.cpu.mod_calls`)."""
    from numba import types

    word, floats = types.int64, types.CPointer(types.float64)
    row = types.CPointer(dtype)
    return types.void(
        row, row, word, word, word, word, word, floats, types.CPointer(types.int64), floats
    )


class RowFunctions(NamedTuple):
    """Addresses of the row functions for one work dtype (0 = none)."""

    score: int
    score_grad: int
    capture: int
    mask: int


@dataclass(eq=False)
class Mods:
    """A compiled score and/or mask function with what it reads.

    Attributes:
        kinds: which scalar functions exist (names of :data:`KINDS`).
        floats: float64 flat buffer of the captured float tables (at least
            one element); ints: int64 flat buffer of the integer and bool
            tables, ``ints[0]`` the out-of-range flag.
        load: ``load(bits)`` compiles (or loads from the disk cache) the
            row functions for work of ``bits`` (32 or 64) and returns the
            generated module's names; called once per work dtype used.
        states, block: the mask's block map ``(Bm, Hm, nQ, nK)`` int8 at
            tiles of ``block = (block_q, block_k)``, or None without a mask.
        label: how errors name the mods.
        limits: ``(input, size)`` pairs: a captured table's dim of ``size``
            is indexed by the input itself (``"b"``, ``"h"``, ``"qi"`` or
            ``"kv"``), unchecked per element: :meth:`check_extent` checks
            the call's sizes against it once.
    """

    kinds: tuple[str, ...]
    floats: np.ndarray
    ints: np.ndarray
    load: Callable[[int], dict]
    states: np.ndarray | None = None
    block: tuple[int, int] = (128, 128)
    label: str = "score_mod/mask_mod"
    limits: tuple[tuple[str, int], ...] = ()
    _rows: dict = field(default_factory=dict, repr=False)
    _modules: dict = field(default_factory=dict, repr=False)
    _maps: dict = field(default_factory=dict, repr=False)

    @property
    def has_score(self) -> bool:
        return "score" in self.kinds

    @property
    def has_mask(self) -> bool:
        return "mask" in self.kinds

    @property
    def differentiable(self) -> bool:
        """Whether the backward can run: a score function needs its derivative."""
        return not self.has_score or "score_grad" in self.kinds

    @property
    def has_capture(self) -> bool:
        return "capture" in self.kinds

    def module(self, bits: int) -> dict:
        """The generated module's names for work of ``bits`` (32 or 64)."""
        found = self._modules.get(bits)
        if found is None:
            with LOCK:  # (threads: one compile, one set of row addresses)
                found = self._modules.get(bits)
                if found is None:
                    found = self._modules[bits] = self.load(bits)
        return found

    def rows(self, dtype) -> RowFunctions:
        """The row functions for work ``dtype`` (float32 or float64), compiled
        on first use (a cached module loads them from disk)."""
        bits = np.dtype(dtype).itemsize * 8
        found = self._rows.get(bits)
        if found is None:
            names = self.module(bits)
            found = RowFunctions(
                *(names[f"{k}_row_{bits}"].address if k in self.kinds else 0 for k in KINDS)
            )
            self._rows[bits] = found
        return found

    def check_extent(self, batch: int, heads: int, tq: int, tk: int) -> None:
        """Raise IndexError when a table indexed directly by ``b``, ``h``,
        ``q_idx`` or ``kv_idx`` is shorter than the call's extent of it."""
        extent = {"b": batch, "h": heads, "qi": tq, "kv": tk}
        names = {"b": "b", "h": "h", "qi": "q_idx", "kv": "kv_idx"}
        for name, size in self.limits:
            if extent[name] > size:
                raise IndexError(
                    f"{self.label} indexes a captured tensor's dim of size {size} by "
                    f"{names[name]}, which runs to {extent[name] - 1} in this call: size the "
                    f"table for every index the call passes"
                )

    def clear_flag(self) -> None:
        self.ints[0] = 0

    def check_flag(self) -> None:
        """Raise if a mod indexed a captured table out of range during the call."""
        if self.ints[0]:
            self.ints[0] = 0
            raise IndexError(
                f"{self.label} indexed a captured tensor out of its range (b, h, q_idx or "
                f"kv_idx reached past a table's size; a NumPy mod may also have raised "
                f"another error): size the table for every index the call passes"
            )

    def kernel_states(self, block_q: int, block_k: int, tq: int, tk: int) -> np.ndarray:
        """The block map at the kernel's tiles: a kernel tile is empty (full)
        only when every map block it overlaps is, else partial."""
        return restate(self.states, self.block, (block_q, block_k), (tq, tk))


def restate(states, block, tiles, extent) -> np.ndarray:
    """``(Bm, Hm, ceil(Tq/tiles[0]), ceil(Tk/tiles[1]))`` int8 states of
    ``tiles`` from ``states`` summarised at ``block``: the min and max over
    the map blocks a tile overlaps (both empty: empty; both full: full)."""
    out = states
    for axis, (size, tile, length) in enumerate(zip(block, tiles, extent, strict=True), start=2):
        n = -(-length // tile)
        first = (np.arange(n) * tile) // size
        last = (np.minimum(np.arange(1, n + 1) * tile, length) - 1) // size
        last = np.clip(last, 0, out.shape[axis] - 1)
        lo = np.take(out, first, axis=axis)
        hi = lo.copy()
        for step in range(1, int((last - first).max(initial=0)) + 1):
            idx = np.minimum(first + step, last)
            part = np.take(out, idx, axis=axis)
            lo, hi = np.minimum(lo, part), np.maximum(hi, part)
        merged = np.where(lo == hi, lo, TILE_PARTIAL)
        out = np.where((lo == TILE_FULL) & (hi == TILE_FULL), TILE_FULL, merged)
        out = np.where((lo == TILE_EMPTY) & (hi == TILE_EMPTY), TILE_EMPTY, out)
    return np.ascontiguousarray(out, dtype=np.int8)


def mask_block_states(mods: Mods, batch: int, heads: int, tq: int, tk: int, block) -> np.ndarray:
    """``(batch, heads, nQ, nK)`` int8 states of the mods' mask function at
    tiles of ``block``, evaluated by a compiled pass (memory: one row per
    thread). ``batch``/``heads`` of 1 evaluate the mask at ``b``/``h`` = 0
    (broadcast). The counter is in every work dtype's module: float32's is
    loaded unless float64's already is (the one a float32, 16-bit or mixed
    call compiles anyway)."""
    from .cpu.mod_calls import mask_states

    mods.check_extent(batch, heads, tq, tk)
    mods.clear_flag()
    bits = 64 if 64 in mods._modules and 32 not in mods._modules else 32
    counter = mods.module(bits)["mask_count_row"].address
    states = mask_states(counter, batch, heads, tq, tk, block[0], block[1], mods.floats, mods.ints)
    mods.check_flag()
    return states


def module_source(
    scalar_source: str, kinds, n_floats: int, n_ints: int, cache: bool, bits: int,
    mapped: bool = False,
) -> str:  # fmt: skip
    """The full source of a mods module: prelude, sizes, the scalar
    functions, and the row functions of ``kinds`` for work of ``bits`` (32
    or 64: one dtype per module, so a call compiles only the one it uses).
    ``mapped``: the mask loop reads a block map (``scalar_source`` defines
    its offset and shape: ``MAP, BM, HM, NQ, NK, BQ, BK``)."""
    wanted = set(kinds) | ({"mask_count"} if "mask" in kinds else set())
    loops = dict(LOOPS, mask=LOOPS["mask_mapped" if mapped else "mask"])
    rows = [loops[k].format(CACHE=cache) for k in _TEMPLATE_KINDS if k in wanted]
    blocks = ROW_TEMPLATE.format(T=bits, CACHE=cache).split("\n\n\n")
    rows += [b for b, kind in zip(blocks, _TEMPLATE_KINDS, strict=True) if kind in wanted]
    # WORK is the float of the scores' work dtype: a float32 call's mods
    # compute in float32 (as torch's), in vectors where the functions allow
    sizes = (
        f"NF, NI = {n_floats}, {n_ints}\nWORK = np.float{bits}\n"
        f"LN2_W, LOG2E_W, NEG_INF_W = WORK(LN2), WORK(LOG2E), WORK(-math.inf)\n"
        f"EMPTY, PARTIAL, FULL = {TILE_EMPTY}, {TILE_PARTIAL}, {TILE_FULL}\n"
    )
    # The flashtile sources it imports are part of its identity: Numba's
    # cache knows only this file, so a change to them must give another file.
    stamp = f"# helpers: {_helpers_digest()}\n"
    return "\n".join([stamp + PRELUDE, sizes, textwrap.dedent(scalar_source), *rows])


@functools.cache
def _helpers_digest() -> str:
    """A digest of the flashtile sources a generated module imports."""
    here = Path(__file__).resolve().parent
    files = ("mods.py", "units.py", "cpu/rowops.py", "cpu/__init__.py")
    sources = b"".join((here / f).read_bytes() for f in files)
    return hashlib.sha256(sources).hexdigest()[:16]


#: One compilation at a time: a module half executed by one thread must not
#: be found by another (and tracing, :mod:`flashtile.torch.flex_trace`, is not
#: re-entrant across threads either).
LOCK = threading.RLock()


def compiled_module(source: str, directory: Path) -> dict:
    """Import ``source`` from ``directory/mods_<hash>.py`` (written once), so
    that Numba caches its compiled functions beside it across processes.
    A module that fails to compile is not kept (TypeError naming the cause)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    name = f"flashtile_mods_{digest}"
    with LOCK:
        if name in sys.modules:
            return vars(sys.modules[name])
        path = directory / f"mods_{digest}.py"
        if not path.is_file() or path.read_text() != source:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(source)
            tmp.replace(path)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (Numba's cache looks the module up while compiling)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # Numba's typing errors: name them, keep nothing
            sys.modules.pop(name, None)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TypeError(
                f"a mod's generated code ({path}) does not compile: {first}. The mod uses "
                f"something flashtile translates but Numba cannot run; write it with the "
                f"operations docs/flex.md lists"
            ) from exc
        return vars(module)
