"""The reference for decoding against a KV cache: gather, then tiled attention.

Each sequence's valid keys are gathered out of the (paged) cache with the
addressing rule of :mod:`flashtile.kvlayout` and attended with
:func:`tiled_attention`, whose bottom-right causal alignment is exactly the
decoding convention (query ``i`` of ``Tq`` at position ``seqlen - Tq + i``).
Slow and obvious on purpose: it is the oracle for
:func:`flashtile.decode_attention`.
"""

from __future__ import annotations

import numpy as np

from .._validate import check_flag, compute_dtype
from ..kvlayout import check_cache, decode_variants
from .attention import tiled_attention


def decode_attention(
    q,
    k_cache,
    v_cache,
    *,
    cache_seqlens=None,
    block_table=None,
    causal=True,
    scale=None,
    window=None,
    alibi_slopes=None,
    softcap=None,
    return_lse=False,
    block_size=64,
):
    """``out (B, Hq, Tq, dv)`` (and ``lse (B, Hq, Tq)``) of each sequence's
    queries against its cached keys; see :func:`flashtile.decode_attention`.

    Same arguments as the fast path, except that there is no ``num_splits``
    (the reference never splits; ``block_size`` is the key tile of
    :func:`tiled_attention`). As an oracle it computes, and returns, in the
    wider of q's and the cache's dtypes (float64 if either is), where the
    fast path computes in the cache's dtype and returns q's.
    """
    return_lse = check_flag(return_lse, "return_lse")
    q, layout = check_cache(q, k_cache, v_cache, cache_seqlens, block_table)
    # Validate the keywords once, with the fast path's messages.
    decode_variants(
        q, layout, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap
    )
    work = compute_dtype(np.result_type(q.dtype, layout.k.dtype))
    batch, hq, tq, _ = q.shape
    out = np.zeros((batch, hq, tq, layout.v.shape[3]), dtype=work)
    lse = np.full((batch, hq, tq), -np.inf, dtype=work)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
    for b in range(batch):
        if layout.seqlens[b] == 0:
            continue  # no key at all: zeros and -inf
        k, v = layout.sequence(b)
        out[b], lse[b] = tiled_attention(
            q[b].astype(work),
            k.astype(work),
            v.astype(work),
            block_size,
            causal,
            scale=scale,
            return_lse=True,
            window=window,
            alibi_slopes=None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b]),
            softcap=softcap,
        )
    return (out, lse) if return_lse else out
