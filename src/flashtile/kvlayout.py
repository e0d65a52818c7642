"""How a KV cache is laid out, checked once for every decoding path.

Two layouts, one addressing rule:

- **contiguous**: ``k_cache, v_cache (B, Hkv, T_max, d / dv)``; sequence
  ``b``'s keys are ``k_cache[b, :, :seqlen[b]]``.
- **paged** (vLLM-style): ``(num_pages, Hkv, P, d / dv)`` pages and a
  ``block_table (B, max_pages)``; key ``j`` of sequence ``b`` is row
  ``j % P`` of page ``block_table[b, j // P]``. Only the first
  ``ceil(seqlen[b] / P)`` entries of a row are read; the rest may hold
  anything (e.g. -1).

A contiguous cache is the paged rule with ``P = T_max`` and
``block_table[b] = [b]``, so the kernel and the reference address both
kinds the same way. ``cache_seqlens (B,)`` gives each sequence's valid
length (default: the whole capacity). Query ``i`` of ``Tq`` sits at position
``seqlen[b] - Tq + i``: causal masks align bottom-right per sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._validate import SUPPORTED_DTYPES, AttentionShapes, as_float_array, as_numpy
from .variants import Variants, resolve_variants


class CacheLayout(NamedTuple):  # a tuple: built on every decoding call
    """A validated decode call's cache.

    Attributes:
        k, v: the caches as given (C-contiguous 4-D arrays).
        table: ``(B, pages)`` int64 block table (identity for contiguous).
        seqlens: ``(B,)`` int64 valid keys per sequence.
        page: keys per page ``P`` (``T_max`` for a contiguous cache).
        paged: whether the caller passed a block table.
    """

    k: np.ndarray
    v: np.ndarray
    table: np.ndarray
    seqlens: np.ndarray
    page: int
    paged: bool

    @property
    def heads(self) -> int:
        return self.k.shape[1]

    def sequence(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``b``'s keys and values, ``(Hkv, seqlen[b], d / dv)`` (copies)."""
        n = int(self.seqlens[b])
        pages = self.table[b, : -(-n // self.page)]
        k = self.k[pages].transpose(1, 0, 2, 3).reshape(self.heads, -1, self.k.shape[3])
        v = self.v[pages].transpose(1, 0, 2, 3).reshape(self.heads, -1, self.v.shape[3])
        return k[:, :n], v[:, :n]


def _check_cache_array(arr, name: str) -> np.ndarray:
    arr = as_numpy(arr)  # a torch bf16 cache too, in place
    if arr.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {arr.dtype}; a KV cache holds float16, bfloat16 (ml_dtypes), "
            f"float32 or float64"
        )
    if arr.ndim != 4:
        raise ValueError(
            f"{name} has shape {arr.shape}; expected (B, Hkv, T_max, d) for a contiguous "
            f"cache or (num_pages, Hkv, page_size, d) with a block_table"
        )
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{name} is not C-contiguous: decoding reads the cache in place, and copying "
            f"it on every step would cost more than the attention; store it with "
            f"np.ascontiguousarray once"
        )
    return arr


def _check_ints(x, name: str, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape}")
    return arr.astype(np.int64)


def check_cache_shapes(q, k_cache, v_cache, block_table=None) -> None:
    """The cache layout rule of both backends, on shapes alone (NumPy arrays
    or tensors on any device: only ``.shape`` is read): ``q (B, Hq, Tq, d)``
    with ``Tq, d >= 1`` (an empty batch is each backend's to take or refuse:
    the Triton kernels return empty results, the CPU's refuses),
    ``k_cache``/``v_cache`` 4-D alike but for the last dim, ``d`` shared
    with ``k_cache``, ``Hkv`` dividing ``Hq``, no empty axis in the cache,
    and ``B`` cache rows for a contiguous cache or ``block_table (B,
    max_pages)`` for a paged one. Raises ValueError."""
    qs, ks, vs = tuple(q.shape), tuple(k_cache.shape), tuple(v_cache.shape)
    if len(qs) != 4 or 0 in qs[2:]:
        raise ValueError(f"q has shape {qs}; decoding takes q (B, Hq, Tq, d) with Tq, d >= 1")
    if len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3]:
        raise ValueError(
            f"k_cache {ks} and v_cache {vs}: expected (B, Hkv, T_max, d / dv) for a contiguous "
            f"cache, or (num_pages, Hkv, page_size, d / dv) with a block_table; both alike but "
            f"for the last dim"
        )
    batch, hq, _, d = qs
    if ks[3] != d:
        raise ValueError(f"q has head dim d={d} but k_cache has {ks[3]} ({ks})")
    if ks[1] == 0 or hq % ks[1]:
        raise ValueError(
            f"Hq={hq} query heads and Hkv={ks[1]} cache heads: Hkv must divide Hq (GQA/MQA)"
        )
    if ks[2] == 0 or vs[3] == 0:
        raise ValueError(f"the cache has an empty axis: k_cache {ks}, v_cache {vs}")
    if block_table is None:
        if ks[0] != batch:
            raise ValueError(
                f"q has B={batch} sequences but the contiguous cache has {ks[0]} "
                f"(k_cache {ks}); for a paged cache pass block_table"
            )
        return
    table = tuple(block_table.shape)
    if len(table) != 2 or table[0] != batch:
        raise ValueError(f"block_table has shape {table}; expected (B, max_pages) with B={batch}")


