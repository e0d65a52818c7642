"""The ring loops, forward and backward, and the autograd function around them.

Forward, on every rank, for ``step = 0 .. P-1`` (the K/V shard of rank
``rank - step`` is here)::

    post: send this K/V to rank+1, receive the next from rank-1   (before computing)
    for each block of local queries x these keys (:mod:`.blocks`):
        (o, l) = flashtile.attention(block)                          # exact over the block
        (out, lse)[rows] = merge((out, lse)[rows], (o, l))   # float32 / float64
    wait

Backward, from the saved global ``out`` and ``lse`` (no probabilities kept):
the backward kernel on one block with the *global* ``out`` and ``lse``
(:func:`flashtile.gradients.block_gradients`) gives that block's exact share
of ``dq``, ``dk`` and ``dv``, and its rows' share of the sums of ``P``. K/V go
round again; next to them travels a ``dK/dV`` buffer for the shard's owner to
which each rank adds its share, and a last hop returns it to the owner. The
sums run in one fixed order (owner, owner+1, ...), so gradients are
bit-identical from run to run. Then the backward's precision rule, on every
rank together (:func:`trusted_backward`).

K/V travel in the input dtype (16-bit inputs send 16-bit bytes); each block
runs on the device's kernels (:mod:`.kernels`: flashtile's CPU kernels in
float32, or its Triton kernels in the input dtype); partial results merge and
``dK/dV`` travel in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashtile.gradients import refusal
from flashtile.merge import merge_partials, refuse_posinf
from flashtile.precision import failing_rows

from .comm import Ring, shift
from .faults import agree, any_rank, guarded, wait
from .kernels import LocalKernels, work_dtype
from .threads import kernel_threads


@dataclass(frozen=True)
class Setup:
    """One call's plan: the ring (None = no communication), the blocks of each
    step (``steps[s]``: against the K/V of rank ``rank - s``), the
    position-free keywords passed to every block, the local kernels, and how
    many processes share the node's cores (for :func:`.threads.kernel_threads`);
    ``peers``: the ranks that must hear of a failure here (:func:`.faults.guarded`;
    Ulysses attends locally, between two exchanges of its group)."""

    ring: Ring | None
    steps: tuple
    keywords: dict
    kernels: LocalKernels
    procs: int = 1
    peers: Ring | None = None

    @property
    def size(self) -> int:
        return 1 if self.ring is None else self.ring.size


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.detach().reshape(-1), v.detach().reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape, v_shape, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    n = math.prod(k_shape)
    return buf[:n].view(k_shape).to(dtype), buf[n:].view(v_shape).to(dtype)


def _rows(a: torch.Tensor, blk) -> torch.Tensor:
    """Rows ``[q0, q1)`` of a ``(B, H, T, ...)`` tensor (``lse (B, H, T)`` too)."""
    return a[:, :, blk.q0 : blk.q1]


def _cols(a: torch.Tensor, blk) -> torch.Tensor:
    return a[:, :, blk.k0 : blk.k1]


def ring_forward(setup: Setup, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of this rank's queries over every rank's keys, in the work dtype."""
    work, compute = work_dtype(q.dtype), setup.kernels.compute(q.dtype)
    qc = q.detach().to(compute)
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=work, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=work, device=q.device)
    seen = [False] * q.shape[2]  # rows that hold a partial result already
    kv = _pack(k, v)
    spare = torch.empty_like(kv)
    for step, blocks in enumerate(setup.steps):
        works = shift(setup.ring, kv, spare) if step < setup.size - 1 else None
        if blocks:
            kc, vc = _unpack(kv, k.shape, v.shape, compute)
        for blk in blocks:
            o, o_lse = setup.kernels.attend(
                _rows(qc, blk), _cols(kc, blk), _cols(vc, blk), **blk.kwargs(), **setup.keywords
            )
            o, o_lse = o.to(work), o_lse.to(work)
            refuse_posinf(torch, o_lse, "a block's lse")  # merging it would give NaN
            if any(seen[blk.q0 : blk.q1]):
                o, o_lse = merge_partials(torch, _rows(out, blk), _rows(lse, blk), o, o_lse)
            # else: merging into the empty state would give (o, o_lse) bit for bit
            _rows(out, blk).copy_(o)
            _rows(lse, blk).copy_(o_lse)
            seen[blk.q0 : blk.q1] = [True] * (blk.q1 - blk.q0)
        wait(works, setup.ring)
        kv, spare = spare, kv
    return out, lse


