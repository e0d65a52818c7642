"""``context_parallel_decode``: decoding against a KV cache sharded across ranks.

Every rank holds part of each sequence's keys and values and the same new
queries. Each attends its own part with the split-KV kernel
(:func:`flashtile.decode_attention` for CPU tensors,
:func:`flashtile.triton.decode_attention` for CUDA tensors), then one
all-gather of the partial ``(out, lse)`` (``B * Hq * Tq * (dv + 1)`` numbers
per rank) lets every rank merge them by :func:`flashtile.merge_states`' rule,
in float32 and in rank order: every rank gets the same bits.
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from flashtile.merge import merge_partials, refuse_posinf

from . import kernels
from .comm import group_ring, with_device
from .faults import agree, dtype_code, guarded, messages
from .kernels import work_dtype
from .threads import kernel_threads


def _tail(tail_rank, size: int) -> int:
    if tail_rank is None:
        return size - 1
    if isinstance(tail_rank, bool) or not isinstance(tail_rank, numbers.Integral):
        raise TypeError(f"tail_rank must be an int or None, got {tail_rank!r}")
    if not 0 <= tail_rank < size:
        raise ValueError(f"tail_rank={tail_rank} is not a rank of this group of {size}")
    return int(tail_rank)


def _merge_in_rank_order(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = parts[0][..., :-1], parts[0][..., -1]
    for part in parts[1:]:
        out, lse = merge_partials(torch, out, lse, part[..., :-1], part[..., -1])
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
        q: ``(B, Hq, Tq, d)``, the same on every rank (the new tokens); a CPU
            tensor (gloo) or a CUDA tensor (NCCL).
        k_cache, v_cache: this rank's part of the cache, in any layout
            :func:`flashtile.decode_attention` takes (contiguous
            ``(B, Hkv, T_max, d)``, or paged with ``block_table``); float16,
            float32, float64 (bfloat16 is widened to float32 first on the CPU).
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
    team = group_ring(group)

    def local():  # this rank's part, before any message; every rank agrees it ran
        if not isinstance(q, torch.Tensor):
            raise TypeError(
                f"context_parallel_decode: q is a {type(q).__name__}, not a torch.Tensor"
            )
        cache = [t for t in (k_cache, v_cache) if isinstance(t, torch.Tensor)]
        ring, device = with_device(team, q, *cache)
        tail = _tail(tail_rank, ring.size)
        with kernel_threads(ring.size):
            out, lse = kernels.for_device(device).decode(
                q,
                k_cache,
                v_cache,
                cache_seqlens=cache_seqlens,
                block_table=block_table,
                num_splits=num_splits,
                causal=bool(causal) and ring.rank == tail,
                scale=scale,
                softcap=softcap,
            )
        work = work_dtype(q.dtype)
        refuse_posinf(torch, lse, "this rank's lse")  # merging it would give NaN
        mine = torch.cat([out.to(work), lse.to(work)[..., None]], dim=-1)
        return (ring, mine), (*mine.shape, dtype_code(mine.dtype), int(bool(causal)), tail)

    ring, mine = agree(team, local)
    with guarded(ring, "context_parallel_decode"), messages(ring):
        parts = [torch.empty_like(mine) for _ in range(ring.size)]
        dist.all_gather(parts, mine, group=ring.group)
    out, lse = _merge_in_rank_order(parts)
    out = out.to(q.dtype)
    return (out, lse.contiguous()) if return_lse else out
