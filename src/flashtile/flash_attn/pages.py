"""flash-attn's ``(batch_cache, seqlen_cache, nheads_k, headdim)`` caches as the
decode kernels' pages, in place (see :mod:`.kvcache`'s docstring)."""

from __future__ import annotations

import numpy as np
import torch

from . import checks


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


def token_index(row, position, stride: int):
    """The one-token page (:func:`token_pages`) holding ``position`` of cache
    ``row``: the rows start ``stride`` tokens apart. Arrays of NumPy or
    torch, broadcast together."""
    return row * stride + position


def block_rows(table, at, page_size: int):
    """``(block, row)`` of positions ``at (batch, n)`` in a paged cache: position
    ``p`` of sequence ``b`` lies in block ``table[b, p // page_size]`` at row ``p
    % page_size``. NumPy arrays or tensors alike."""
    index = at // page_size
    block = (
        table.gather(1, index)
        if isinstance(table, torch.Tensor)
        else np.take_along_axis(table, index, 1)
    )
    return block, at % page_size


def cache_pages(k_cache, v_cache, slot, table, leftpad, lengths):
    """The caches as the decode kernels' ``(pages, nheads_k, page_size, headdim)``
    and their block table, without copying (see :mod:`.kvcache`'s docstring).
    ``slot`` (the cache row of each sequence, or None with ``table``), the
    block ``table`` (or None), ``leftpad`` (or None) and ``lengths`` (keys
    after appending, past the left padding): ``(batch,)``/``(batch, pages)``
    int64, all NumPy arrays or all tensors (the table comes back as they
    are)."""
    k_pages, v_pages, stride = page_views(k_cache, v_cache, leftpad)
    if stride is None:  # pages of the cache's own rows (or blocks)
        table = slot[:, None] if table is None else table
        return k_pages, v_pages, table
    rows = k_cache.shape[1]
    xp = np if isinstance(lengths, np.ndarray) else torch
    on = {} if xp is np else {"device": lengths.device}
    width = max(1, int(lengths.max())) if len(lengths) else 1
    first = xp.zeros_like(lengths) if leftpad is None else leftpad
    at = first[:, None] + xp.arange(width, **on)  # (batch, width) positions
    if table is None:
        tokens = token_index(slot[:, None], at, stride)
    else:  # entries past a sequence's length are never read: clamp them into the table
        at = at.clip(max=table.shape[1] * rows - 1)
        tokens = token_index(*block_rows(table, at, rows), stride)
    return k_pages, v_pages, tokens


def page_views(k_cache, v_cache, leftpad):
    """The caches as :func:`cache_pages`' pages, and how many tokens apart
    their rows start: the caches' own rows (or blocks) on the GPU, and for
    one kv head without left padding (stride None: their table is
    ``cache_pages``' block table, or each sequence's cache row), else
    one-token pages (:func:`token_pages`)."""
    natural = leftpad is None and (
        checks.on_gpu(k_cache)
        or (k_cache.shape[2] == 1 and transposes_contiguous(k_cache, v_cache))
    )
    if natural:
        return k_cache.transpose(1, 2), v_cache.transpose(1, 2), None
    k_tokens, stride = token_pages(k_cache, "k_cache")
    v_tokens, v_stride = token_pages(v_cache, "v_cache")
    if v_stride != stride:
        raise ValueError(
            f"k_cache and v_cache place their rows {stride} and {v_stride} tokens apart: give "
            f"them one layout (e.g. both contiguous)"
        )
    return k_tokens, v_tokens, stride
