"""``ring_attention``: exact attention over a sequence sharded across the ranks of a group."""

from __future__ import annotations

from .blocks import band, plan_blocks
from .comm import group_ring
from .engine import RingAttention, Setup
from .faults import agree, signature
from .inputs import check_variants, checked_shards, slopes_array
from .layout import LAYOUTS, chunk_size, segments


def plan_ring(ring, t_local: int, layout: str, causal: bool, window) -> tuple:
    """The blocks of every step for this rank: ``steps[s]`` meets rank ``rank - s``'s keys."""
    p = ring.size
    total = t_local * p
    chunk_size(total, p, layout, detail=f" ({t_local} tokens per rank x {p} ranks)")
    lo, hi = band(causal, window)
    mine = segments(total, ring.rank, p, layout)
    return tuple(
        tuple(plan_blocks(mine, segments(total, (ring.rank - s) % p, p, layout), lo, hi))
        for s in range(p)
    )


def ring_attention(
    q,
    k,
    v,
    *,
    group=None,
    causal=False,
    layout="zigzag",
    scale=None,
    window=None,
    softcap=None,
    alibi_slopes=None,
    enable_gqa=False,
    return_lse=False,
):
    """Attention over a sequence split across the ranks of ``group``, by passing K/V round a ring.

    Every rank calls it with its shard (:func:`~flashtile.distributed.shard_sequence`)
    and gets its shard of the result: exactly what one process would compute on
    the whole sequence with :func:`flashtile.attention`, up to rounding.

    Args:
        q: ``(B, Hq, T_local, d)``, this rank's queries: a CPU tensor (flashtile's
            CPU kernels) or a CUDA tensor (its Triton kernels, float16/bfloat16/float32).
        k, v: ``(B, Hkv, T_local, d)`` and ``(B, Hkv, T_local, dv)``, this
            rank's keys and values. Every rank passes the same shapes.
        group: a ``torch.distributed`` process group (default: the world);
            gloo for CPU tensors, NCCL for CUDA tensors.
        causal: each query sees the keys at or before its *global* position.
        layout: ``"zigzag"`` (default; the sequence length ``T = P * T_local``
            must be a multiple of ``2P``) or ``"contiguous"`` (a multiple of ``P``);
            see :mod:`flashtile.distributed.layout`.
        scale, softcap: as in :func:`flashtile.attention`.
        window: ``(left, right)`` by global positions: query ``p`` sees keys
            ``p - left .. p + right`` (None / -1: unbounded).
        alibi_slopes: not supported over more than one rank (its bias needs
            each pair's true distance); use :func:`ulysses_attention`.
        enable_gqa: allow ``Hkv != Hq`` (``Hq % Hkv == 0``); K/V travel with
            ``Hkv`` heads.
        return_lse: also return ``lse (B, Hq, T_local)`` (natural log,
            float32, or float64 for float64 inputs; no gradient).

    Returns:
        ``out (B, Hq, T_local, dv)`` in the input dtype, and ``lse`` if asked.
        Differentiable w.r.t. ``q``, ``k``, ``v``; the backward communicates
        too, so every rank must run it.

    Each of the ``P`` steps posts the next K/V exchange before computing
    (communication overlaps compute) and skips key blocks wholly outside a
    query block's causal range or window. Partial results merge in float32
    (float64 for float64 inputs) whatever the input dtype. Kernel threads:
    :mod:`flashtile.distributed.threads`. Failures: every rank refuses a call
    that one refuses, and an error on one rank mid-call makes the others
    raise too (:mod:`flashtile.distributed.faults`).
    """

    team = group_ring(group)

    def setup() -> Setup:  # every check, on every rank, before any message
        ring, local = checked_shards(team, q, k, v, enable_gqa, layout, "ring_attention")
        if alibi_slopes is not None and ring.size > 1:
            raise ValueError(
                "ring_attention does not support alibi_slopes over more than one rank: the "
                "ALiBi bias depends on each query-key distance across shards; use "
                "flashtile.distributed.ulysses_attention, which attends the whole sequence per "
                "head"
            )
        steps = plan_ring(ring, q.shape[2], layout, causal, window)
        slopes = slopes_array(alibi_slopes)
        check_variants(q, scale, softcap, slopes)
        keywords = {"scale": scale, "softcap": softcap, "alibi_slopes": slopes}
        setup = Setup(ring, steps, keywords, local, procs=ring.size, peers=ring)
        return setup, signature(q, k, v, causal, LAYOUTS.index(layout), window)

    out, lse = RingAttention.apply(q, k, v, agree(team, setup))
    return (out, lse) if return_lse else out
