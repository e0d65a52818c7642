"""The operators under ``torch.func``: batching rules for ``torch.vmap``.

A vmapped dimension is one more batch dimension for attention: the rules
move it to the front of every tensor that has it, give the tensors that do
not have it the same leading size (a stride-0 ``expand``, copied by the
kernels only where they need contiguous rows), fold it into the batch axis
``B`` and call the operator once; the results are unfolded again. So
``torch.vmap(flashtile.torch.attention)`` computes what a loop over the
vmapped dimension would, in one kernel call, and ``torch.func.grad`` and
``jacrev`` (through the ops' autograd formula) compose with it: per-sample
gradients run ``attention_bwd`` under the same rule.

The constants fold the same way where they have a batch axis: a 4-D
``mask`` (its first axis is ``B`` or 1), ``(B, Hq)`` ALiBi slopes and
``(B,)`` ``kv_lengths``; a constant without one is shared by every vmapped
entry. 3-D ``(H, T, d)`` inputs get the vmapped dimension as their ``B``.
"""

from __future__ import annotations

import torch

from . import _ops

#: Ranks of the constants at which their first axis is the batch ``B``.
_MASK, _SLOPES, _LENGTHS = 4, 2, 1


def _logical_rank(t: torch.Tensor, dim: int | None) -> int:
    return t.dim() - (dim is not None)


def _lift(t: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, int | None]:
    """A 3-D ``(H, T, d)`` argument (or its 2-D ``lse``) with a batch axis of 1
    in front, and its vmapped dimension moved first."""
    if dim is None:
        return t.unsqueeze(0), None
    return t.movedim(dim, 0).unsqueeze(1), 0


def _fold(t: torch.Tensor | None, dim: int | None, size: int, batch: int, rank: int):
    """``t`` as the folded call's argument: its vmapped dimension (of ``size``)
    folded into the batch axis ``batch`` of the call.

    ``rank``: the rank at which ``t``'s first axis is the batch (4 for q, k,
    v, ``out``, ``dout`` and a 4-D mask; 3 for ``lse``; 2 for per-batch
    slopes; 1 for ``kv_lengths``). A constant of lower rank has no batch
    axis: shared as it is when not vmapped, given one of size 1 (which
    broadcasts) when it is.
    """
    if t is None:
        return None
    ndim = _logical_rank(t, dim)
    if dim is None:
        if ndim != rank:
            return t  # no batch axis, not vmapped: shared by every entry
        t = t.expand(size, *t.shape)
    else:
        t = t.movedim(dim, 0)
        if ndim != rank:  # broadcast dims in front, up to the batch axis
            t = t.reshape(size, *(1,) * (rank - ndim), *t.shape[1:])
    t = t.expand(size, batch, *t.shape[2:])  # a batch axis of 1 broadcasts
    return t.reshape(size * batch, *t.shape[2:])


class _Folding:
    """How one vmapped call is folded: the vmapped size, the call's batch, and
    whether its inputs were 3-D (lifted to a batch of 1)."""

    def __init__(self, info, q, q_dim):
        self.size = info.batch_size
        self.lifted = _logical_rank(q, q_dim) == 3
        shape = list(q.shape)
        if q_dim is not None:
            del shape[q_dim]
        self.batch = 1 if self.lifted else shape[0]

    def per_query(self, t, dim, rank):
        """q, k, v, ``out``, ``dout`` (``rank`` 4) or ``lse`` (3), folded."""
        if self.lifted:
            t, dim = _lift(t, dim)
        return _fold(t, dim, self.size, self.batch, rank)

    def constant(self, t, dim, rank):
        return _fold(t, dim, self.size, self.batch, rank)

    def unfold(self, t: torch.Tensor) -> torch.Tensor:
        """A result of the folded call with the vmapped dimension first again."""
        t = t.reshape(self.size, self.batch, *t.shape[1:])
        return t[:, 0] if self.lifted else t


def _lengths_dim(in_dims, at: int):
    """The vmapped dim of ``kv_lengths`` (the last argument, left out of the
    call when it is the default None)."""
    return in_dims[at] if len(in_dims) > at else None


@torch.library.register_vmap("flashtile::attention_fwd")
def _attention_fwd_vmap(
    info, in_dims, q, k, v, mask, alibi_slopes, causal, scale, left, right, softcap,
    kv_lengths=None,
):  # fmt: skip
    """``attention_fwd`` over a vmapped dimension: one call with it folded into ``B``."""
    fold = _Folding(info, q, in_dims[0])
    dq, dk, dv, dm, da = in_dims[:5]
    if fold.lifted and alibi_slopes is not None and _logical_rank(alibi_slopes, da) == _SLOPES:
        shape = [n for i, n in enumerate(alibi_slopes.shape) if i != da]  # one entry's
        shape = tuple(shape)  # refused as the unbatched call refuses it (variants.py)
        raise ValueError(
            f"alibi_slopes of shape {shape} under vmap: per-batch slopes (B, Hq) need 4-D "
            f"(B, H, T, d) inputs; with (H, T, d) inputs pass (Hq,) slopes"
        )
    out, lse = _ops.attention_fwd(
        fold.per_query(q, dq, 4), fold.per_query(k, dk, 4), fold.per_query(v, dv, 4),
        fold.constant(mask, dm, _MASK), fold.constant(alibi_slopes, da, _SLOPES), causal,
        scale, left, right, softcap, fold.constant(kv_lengths, _lengths_dim(in_dims, 10), _LENGTHS),
    )  # fmt: skip
    return (fold.unfold(out), fold.unfold(lse)), (0, 0)


@torch.library.register_vmap("flashtile::attention_bwd")
def _attention_bwd_vmap(
    info, in_dims, dout, q, k, v, out, lse, mask, alibi_slopes, causal, scale, left, right,
    softcap, kv_lengths=None,
):  # fmt: skip
    """``attention_bwd`` over a vmapped dimension (per-sample gradients)."""
    fold = _Folding(info, q, in_dims[1])
    ranks = (4, 4, 4, 4, 4, 3)
    tensors = [
        fold.per_query(t, d, r)
        for t, d, r in zip((dout, q, k, v, out, lse), in_dims[:6], ranks, strict=True)
    ]
    grads = _ops.attention_bwd(
        *tensors, fold.constant(mask, in_dims[6], _MASK),
        fold.constant(alibi_slopes, in_dims[7], _SLOPES), causal, scale, left, right, softcap,
        fold.constant(kv_lengths, _lengths_dim(in_dims, 13), _LENGTHS),
    )  # fmt: skip
    return tuple(fold.unfold(g) for g in grads), (0, 0, 0)
