"""Decoding against a KV cache: split-KV (flash-decoding) on the CPU.

A decode step attends a few new queries per sequence to a long cache. There
is almost no arithmetic per byte, so the time is reading K and V once; the
only way to use every core for one sequence is to split its keys into
chunks, attend each chunk in parallel, and merge the partial ``(out, lse)``
with the online-softmax merge (:func:`flashtile.merge_states`; the kernel
uses its compiled twin).

Cache layouts (contiguous or paged) and their checks: :mod:`flashtile.kvlayout`;
the split planning: :func:`flashtile.decode_planning.plan_decode`; the kernel:
:mod:`flashtile.cpu.decode`. The reference:
:func:`flashtile.reference.decode_attention`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._validate import check_flag, check_num_splits, resolve_scale
from .call_keys import decode_key
from .decode_planning import LengthsPlan, plan_decode
from .frontdoor import (
    prepare_decode,
    prepared,
    remember,
    run_decode_checked,
    run_prepared_decode,
)
from .kvlayout import CacheLayout, cache_layout, check_cache, decode_variants
from .merge import add_sinks
from .precision import narrow_out
from .variants import Variants


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
    sinks=None,
):
    """Attention of a few new queries per sequence against a KV cache.

    Args:
        q: ``(B, Hq, Tq, d)``, Tq small (1 for plain decoding, more for
            speculative decoding); query ``i`` sits at position
            ``cache_seqlens[b] - Tq + i`` (bottom-right, per sequence).
        k_cache, v_cache: ``(B, Hkv, T_max, d / dv)`` contiguous, or
            ``(num_pages, Hkv, page_size, d / dv)`` with ``block_table``
            (see :mod:`flashtile.kvlayout`); float32, float64, or float16 /
            ``ml_dtypes.bfloat16`` (read as 16 bits and widened tile by tile,
            computed in float32; never copied; a bf16 cache with bf16
            queries is multiplied as bf16 where the CPU has bf16 products,
            ``P`` rounded to bf16, as :func:`flashtile.attention` does,
            except where :func:`flashtile.decode_planning.decode_operands`
            keeps the widening).
            C-contiguous.
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
        sinks: ``(Hq,)`` attention sinks, as in :func:`flashtile.attention`
            (merged into ``out`` and ``lse`` after the kernel).

    Returns:
        ``out (B, Hq, Tq, dv)`` in q's dtype and ``lse`` (natural log, in
        the compute dtype) if asked. A query that sees no key gets zeros
        and ``lse = -inf``.

    The compute dtype is float64 when the cache is float64, else float32
    (``lse`` is float32 then, also for bf16 or float16 queries);
    ``q`` is cast to it (bf16 queries stay bf16 for bf16 products,
    :func:`flashtile.decode_planning.decode_operands`). Where float32
    scores passed float32's range (a huge
    ``scale`` or huge values), the step is computed again in float64
    (:mod:`flashtile.precision`; ``lse`` stays float32).
    """
    key = None
    if alibi_slopes is None and sinks is None:
        key = decode_key(
            q, k_cache, v_cache, cache_seqlens, block_table, num_splits, causal, scale, window,
            softcap, return_lse,
        )  # fmt: skip
        entry = None if key is None else prepared(key)
        if type(entry) is CheckedDecode:  # lengths or a table: their values checked, planned
            layout = cache_layout(k_cache, v_cache, q.shape[0], cache_seqlens, block_table)
            out, lse = decode_checked(
                q, layout, entry.variants, entry.scale, entry.num_splits, plans=entry.plans
            )
            return (out, lse) if return_lse else out
        if entry is not None:  # checked and planned before
            result = run_prepared_decode(entry, q, k_cache, v_cache, return_lse)
            if result is not None:  # (None: planned before a BLAS or route change)
                return result
    num_splits = check_num_splits(num_splits)
    return_lse = check_flag(return_lse, "return_lse")
    q, layout = check_cache(q, k_cache, v_cache, cache_seqlens, block_table)
    variants = decode_variants(
        q, layout, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
        sinks=sinks,
    )  # fmt: skip
    scale = resolve_scale(scale, q.shape[3])
    if key is not None and (cache_seqlens is not None or block_table is not None):
        # The plan depends on the lengths: later calls of the key plan again.
        remember(key, CheckedDecode(variants, scale, num_splits, LengthsPlan()))
        key = None
    out, lse = decode_checked(q, layout, variants, scale, num_splits, key)
    return (out, lse) if return_lse else out


class CheckedDecode(NamedTuple):
    """What a :func:`decode_attention` call with ``cache_seqlens`` or a
    ``block_table`` checked of its keywords, for later calls of its key
    (:func:`flashtile.call_keys.decode_key`): those check the lengths and the
    table (:func:`flashtile.kvlayout.cache_layout`) and plan anew where the
    lengths changed (the split follows them; ``plans``, a
    :class:`~flashtile.decode_planning.LengthsPlan`, keeps the last plan).
    ``flashtile.KVCache.attend``, 12 heads of d 64 against 2048 of 4096 keys
    (AMD EPYC, Zen 3, three process pairs): 257-259 -> 233-237 us a call; in
    pages of 16, 485-490 -> 463-471 us."""

    variants: Variants
    scale: float
    num_splits: int | None
    plans: LengthsPlan


def decode_checked(
    q, layout: CacheLayout, variants: Variants, scale: float, num_splits, key=None, plans=None
):
    """``(out (B, Hq, Tq, dv), lse)`` of a checked decode call (as
    :func:`decode_attention` returns them): ``q`` and ``layout`` from
    :func:`flashtile.kvlayout.check_cache` (or its value part,
    :func:`~flashtile.kvlayout.cache_layout`), the variants from
    :func:`flashtile.kvlayout.decode_variants`, ``scale`` resolved,
    ``num_splits`` checked. The plan is stored for later calls of ``key``
    where one is given (:func:`flashtile.call_keys.decode_key`), or comes
    from ``plans`` (a stored call's
    :class:`~flashtile.decode_planning.LengthsPlan`) where that is given."""
    if plans is None:
        plan = plan_decode(q, layout, variants, scale, num_splits)
    else:
        plan = plans.plan(q, layout, variants, scale, num_splits)
    if key is not None:
        prepare_decode(key, plan, variants, q, num_splits)
    out, lse = run_decode_checked(plan, variants, q, num_splits)
    if variants.sinks is not None:
        out, lse = add_sinks(np, out, lse, variants.sinks)
    if out.dtype != q.dtype:  # float16 inputs
        out = narrow_out(out, q.dtype)
    return out, lse
