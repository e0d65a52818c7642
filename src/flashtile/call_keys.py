"""The prepared-call keys of the NumPy entry points (:mod:`flashtile.frontdoor`).

A key is a hashable name of everything a call's check reads but the key
count and the values: the arrays' types, shapes and dtypes, the flags,
``scale`` and the variant keywords that are plain values, and the thread
count. Calls of one key share one checked record (:func:`flashtile.frontdoor.prepare`);
a call that has no key (an array variant, an unusual type) takes the whole
check every time. The torch operator builds its own key from its tensors
(:func:`flashtile.torch._attention._plain_key`).
"""

from __future__ import annotations

import numpy as np

from .cpu.launch import numba_threads


def plain_key(q, k, v, causal, scale, return_lse, block_q, block_k, variants: dict):
    """The prepared-call key of a :func:`flashtile.attention` call on NumPy
    arrays, or None when it has none: all three ``np.ndarray`` with the same
    key count (at least one), no variant keyword but ``window`` and
    ``softcap``, and the plain values of :func:`plain_values`."""
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray):
        return None
    window, softcap = variants.get("window"), variants.get("softcap")
    if len(variants) != (window is not None) + (softcap is not None):
        return None  # another keyword (an array, or a typo the check names)
    if not plain_values(causal, return_lse, scale, window, softcap, (block_q, block_k)):
        return None
    ks, vs = k.shape, v.shape
    if not (k.ndim >= 2 and v.ndim >= 2 and ks[-2] == vs[-2] and ks[-2] > 0):
        return None
    return (
        "attention", q.shape, ks[:-2], ks[-1], vs[:-2], vs[-1], q.dtype, k.dtype, v.dtype,
        causal, scale, window, softcap, block_q, block_k, numba_threads(),
    )  # fmt: skip


def decode_key(
    q, k_cache, v_cache, cache_seqlens, block_table, num_splits, causal, scale, window, softcap,
    return_lse,
):  # fmt: skip
    """The prepared-call key of a :func:`flashtile.decode_attention` call
    without ``alibi_slopes`` or ``sinks`` (the caller's test), or None when it
    has none: ``np.ndarray`` queries and C-contiguous caches of one dtype,
    ``cache_seqlens`` and ``block_table`` None or integer ``np.ndarray``
    (their dtypes and shapes in the key, not their values), and
    the plain values of :func:`plain_values`."""
    if not (type(q) is np.ndarray and type(k_cache) is type(v_cache) is np.ndarray):
        return None
    lengths = table = None
    if cache_seqlens is not None:
        if type(cache_seqlens) is not np.ndarray or cache_seqlens.dtype.kind not in "iu":
            return None
        lengths = (cache_seqlens.dtype, cache_seqlens.shape)
    if block_table is not None:
        if type(block_table) is not np.ndarray or block_table.dtype.kind not in "iu":
            return None
        table = (block_table.dtype, block_table.shape)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        return None  # lse in the cache's compute dtype: the general path's shaping
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        return None
    if not plain_values(causal, return_lse, scale, window, softcap, (num_splits,)):
        return None
    return (
        "decode", q.shape, k_cache.shape, v_cache.shape, q.dtype, lengths, table, num_splits,
        causal, scale, window, softcap, numba_threads(),
    )  # fmt: skip


def plain_values(causal, return_lse, scale, window, softcap, sizes) -> bool:
    """Whether a call's scalar keywords can be part of a key (also
    :func:`flashtile.flash_attn.kvcache_steps.kvcache_key`'s): bool flags,
    ``scale`` and ``softcap`` None or a Python float, ``window`` None or a
    tuple of two ints, sizes None or ints. Types are part of the key: a value
    that the check would refuse (``causal=1``, ``window=(2.0, 0)``) never
    matches a checked one."""
    if not (type(causal) is bool and type(return_lse) is bool):
        return False
    if not (
        (scale is None or type(scale) is float) and (softcap is None or type(softcap) is float)
    ):
        return False
    if window is not None and not (
        type(window) is tuple and len(window) == 2 and type(window[0]) is type(window[1]) is int
    ):
        return False
    for size in sizes:  # noqa: SIM110  (all(...) of a generator: a Python call per item)
        if not (size is None or type(size) is int):
            return False
    return True
