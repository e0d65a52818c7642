"""``context_parallel_decode``: decoding against a KV cache sharded across ranks.

Every rank holds part of each sequence's keys and values and the same new
queries. Each attends its own part with the split-KV kernel
(:func:`flashtile.decode_attention`), then one all-gather of the partial
``(out, lse)`` (``B * Hq * Tq * (dv + 1)`` numbers per rank) lets every rank
merge them with :func:`flashtile.merge_states`, in rank order: every rank
gets the same bits.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch
import torch.distributed as dist

import flashtile

from .comm import ring_of
from .threads import kernel_threads


def _numpy(x, name: str):
    """A tensor argument as NumPy (16-bit floats NumPy lacks are widened to float32)."""
    if x is None or not isinstance(x, torch.Tensor):
        return x
    if x.device.type != "cpu":
        raise ValueError(f"{name} is on {x.device}: pass CPU tensors")
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.detach().contiguous().numpy()


def _tail(tail_rank, size: int) -> int:
    if tail_rank is None:
        return size - 1
    if isinstance(tail_rank, bool) or not isinstance(tail_rank, numbers.Integral):
        raise TypeError(f"tail_rank must be an int or None, got {tail_rank!r}")
    if not 0 <= tail_rank < size:
        raise ValueError(f"tail_rank={tail_rank} is not a rank of this group of {size}")
    return int(tail_rank)


def _merge_in_rank_order(parts: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    out, lse = parts[0][..., :-1].numpy(), parts[0][..., -1].numpy()
    for part in parts[1:]:
        out, lse = flashtile.merge_states(out, lse, part[..., :-1].numpy(), part[..., -1].numpy())
    return out, lse


def context_parallel_decode(
    q,
    k_cache,
    v_cache,
    *,
    group=None,
    cache_seqlens=None,
    block_table=None,
    num_splits=None,
    causal=True,
    tail_rank=None,
    scale=None,
    softcap=None,
    return_lse=False,
):
    """Attention of a few new queries against a KV cache split across the ranks of ``group``.

    Args:
        q: ``(B, Hq, Tq, d)`` CPU tensor, the same on every rank (the new tokens).
        k_cache, v_cache: this rank's part of the cache, in any layout
            :func:`flashtile.decode_attention` takes (contiguous
            ``(B, Hkv, T_max, d)``, or paged with ``block_table``); float16,
            float32, float64 (bfloat16 is widened to float32 first).
        cache_seqlens: ``(B,)`` valid keys per sequence *in this rank's part*
            (default: all); 0 is fine (the rank contributes nothing).
        block_table, num_splits, scale, softcap: as in :func:`flashtile.decode_attention`,
            for this rank's part.
        causal: the queries are the newest tokens of their sequences and their
            own keys are already cached: the last ``Tq`` valid keys of rank
            ``tail_rank``'s part (default: the last rank). That rank applies the
            bottom-right causal rule; every key elsewhere is older than every
            query, so all of it is seen. With ``Tq = 1`` this is plain decoding.
        return_lse: also return ``lse (B, Hq, Tq)``.

    Returns:
        ``out (B, Hq, Tq, dv)`` in q's dtype (and ``lse``), identical on every
        rank and equal, up to rounding, to one process decoding the whole cache.

    Sliding windows and ALiBi need every key's global position, which the
    ranks' parts do not carry: they are not supported here.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"context_parallel_decode: q is a {type(q).__name__}, not a torch.Tensor")
    ring = ring_of(group, q, *(t for t in (k_cache, v_cache) if isinstance(t, torch.Tensor)))
    tail = _tail(tail_rank, ring.size)
    with kernel_threads(ring.size):
        out, lse = flashtile.decode_attention(
            _numpy(q, "q"),
            _numpy(k_cache, "k_cache"),
            _numpy(v_cache, "v_cache"),
            cache_seqlens=_numpy(cache_seqlens, "cache_seqlens"),
            block_table=_numpy(block_table, "block_table"),
            num_splits=num_splits,
            causal=bool(causal) and ring.rank == tail,
            scale=scale,
            softcap=softcap,
            return_lse=True,
        )
    mine = torch.from_numpy(np.concatenate([out.astype(lse.dtype), lse[..., None]], axis=-1))
    parts = [torch.empty_like(mine) for _ in range(ring.size)]
    dist.all_gather(parts, mine, group=ring.group)
    out, lse = _merge_in_rank_order(parts)
    out = torch.from_numpy(np.ascontiguousarray(out)).to(q.dtype)
    return (out, torch.from_numpy(np.ascontiguousarray(lse))) if return_lse else out
