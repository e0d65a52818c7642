"""The decode row walks' key loops take no reference counts.

Numba takes and drops a reference (an atomic update of the array's count)
for each row view, and for each inlined helper whose array arguments its
pruning pass cannot pair up. Inside the loops over keys, those took a fifth
of a decoding step (``flashtile.cpu.memory.unmanaged``). Each function is compiled
afresh (the cached ones cannot be inspected) and its LLVM IR may increment
reference counts only in its entry block: a per-key one sits in a loop's.
Numba's optimiser (``NUMBA_OPT`` above 0) and its pruning pass remove the
calls on null meminfos, so the check needs both.
"""

import re

import numba
import numpy as np
import pytest
from numba import njit

from flashtile.cpu import FASTMATH, cache_heads, cache_rows
from flashtile.cpu.memory import cache_operands, prefetch

PAGES, HEADS, PAGE, D, ROWS, KEYS = 4, 2, 16, 64, 4, 32

pytestmark = pytest.mark.skipif(
    int(numba.config.OPT) == 0 or not numba.config.LLVM_REFPRUNE_PASS,
    reason="Numba's optimiser or its reference-count pruning is turned off",
)


def _increments_past_entry(fresh, name) -> int:
    """``NRT_incref`` call sites outside the entry block of the compiled
    function ``name`` (the definition whose mangled name holds it, not its
    Python wrapper)."""
    ir = fresh.inspect_llvm(fresh.signatures[0])
    pattern = rf"@_ZN(?!7cpython)\S*{len(name)}{name}"  # (Itanium mangling: length, name)
    (body,) = [d for d in ir.split("\ndefine")[1:] if re.search(pattern, d.split("\n")[0])]
    blocks = body.split("\n\n")  # (LLVM separates basic blocks by a blank line)
    return sum(block.count("call void @NRT_incref") for block in blocks[1:])


def _arguments(name):
    """Arguments of a small float32 call of the walk function ``name``."""
    k = np.zeros((PAGES, HEADS, PAGE, D), np.float32)
    flat, fmt = k.reshape(-1), cache_operands(k, k)[2]
    table = np.zeros(KEYS, np.int64)  # (one-token pages read table[j] for each key)
    rows2, rows3 = np.ones((ROWS, D), np.float32), np.ones((HEADS, ROWS, D), np.float32)
    s2, s3 = np.zeros((ROWS, KEYS), np.float32), np.zeros((HEADS, ROWS, KEYS), np.float32)
    return {
        "cache_scores": (rows2, flat, fmt, table, HEADS, 0, PAGE, 0, KEYS, s2, KEYS),
        "cache_values": (s2, flat, fmt, table, HEADS, 0, PAGE, 0, KEYS, rows2.copy(), KEYS),
        "head_scores": (rows3, flat, fmt, table, HEADS, 0, PAGE, 0, KEYS, s3),
        "page_values": (s3, flat, fmt, table, HEADS, 0, PAGE, 0, KEYS, rows3.copy()),
        "token_values": (s3, flat, fmt, table, HEADS, 0, 0, KEYS, rows3.copy()),
    }[name]


@pytest.mark.parametrize(
    "module, name",
    [
        (cache_rows, "cache_scores"),
        (cache_rows, "cache_values"),
        (cache_heads, "head_scores"),
        (cache_heads, "page_values"),
        (cache_heads, "token_values"),
    ],
)
def test_a_row_walk_takes_references_only_at_entry(module, name):
    args = _arguments(name)
    walk = getattr(module, name)
    # unmanaged() is safe for the arguments of a function Numba calls, not
    # inlines (an inlined one's arguments may be temporaries freed at once).
    assert walk.targetoptions.get("inline", "never") == "never"
    fresh = njit(fastmath=FASTMATH)(walk.py_func)
    fresh(*args)
    assert _increments_past_entry(fresh, name) == 0, f"{name} takes references in its loops"


@njit(fastmath=FASTMATH, inline="always")
def _prefetch_key(flat, table_row, page, j, j_end):
    """A helper of the shape that took references per key (the row walk's
    prefetch before the fix): it indexes one array argument and reads an
    attribute of another under a branch."""
    if j < j_end:
        o = np.uint64((table_row[j // page] * page + j % page) * D)
        for c in range(np.uint64(0), np.uint64(D), np.uint64(max(1, 64 // flat.itemsize))):
            prefetch(flat, o + c)


def test_the_check_sees_references_taken_per_key():
    """The count above can fail: such a helper in a key loop adds call sites."""

    def per_key_helper(flat, table_row, page, n, j_end):
        for t in range(n):
            _prefetch_key(flat, table_row, page, t, j_end)

    flat, table = np.ones(PAGES * PAGE * D, np.float32), np.zeros(PAGES, np.int64)
    fresh = njit(fastmath=FASTMATH)(per_key_helper)
    fresh(flat, table, PAGE, KEYS, KEYS)
    assert _increments_past_entry(fresh, "per_key_helper") > 0
