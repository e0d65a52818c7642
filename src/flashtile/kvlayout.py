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


def check_cache(q, k_cache, v_cache, cache_seqlens=None, block_table=None):
    """Validate a decode call; return ``(q, CacheLayout)``.

    ``q (B, Hq, Tq, d)``; ``Hkv`` (the cache's heads) must divide ``Hq``.
    """
    q = as_float_array(q, "q")
    if q.ndim != 4 or 0 in q.shape:
        raise ValueError(f"q has shape {q.shape}; decoding takes q (B, Hq, Tq, d) with Tq >= 1")
    batch, hq, _, d = q.shape
    k = _check_cache_array(k_cache, "k_cache")
    v = _check_cache_array(v_cache, "v_cache")
    if k.dtype != v.dtype or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k_cache {k.shape} {k.dtype} and v_cache {v.shape} {v.dtype} must share the "
            f"dtype and every dim but the last"
        )
    if k.shape[3] != d:
        raise ValueError(f"q has head dim d={d} but k_cache has {k.shape[3]} ({k.shape})")
    hkv, page = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"Hq={hq} query heads and Hkv={hkv} cache heads: Hkv must divide Hq (GQA/MQA)"
        )
    if page == 0 or v.shape[3] == 0:
        raise ValueError(f"the cache has an empty axis: k_cache {k.shape}, v_cache {v.shape}")
    if block_table is None:
        if k.shape[0] != batch:
            raise ValueError(
                f"q has B={batch} sequences but the contiguous cache has {k.shape[0]} "
                f"(k_cache {k.shape}); for a paged cache pass block_table"
            )
        table = np.arange(batch, dtype=np.int64)[:, None]
    else:
        table = np.asarray(block_table)
        if table.ndim != 2 or table.shape[0] != batch:
            raise ValueError(
                f"block_table has shape {table.shape}; expected (B, max_pages) with B={batch}"
            )
        table = _check_ints(table, "block_table", table.shape)
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
        used = np.arange(table.shape[1])[None, :] < -(-seqlens[:, None] // page)
        bad = used & ((table < 0) | (table >= k.shape[0]))
        if bad.any():
            b, p = np.argwhere(bad)[0]
            why = (
                f"sequence {b} has {seqlens[b]} keys"
                if cache_seqlens is not None
                else "without cache_seqlens every sequence fills all its table's pages; "
                "pass cache_seqlens for shorter sequences"
            )
            raise ValueError(
                f"block_table[{b}, {p}] = {table[b, p]} is not a page of the cache "
                f"(0..{k.shape[0] - 1}), but {why}"
            )
    return q, CacheLayout(k, v, np.ascontiguousarray(table), seqlens, page, block_table is not None)


def decode_variants(q, layout: CacheLayout, **keywords) -> Variants:
    """The variant keywords (``causal``, ``window``, ``alibi_slopes``,
    ``softcap``) of a decode call, validated against its shapes."""
    batch, hq, tq, d = q.shape
    capacity = layout.table.shape[1] * layout.page
    shapes = AttentionShapes((batch, hq), tq, capacity, d, layout.v.shape[3])
    return resolve_variants(shapes, **keywords)