def _block_grads(setup: Setup, blocks, tensors, kv_tensors, dq, dkv_tensors, sums) -> None:
    """Add each block's exact gradient shares into ``dq`` and the K/V owner's
    ``dk/dv``, and its rows' sums of ``P`` into ``sums`` (where reported)."""
    qc, outc, lse, doutc = tensors
    kc, vc = kv_tensors
    dk, dv = dkv_tensors
    for blk in blocks:
        gq, gk, gv, block_sums = setup.kernels.grads(
            _rows(qc, blk),
            _cols(kc, blk),
            _cols(vc, blk),
            _rows(outc, blk),
            _rows(lse, blk),
            _rows(doutc, blk),
            **blk.kwargs(),
            **setup.keywords,
        )
        _rows(dq, blk).add_(gq)
        _cols(dk, blk).add_(gk)
        _cols(dv, blk).add_(gv)
        if block_sums is not None:
            _rows(sums, blk).add_(block_sums)


def ring_backward(setup: Setup, q, k, v, out, lse, dout):
    """``(dq, dk, dv, sums)`` in the work dtype for this rank's q and its own
    k, v; ``sums``: each local query row's sum of the recomputed
    probabilities over every rank's keys (zeros where the kernels do not
    report them)."""
    work, compute = work_dtype(q.dtype), setup.kernels.compute(q.dtype)
    qc, outc, doutc = (t.detach().to(compute) for t in (q, out, dout))
    tensors = (qc, outc, lse.detach(), doutc)
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    sums = torch.zeros(q.shape[:-1], dtype=work, device=q.device)
    kv = _pack(k, v)
    spare = torch.empty_like(kv)
    incoming = sending = dkv_works = None
    last = setup.size - 1
    for step, blocks in enumerate(setup.steps):
        kv_works = shift(setup.ring, kv, spare) if step < last else None
        dkv = torch.zeros(kv.numel(), dtype=work, device=q.device)
        if blocks:
            kv_tensors = _unpack(kv, k.shape, v.shape, compute)
            dkv_tensors = _unpack(dkv, k.shape, v.shape, work)
            _block_grads(setup, blocks, tensors, kv_tensors, dq, dkv_tensors, sums)
        if step > 0:
            wait(dkv_works, setup.ring)  # the shares of the ranks before, for the same owner
            dkv = incoming + dkv
        if last > 0:
            sending, incoming = dkv, torch.empty_like(dkv)
            dkv_works = shift(setup.ring, sending, incoming, tag=1)
        wait(kv_works, setup.ring)
        kv, spare = spare, kv
    if last > 0:
        wait(dkv_works, setup.ring)  # the last hop brings this rank its own total
        dkv = incoming
    del sending
    dk, dv = _unpack(dkv, k.shape, v.shape, work)
    return dq, dk, dv, sums


def trusted_backward(setup: Setup, q, k, v, out, lse, dout):
    """``((dq, dk, dv), problem)``: :func:`ring_backward` under the backward's
    precision rule (:mod:`flashtile.gradients`), decided by every rank
    together: if any rank's rows fail it, every rank computes the forward and
    the backward again in float64 (the ring's messages included).
    ``problem``: None without a float64 attempt; after one, the refusal
    where it still fails here ("" where not), which the caller raises on
    every rank with :func:`.faults.agree` once the messages are done. CUDA
    rings skip the rule (the Triton kernels have no float64 to redo in)."""
    *grads, sums = ring_backward(setup, q, k, v, out, lse, dout)
    if setup.kernels.name != "cpu":
        return grads, None
    if not any_rank(setup.peers, _failing(sums, lse, dout)):
        return grads, None
    wide = tuple(t.detach().double() for t in (q, k, v))
    out, lse = ring_forward(setup, *wide)
    *grads, sums = ring_backward(setup, *wide, out, lse, dout)
    if _failing(sums, lse, dout):
        return grads, refusal(lse.numpy(), dout.double().numpy(), "the ring's backward")
    return grads, ""


def _failing(sums, lse, dout) -> bool:
    """:func:`flashtile.precision.failing_rows` among the rows with a nonzero ``dout``."""
    return bool((failing_rows(torch, sums, lse.detach(), None) & (dout != 0).any(-1)).any())


class RingAttention(torch.autograd.Function):
    """``(out, lse)`` of :func:`ring_forward`; the backward runs :func:`ring_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, setup: Setup):
        with kernel_threads(setup.procs), guarded(setup.peers, "the forward"):
            out, lse = ring_forward(setup, q, k, v)
        ctx.setup = setup
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        setup = ctx.setup
        with kernel_threads(setup.procs), guarded(setup.peers, "the backward"):
            grads, problem = trusted_backward(setup, q, k, v, out, lse, dout)
        if problem is not None:  # float64 was tried on every rank: they refuse together
            agree(setup.peers, lambda: (_refuse(problem), ()), "after its messages")
        dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))
        return dq, dk, dv, None


def _refuse(problem: str) -> None:
    if problem:
        raise ValueError(problem)
