"""Decoding against a KV cache: split-KV (flash-decoding) on the CPU.

A decode step attends a few new queries per sequence to a long cache. There
is almost no arithmetic per byte, so the time is reading K and V once; the
only way to use every core for one sequence is to split its keys into
chunks, attend each chunk in parallel, and merge the partial ``(out, lse)``
with the online-softmax merge (:func:`flashtile.merge_states`; the kernel
uses its compiled twin).

Cache layouts (contiguous or paged) and their checks: :mod:`flashtile.kvlayout`.
The reference: :func:`flashtile.reference.decode_attention`.
"""

from __future__ import annotations

import numbers

import numpy as np

from ._validate import compute_dtype, resolve_scale
from .kvlayout import check_cache, decode_variants
from .masks import block_key_range
from .planning import balance, kernel_variants

#: Keys per tile: a 256-key K tile of d=128 float32 is 128 KiB, so the tile,
#: its V tile and the prefetched next pair stay in L2.
DECODE_TILE = 256
#: A chunk is never shorter than this (unless the sequence is): below it the
#: per-chunk work (loading the queries, writing a partial) stops being small.
MIN_SPLIT_KEYS = 512
#: Automatic splitting aims at this many chunks per thread, so that the
#: static schedule can balance sequences of different lengths.
CHUNKS_PER_THREAD = 4


def _visible_ranges(seqlens, tq, variants):
    """``(lo, hi)`` per sequence: the keys any of its queries can see."""
    ranges = np.zeros((len(seqlens), 2), dtype=np.int64)
    for b, n in enumerate(seqlens.tolist()):
        args = (variants.causal, variants.left, variants.right, n)
        ranges[b] = block_key_range(0, tq, tq, n, *args)
    return ranges


def _check_splits(num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be a positive integer or None, got {num_splits!r}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None to choose), got {num_splits}")
    return int(num_splits)


