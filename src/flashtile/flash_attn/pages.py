"""flash-attn's ``(batch_cache, seqlen_cache, nheads_k, headdim)`` caches as the
decode kernels' pages, in place (see :mod:`.kvcache`'s docstring)."""

from __future__ import annotations

import torch


def transposes_contiguous(*caches) -> bool:
    """Whether each cache's ``transpose(1, 2)`` is contiguous (one kv head)."""
    return all(c.transpose(1, 2).is_contiguous() for c in caches)


def token_pages(cache: torch.Tensor, name: str):
    """``cache (rows, seqlen, nheads_k, d)`` as one-token pages ``(tokens, nheads_k, 1, d)``
    over the same memory, and how many tokens apart its rows start."""
    n, t, h, d = cache.shape
    s0, s1, s2, s3 = cache.stride()
    token = h * d
    fits = (
        (s3 == 1 or d == 1) and (s2 == d or h == 1) and (s1 == token or t == 1)
        and (s0 % token == 0 or n == 1)
    )  # fmt: skip
    if not fits:
        raise ValueError(
            f"{name} has strides {cache.stride()} for shape {tuple(cache.shape)}: flashtile "
            f"reads this cache in place token by token (a CPU cache, or any cache with "
            f"cache_leftpad), which needs each token's (nheads_k, headdim) block contiguous "
            f"and the tokens of a row nheads_k * headdim apart; allocate the cache contiguous "
            f"once (e.g. torch.zeros(batch, seqlen, nheads_k, headdim))"
        )
    stride = s0 // token if n > 1 else 0
    pages = cache.as_strided(((n - 1) * stride + t, h, 1, d), (token, d, d, 1))
    return pages, stride


def token_index(row, stride: int, position):
    """The one-token page (:func:`token_pages`) holding ``position`` of cache
    ``row``: the rows start ``stride`` tokens apart. Arrays of NumPy or
    torch, broadcast together."""
    return row * stride + position
