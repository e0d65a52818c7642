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

from . import kernels
from .blocks import band, plan_blocks
from .comm import all_to_all, ring_of
from .engine import RingAttention, Setup
from .inputs import check_qkv, check_variants, slopes_array
from .layout import check_layout, chunk_size, to_layout_order, to_sequence_order


class _AllToAll(torch.autograd.Function):
    """:func:`.comm.all_to_all` on ``(P, ...)``; its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, ring, layout: str) -> torch.Tensor:
    """``(B, H, T/P, d)`` sequence shards -> ``(B, H/P, T, d)`` in sequence order."""
    b, h, t, d = x.shape
    p = ring.size
    x = x.reshape(b, p, h // p, t, d).transpose(0, 1)  # slot r: the heads rank r gets
    x = _AllToAll.apply(x, ring.group)  # slot r: rank r's tokens of this rank's heads
    x = x.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * t, d)
    return to_sequence_order(x, p, layout, dim=2)


def heads_to_seq(y: torch.Tensor, ring, layout: str) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``(B, H/P, T, d)`` -> ``(B, H, T/P, d)``."""
    p = ring.size
    y = to_layout_order(y, p, layout, dim=2)
    b, h, t, d = y.shape
    y = y.reshape(b, h, p, t // p, d).permute(2, 0, 1, 3, 4)  # slot r: rank r's tokens
    y = _AllToAll.apply(y, ring.group)  # slot r: this rank's tokens of rank r's heads
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
    check_layout(layout)
    check_qkv(q, k, v, enable_gqa, "ulysses_attention")
    ring, device = ring_of(group, q, k, v)
    local = kernels.for_device(device)
    local.check(q, k, v)  # before any message is posted
    hq, hkv, t_local = q.shape[1], k.shape[1], q.shape[2]
    if hq % ring.size or hkv % ring.size:
        raise ValueError(
            f"ulysses_attention splits heads across the {ring.size} ranks: Hq={hq} and Hkv={hkv} "
            f"must both be multiples of {ring.size}; use ring_attention, which has no such limit"
        )
    total = t_local * ring.size
    chunk_size(total, ring.size, layout, detail=f" ({t_local} tokens per rank x {ring.size} ranks)")
    alibi_slopes = slopes_array(alibi_slopes)
    check_variants(q, scale, softcap, alibi_slopes)
    slopes = _local_slopes(alibi_slopes, hq, ring)
    whole = [(0, total)]
    steps = (tuple(plan_blocks(whole, whole, *band(causal, window))),)
    keywords = {"scale": scale, "softcap": softcap, "alibi_slopes": slopes}
    qh, kh, vh = (seq_to_heads(x, ring, layout) for x in (q, k, v))
    out, lse = RingAttention.apply(qh, kh, vh, Setup(None, steps, keywords, local, procs=ring.size))
    out = heads_to_seq(out, ring, layout)
    if not return_lse:
        return out
    return out, heads_to_seq(lse.unsqueeze(-1), ring, layout).squeeze(-1)
