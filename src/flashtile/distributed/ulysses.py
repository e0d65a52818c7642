"""``ulysses_attention``: re-shard from sequence to heads, attend locally, re-shard back.

DeepSpeed-Ulysses' scheme. With ``P`` ranks each holding ``T/P`` tokens of
all ``H`` heads, one all-to-all gives each rank all ``T`` tokens of ``H/P``
heads; flashtile attends them as one whole sequence (every variant works,
ALiBi included, since positions are the true ones), and a second all-to-all
returns each rank its tokens of every head. Each all-to-all moves
``(P-1)/P`` of the tensor it carries, whatever ``P``.
"""

from __future__ import annotations

import numpy as np
import torch

from .blocks import band, plan_blocks
from .comm import all_to_all, group_ring
from .engine import RingAttention, Setup
from .faults import agree, guarded, signature
from .inputs import check_variants, checked_shards, slopes_array
from .layout import LAYOUTS, chunk_size, to_layout_order, to_sequence_order


class _AllToAll(torch.autograd.Function):
    """:func:`.comm.all_to_all` on ``(P, ...)``; its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x, ring):
        ctx.ring = ring
        return all_to_all(x, ring)

    @staticmethod
    def backward(ctx, grad):
        with guarded(ctx.ring, "ulysses_attention's backward"):
            return all_to_all(grad, ctx.ring), None


def seq_to_heads(x: torch.Tensor, ring, layout: str) -> torch.Tensor:
    """``(B, H, T/P, d)`` sequence shards -> ``(B, H/P, T, d)`` in sequence order."""
    b, h, t, d = x.shape
    p = ring.size
    x = x.reshape(b, p, h // p, t, d).transpose(0, 1)  # slot r: the heads rank r gets
    x = _AllToAll.apply(x, ring)  # slot r: rank r's tokens of this rank's heads
    x = x.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * t, d)
    return to_sequence_order(x, p, layout, dim=2)


def heads_to_seq(y: torch.Tensor, ring, layout: str) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``(B, H/P, T, d)`` -> ``(B, H, T/P, d)``."""
    p = ring.size
    y = to_layout_order(y, p, layout, dim=2)
    b, h, t, d = y.shape
    y = y.reshape(b, h, p, t // p, d).permute(2, 0, 1, 3, 4)  # slot r: rank r's tokens
    y = _AllToAll.apply(y, ring)  # slot r: this rank's tokens of rank r's heads
    return y.transpose(0, 1).reshape(b, p * h, t // p, d)


def _local_slopes(alibi_slopes, hq: int, ring) -> np.ndarray | None:
    """This rank's heads' slopes: ``(Hq/P,)`` or ``(B, Hq/P)``."""
    if alibi_slopes is None:
        return None
    share = hq // ring.size
    return alibi_slopes[..., ring.rank * share : (ring.rank + 1) * share]


def ulysses_attention(
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
    """Attention over a sequence split across ranks, by all-to-all from tokens to heads.

    The same call and result as :func:`~flashtile.distributed.ring_attention`
    (see it for the arguments), with two differences: ``alibi_slopes``
    (``(Hq,)`` or ``(B, Hq)``, for the whole model's heads) is supported, and
    the query heads ``Hq`` and the kv heads ``Hkv`` must each be a multiple of
    the world size. Differentiable; the backward runs the two all-to-alls in
    reverse.
    """
    team = group_ring(group)

    def setup() -> Setup:  # every check, on every rank, before any message
        ring, local = checked_shards(team, q, k, v, enable_gqa, layout, "ulysses_attention")
        hq, hkv, t_local = q.shape[1], k.shape[1], q.shape[2]
        if hq % ring.size or hkv % ring.size:
            raise ValueError(
                f"ulysses_attention splits heads across the {ring.size} ranks: Hq={hq} and "
                f"Hkv={hkv} must both be multiples of {ring.size}; use ring_attention, which has "
                f"no such limit"
            )
        total = t_local * ring.size
        detail = f" ({t_local} tokens per rank x {ring.size} ranks)"
        chunk_size(total, ring.size, layout, detail=detail)
        all_slopes = slopes_array(alibi_slopes)
        check_variants(q, scale, softcap, all_slopes)
        whole = [(0, total)]
        steps = (tuple(plan_blocks(whole, whole, *band(causal, window))),)
        slopes = _local_slopes(all_slopes, hq, ring)
        keywords = {"scale": scale, "softcap": softcap, "alibi_slopes": slopes}
        setup = Setup(None, steps, keywords, local, procs=ring.size, peers=ring)
        return setup, signature(q, k, v, causal, LAYOUTS.index(layout), window)

    local = agree(team, setup)
    ring = local.peers
    with guarded(ring, "ulysses_attention"):
        qh, kh, vh = (seq_to_heads(x, ring, layout) for x in (q, k, v))
        out, lse = RingAttention.apply(qh, kh, vh, local)
        out = heads_to_seq(out, ring, layout)
        if return_lse:
            lse = heads_to_seq(lse.unsqueeze(-1), ring, layout).squeeze(-1)
    return (out, lse) if return_lse else out