def table_problem(xp, table, seqlens, page: int, pages: int, lengths_given: bool) -> str | None:
    """What is wrong with a block table's entries (NumPy, or torch with ``xp =
    torch``: read on the host), or None: every page a sequence reads (the
    first ``ceil(seqlens[b] / page)`` of its row) must be one of the cache's
    ``pages``; the entries past them are never read. ``lengths_given``: the
    caller passed ``cache_seqlens`` (else every sequence fills its row)."""
    if (table.numel() if xp is not np else table.size) == 0:
        return None
    on = {} if xp is np else {"device": table.device}
    columns = xp.arange(table.shape[1], **on)[None, :]
    bad = (columns * page < seqlens[:, None]) & ((table < 0) | (table >= pages))
    if not bool(bad.any()):
        return None
    b, p = (int(i) for i in xp.argwhere(bad)[0])
    why = (
        f"sequence {b} has {int(seqlens[b])} keys"
        if lengths_given
        else "without cache_seqlens every sequence fills all its table's pages; "
        "pass cache_seqlens for shorter sequences"
    )
    return (
        f"block_table[{b}, {p}] = {int(table[b, p])} is not a page of the cache "
        f"(0..{pages - 1}), but {why}"
    )


def check_cache(q, k_cache, v_cache, cache_seqlens=None, block_table=None):
    """Validate a decode call on the CPU; return ``(q, CacheLayout)``: the
    layout rule (:func:`check_cache_shapes`), NumPy caches of a CPU dtype
    read in place, the lengths and the table's entries (:func:`table_problem`).
    """
    q = as_float_array(q, "q")
    k = _check_cache_array(k_cache, "k_cache")
    v = _check_cache_array(v_cache, "v_cache")
    block_table = None if block_table is None else np.asarray(block_table)
    check_cache_shapes(q, k, v, block_table)
    if 0 in q.shape[:2]:
        raise ValueError(
            f"q has shape {q.shape}; the CPU's decoding takes at least one sequence and one "
            f"query head (B, Hq >= 1)"
        )
    if k.dtype != v.dtype:
        raise ValueError(
            f"k_cache has dtype {k.dtype} but v_cache {v.dtype}: the caches must share the dtype"
        )
    return q, cache_layout(k, v, q.shape[0], cache_seqlens, block_table)


def cache_layout(k, v, batch: int, cache_seqlens=None, block_table=None) -> CacheLayout:
    """The :class:`CacheLayout` of caches ``k, v`` whose metadata
    :func:`check_cache` checked (``block_table`` a NumPy array then), with the
    checks of the values: the lengths within the capacity, the table's
    entries (:func:`table_problem`). A repeated call of checked metadata
    (:func:`flashtile.call_keys.decode_key`) runs this part alone."""
    page = k.shape[2]
    if block_table is None:
        table = np.arange(batch, dtype=np.int64)[:, None]
    else:
        table = _check_ints(block_table, "block_table", block_table.shape)
    capacity = table.shape[1] * page
    if cache_seqlens is None:
        seqlens = np.full(batch, capacity, dtype=np.int64)
    else:
        seqlens = _check_ints(cache_seqlens, "cache_seqlens", (batch,))
        if seqlens.size and (seqlens.min() < 0 or seqlens.max() > capacity):
            raise ValueError(
                f"cache_seqlens must lie in [0, {capacity}] (the cache's capacity per "
                f"sequence), got min {seqlens.min()} and max {seqlens.max()}"
            )
    if block_table is not None:
        problem = table_problem(np, table, seqlens, page, k.shape[0], cache_seqlens is not None)
        if problem:
            raise ValueError(problem)
    return CacheLayout(k, v, np.ascontiguousarray(table), seqlens, page, block_table is not None)


def decode_variants(q, layout: CacheLayout, **keywords) -> Variants:
    """The variant keywords (``causal``, ``window``, ``alibi_slopes``,
    ``softcap``) of a decode call, validated against its shapes."""
    batch, hq, tq, d = q.shape
    capacity = layout.table.shape[1] * layout.page
    shapes = AttentionShapes((batch, hq), tq, capacity, d, layout.v.shape[3])
    return resolve_variants(shapes, **keywords)