def plan_splits(ranges, kv_heads, num_splits, threads, tile=DECODE_TILE):
    """Split each sequence's visible keys into chunks: the work items.

    Args:
        ranges: ``(B, 2)`` visible keys ``[lo, hi)`` per sequence.
        num_splits: chunks per sequence, or None: chunks of equal length
            (a multiple of ``tile``, at least MIN_SPLIT_KEYS) sized so that
            the whole batch makes about CHUNKS_PER_THREAD chunks per thread.

    Returns:
        ``items (N, 5)`` int64 rows ``(b, kv head, j_lo, j_hi, slot)`` in the
        order the threads should take them, and ``spans (B * Hkv, 2)``:
        the first slot and the count of each ``(b, kv head)``'s partials.
    """
    lengths = ranges[:, 1] - ranges[:, 0]
    if num_splits is None:
        total = kv_heads * int(lengths.sum())
        chunk = max(MIN_SPLIT_KEYS, -(-total // (CHUNKS_PER_THREAD * threads)))
        chunk = -(-chunk // tile) * tile
        splits = np.maximum(1, -(-lengths // chunk))
        chunks = np.full(len(lengths), chunk, dtype=np.int64)
    else:
        # More chunks than keys would only add empty partials.
        splits = np.minimum(num_splits, np.maximum(lengths, 1))
        chunks = np.maximum(1, -(-lengths // splits))
    # Slots run (b, kv head, chunk)-major, so each pair's partials are adjacent.
    pair_b = np.repeat(np.arange(len(lengths)), kv_heads)
    pair_splits = splits[pair_b]
    first = np.concatenate([[0], np.cumsum(pair_splits)[:-1]])
    slot_pair = np.repeat(np.arange(len(pair_b)), pair_splits)
    b = pair_b[slot_pair]
    chunk_index = np.arange(len(slot_pair)) - first[slot_pair]
    j_lo = np.minimum(ranges[b, 0] + chunk_index * chunks[b], ranges[b, 1])
    j_hi = np.minimum(j_lo + chunks[b], ranges[b, 1])
    items = np.stack([b, slot_pair % kv_heads, j_lo, j_hi, np.arange(len(b))], axis=1)
    spans = np.stack([first, pair_splits], axis=1).astype(np.int64)
    costs = (items[:, 3] - items[:, 2]) + 64  # + the fixed cost of a chunk
    return balance(items, costs), spans


def decode_attention(
    q,
    k_cache,
    v_cache,
    *,
    cache_seqlens=None,
    block_table=None,
    num_splits=None,
    causal=True,
    scale=None,
    window=None,
    alibi_slopes=None,
    softcap=None,
    return_lse=False,
):
    """Attention of a few new queries per sequence against a KV cache.

    Args:
        q: ``(B, Hq, Tq, d)``, Tq small (1 for plain decoding, more for
            speculative decoding); query ``i`` sits at position
            ``cache_seqlens[b] - Tq + i`` (bottom-right, per sequence).
        k_cache, v_cache: ``(B, Hkv, T_max, d / dv)`` contiguous, or
            ``(num_pages, Hkv, page_size, d / dv)`` with ``block_table``
            (see :mod:`flashtile.kvlayout`); float32, float64, or float16
            (widened tile by tile, computed in float32). C-contiguous.
            ``Hkv`` divides ``Hq`` (GQA/MQA: each kv head is read once for
            its group of query heads).
        cache_seqlens: ``(B,)`` valid keys per sequence (default: all).
            Keys beyond a sequence's length are never read.
        block_table: ``(B, max_pages)`` page indices, for a paged cache.
        num_splits: key chunks per sequence attended in parallel and merged;
            None picks from the thread count, the batch and the lengths.
            Any value gives the same result up to rounding.
        causal, scale, window, alibi_slopes, softcap: as in
            :func:`flashtile.attention` (``causal`` defaults to True here;
            ``alibi_slopes`` is ``(Hq,)`` or ``(B, Hq)``).
        return_lse: also return ``lse (B, Hq, Tq)``.

    Returns:
        ``out (B, Hq, Tq, dv)`` in q's dtype and ``lse`` (natural log, in
        the compute dtype) if asked. A query that sees no key gets zeros
        and ``lse = -inf``.

    The compute dtype is float64 when the cache is float64, else float32;
    ``q`` is cast to it.
    """
    import numba

    from .cpu.blas import gemm_for, single_threaded_blas
    from .cpu.decode import decode_kernel, merge_partials

    num_splits = _check_splits(num_splits)
    q, layout = check_cache(q, k_cache, v_cache, cache_seqlens, block_table)
    batch, hq, tq, d = q.shape
    hkv, dv = layout.heads, layout.v.shape[3]
    work = compute_dtype(layout.k.dtype)
    variants = decode_variants(
        q, layout, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap
    )
    kernel_vars = kernel_variants(variants, work, (batch, hq))
    scale = resolve_scale(scale, d)

    ranges = _visible_ranges(layout.seqlens, tq, variants)
    items, spans = plan_splits(ranges, hkv, num_splits, numba.get_num_threads())
    rows = (hq // hkv) * tq
    part_out = np.empty((len(items), rows, dv), dtype=work)
    part_lse = np.empty((len(items), rows), dtype=work)
    out = np.empty((batch, hq, tq, dv), dtype=work)
    lse = np.empty((batch, hq, tq), dtype=work)
    # Numba has no float16: the kernel widens the bit patterns itself.
    k, v = layout.k, layout.v
    if k.dtype == np.float16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    q_work = np.ascontiguousarray(q, dtype=work)
    gemm_fn = gemm_for(work, rows=rows)
    with single_threaded_blas(gemm_fn):
        decode_kernel(
            q_work,
            k,
            v,
            layout.table,
            layout.seqlens,
            items,
            part_out,
            part_lse,
            scale,
            kernel_vars,
            DECODE_TILE,
            gemm_fn,
        )
    merge_partials(part_out, part_lse, spans, out, lse)
    out = out.astype(q.dtype, copy=False)
    return (out, lse) if return_lse else out
