"""Repeated ``flash_attn_with_kvcache`` calls on the CPU: checked once.

A serving loop calls ``flash_attn_with_kvcache`` once per layer and token
with tensors of the same metadata (shapes, strides, dtypes) and the same
keywords; only values change: the new keys and values, ``cache_seqlens``.
The first call of a metadata takes the whole path (:mod:`.kvcache`: the
flash-attn checks, then the decode call's checks) and stores what they
found: the checked variants and scale, how the cache is read. Later calls of
that metadata check only their values, append, and run the decode kernels
(:func:`flashtile.decode.decode_checked`) with those: no torch-level checks
and no second check of the cache. A value out of range (``cache_seqlens``
past the capacity, a block table entry that is not a page) sends the call
down the whole path, whose check names it.

Only for CPU tensors without ``cache_batch_idx``, ``cache_leftpad``, rotary
tables, ALiBi slopes or sinks: the other calls take the whole path every
time. The records live among flashtile's prepared calls
(:func:`flashtile.frontdoor.remember`), bounded with them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from flashtile.call_keys import plain_values
from flashtile.cpu.launch import numba_threads
from flashtile.decode import decode_checked
from flashtile.decode_planning import LengthsPlan
from flashtile.frontdoor import prepared, remember
from flashtile.kvlayout import CacheLayout, table_problem
from flashtile.torch.arrays import as_numpy, as_tensor
from flashtile.variants import Variants

from . import checks
from .pages import cache_pages, page_views


class KVCacheStep(NamedTuple):
    """What the first call of a key found (see the module docstring).

    Attributes:
        variants, scale: the decode call's checked variants and scale.
        splits: ``num_splits`` checked (None: automatic).
        capacity: keys a sequence can hold (``seqlen_cache``, or its block
            table's pages times ``page_block_size``).
        plans: the last plan (:class:`flashtile.decode_planning.LengthsPlan`:
            a model's layers attend with the same lengths).
        slots: ``[table]``, the page table of a cache without a block table
            (sequence ``b`` in cache row ``b``) over every position of each
            row, which the key's shapes and strides fix: the first stored
            call builds it (``[None]`` until then, and with a block table).
    """

    variants: Variants
    scale: float
    splits: int | None
    capacity: int
    plans: LengthsPlan
    slots: list


def kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal, window,
                softcap, num_splits, return_lse):  # fmt: skip
    """The prepared-call key of a ``flash_attn_with_kvcache`` call whose other
    keywords are at their defaults (the caller's test), or None when it has
    none: CPU tensors, ``cache_seqlens`` None, a Python int or a tensor,
    ``block_table`` None or a tensor (its values not in the key), and
    the plain keyword values of :func:`flashtile.call_keys.plain_values`
    (a value the whole path refuses is never stored). Types are part of the
    key, as in :func:`flashtile.call_keys.decode_key`."""
    if not (type(q) is type(k_cache) is type(v_cache) is torch.Tensor):
        return None
    if checks.on_gpu(q):  # (the Triton kernels' calls store no step)
        return None
    if k is None and v is None:
        new = None
    elif type(k) is type(v) is torch.Tensor:
        new = (k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device)
    else:
        return None
    if cache_seqlens is None or type(cache_seqlens) is int:
        lengths = type(cache_seqlens)
    elif type(cache_seqlens) is torch.Tensor:
        lengths = (cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device)
    else:
        return None
    table = None
    if block_table is not None:
        if type(block_table) is not torch.Tensor:
            return None
        table = (block_table.shape, block_table.dtype, block_table.device)
    if not plain_values(causal, return_lse, scale, window, softcap, (num_splits,)):
        return None
    devices = (q.device, k_cache.device, v_cache.device)  # (the whole path checks them)
    return (
        "kvcache", devices, q.shape, q.stride(), q.dtype, k_cache.shape, k_cache.stride(),
        k_cache.dtype, v_cache.shape, v_cache.stride(), v_cache.dtype, new, lengths, table,
        scale, causal, window, softcap, num_splits, return_lse, numba_threads(),
    )  # fmt: skip


def prepare_step(key, splits, capacity: int):
    """A function ``(variants, scale)`` that stores ``key``'s :class:`KVCacheStep`
    once the whole path has checked them (:func:`.kvcache._decode` calls it)."""

    def store(variants: Variants, scale: float) -> None:
        remember(key, KVCacheStep(variants, scale, splits, capacity, LengthsPlan(), [None]))

    return store


def run_step(key, q, k_cache, v_cache, new, cache_seqlens, block_table, append):
    """``(out (batch, seqlen_q, nheads, headdim_v), lse)`` of a call whose key
    a first call stored, or None when none did, or when this call's lengths
    or block table entries are out of range (the whole path then runs, and
    names them). ``new``: the new ``(k, v)`` or None; ``append(seqlens,
    slot, table)``: writes them into the caches at ``seqlens``
    (:func:`.kvcache._append`, given NumPy arrays)."""
    step = prepared(key)
    if step is None:
        return None
    batch, tn = q.shape[0], 0 if new is None else new[0].shape[1]
    seqlens = _seqlens(cache_seqlens, batch, most_keys(step.capacity, tn))
    if seqlens is None:
        return None
    lengths = seqlens + tn
    slot = table = None
    if block_table is None:
        slot = np.arange(batch, dtype=np.int64)
    else:
        table = block_table.numpy().astype(np.int64, copy=False)
        if table_problem(np, table, lengths, k_cache.shape[1], k_cache.shape[0], True):
            return None
    if new is not None:
        append(seqlens, slot, table)
    if table is None:
        k_pages, v_pages, table = _slot_pages(step, k_cache, v_cache, slot)
    else:
        k_pages, v_pages, table = cache_pages(k_cache, v_cache, None, table, None, lengths)
        table = np.ascontiguousarray(table)
    page = k_pages.shape[2]
    layout = CacheLayout(as_numpy(k_pages), as_numpy(v_pages), table, lengths, page, True)
    q4 = as_numpy(q.transpose(1, 2))
    out, lse = decode_checked(q4, layout, step.variants, step.scale, step.splits, plans=step.plans)
    return as_tensor(out).transpose(1, 2).contiguous(), as_tensor(lse)


def _slot_pages(step: KVCacheStep, k_cache, v_cache, slot):
    """:func:`.pages.cache_pages` of sequence ``b`` in cache row ``b``
    (``slot``), the table over every position of a row (``step.slots``,
    built once: the kernels read only a sequence's valid keys)."""
    table = step.slots[0]
    if table is None:
        full = np.full(len(slot), step.capacity, dtype=np.int64)
        k_pages, v_pages, table = cache_pages(k_cache, v_cache, slot, None, None, full)
        step.slots[0] = table = np.ascontiguousarray(table)
        return k_pages, v_pages, table
    k_pages, v_pages, _ = page_views(k_cache, v_cache, None)
    return k_pages, v_pages, table


def most_keys(capacity: int, tn: int) -> int:
    """The largest ``cache_seqlens`` a call may pass: a cache row of
    ``capacity`` keys must hold its ``tn`` new keys after them."""
    return capacity - tn


def _seqlens(cache_seqlens, batch: int, most: int) -> np.ndarray | None:
    """Each sequence's keys before the append, ``(batch,)`` int64 (the key's
    kind of ``cache_seqlens``: None, an int or a tensor), or None when one
    lies outside ``[0, most]``."""
    if cache_seqlens is None:
        return np.full(batch, most, dtype=np.int64)  # (no new keys without cache_seqlens)
    if type(cache_seqlens) is int:
        seqlens = np.full(batch, cache_seqlens, dtype=np.int64)
    else:
        seqlens = cache_seqlens.numpy().astype(np.int64)
    if batch and (seqlens.min() < 0 or seqlens.max() > most):
        return None
    return seqlens
