"""The attention operators under ``torch.vmap``: one batching rule for both backends.

A vmapped dimension is one more batch dimension for attention: the rule
moves it to the front of every tensor that has it, gives the tensors that
do not have it the same leading size (a stride-0 ``expand``, copied by the
kernels only where they need contiguous rows), folds it into the batch axis
``B`` and calls the operator once; the results are unfolded again. So
``torch.vmap(flashtile.torch.attention)`` computes what a loop over the
vmapped dimension would, in one kernel call, and ``torch.func.grad`` and
``jacrev`` (through :class:`flashtile.op_autograd.FuncAttention`) compose
with it: per-sample gradients run the backward operator under the same rule.

Each operator describes its arguments to :func:`register` (:class:`Arg`):
per-query tensors (q, k, v, ``out``, ``dout`` and ``lse``) always have the
batch axis; constants have it at one rank (a 4-D ``mask`` whose first axis
is ``B`` or 1, ``(B, Hq)`` ALiBi slopes, ``(B,)`` ``kv_lengths``) and are
shared by every vmapped entry below it; packed sequence offsets cannot be
folded and are refused. 3-D ``(H, T, d)`` inputs get the vmapped dimension
as their ``B``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Arg(NamedTuple):
    """One operator argument, for the batching rule: ``kind`` is ``"query"`` (a
    per-query tensor whose first axis is the batch at ``rank``), ``"constant"``
    (a batch axis only at ``rank``), ``"packed"`` (offsets of packed
    sequences: refused under vmap), ``"shared"`` (one tensor for every batch
    entry: refused when vmapped itself), ``"refused"`` (a feature that cannot
    run under vmap: refused when given, ``what`` names it) or ``"value"``
    (not a tensor)."""

    name: str
    kind: str = "value"
    rank: int = 0
    what: str = ""


def query(name: str, rank: int = 4) -> Arg:
    return Arg(name, "query", rank)


def constant(name: str, rank: int) -> Arg:
    return Arg(name, "constant", rank)


def shared(name: str) -> Arg:
    return Arg(name, "shared")


def refused(name: str, what: str) -> Arg:
    return Arg(name, "refused", what=what)


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

    def fold(self, arg: Arg, t, dim):
        """One argument of the folded call."""
        if arg.kind == "value" or t is None:
            return t
        if arg.kind == "refused":
            raise ValueError(
                f"flashtile's attention {arg.what} cannot run under torch.vmap (nor "
                f"torch.func.jacrev or per-sample gradients, which vmap): folding the vmapped "
                f"dimension into the batch would change its result; call it outside vmap"
            )
        if arg.kind == "shared":
            if dim is not None:
                raise ValueError(
                    f"{arg.name} is vmapped, but flashtile takes one {arg.name} for every "
                    f"batch entry: vmap over q, k and v with {arg.name} unbatched"
                )
            return t
        if arg.kind == "packed":
            raise ValueError(
                f"{arg.name}: packed variable-length attention cannot run under torch.vmap "
                f"(nor jacrev, which vmaps over the cotangents): its batch axis holds the "
                f"packed sequences; use padded (B, H, T, d) batches with kv_lengths instead"
            )
        if arg.kind == "query":
            if self.lifted:
                t, dim = _lift(t, dim)
            return _fold(t, dim, self.size, self.batch, arg.rank)
        if self.lifted and dim is not None and _logical_rank(t, dim) == arg.rank:
            shape = tuple(n for i, n in enumerate(t.shape) if i != dim)  # one entry's
            raise ValueError(  # as the unbatched call refuses it
                f"{arg.name} of shape {shape} under vmap: a per-batch {arg.name} needs 4-D "
                f"(B, H, T, d) inputs; with (H, T, d) inputs pass one without a batch axis"
            )
        # A shared constant folds to a stride-0 view: each op's own boundary makes
        # dense what its kernels index without strides (triton/ops._variants).
        return _fold(t, dim, self.size, self.batch, arg.rank)

    def unfold(self, t: torch.Tensor) -> torch.Tensor:
        """A result of the folded call with the vmapped dimension first again."""
        t = t.reshape(self.size, self.batch, *t.shape[1:])
        return t[:, 0] if self.lifted else t


def register(op, args: tuple[Arg, ...], q_at: int) -> None:
    """Register the batching rule of ``op`` (a custom op or its name) whose
    positional arguments are ``args``; ``q_at``: the index of ``q`` (the
    tensor whose rank tells 3-D from 4-D inputs)."""

    def rule(info, in_dims, *values):
        missing = len(args) - len(values)  # trailing defaults the dispatcher left out
        values, in_dims = (*values, *(None,) * missing), (*in_dims, *(None,) * missing)
        fold = _Folding(info, values[q_at], in_dims[q_at])
        folded = [fold.fold(a, t, d) for a, t, d in zip(args, values, in_dims, strict=True)]
        results = op(*folded)
        return tuple(fold.unfold(r) for r in results), (0,) * len(results)

    torch.library.register_vmap(op, rule)
