"""The ring loops, forward and backward, and the autograd function around them.

Forward, on every rank, for ``step = 0 .. P-1`` (the K/V shard of rank
``rank - step`` is here)::

    post: send this K/V to rank+1, receive the next from rank-1   (before computing)
    for each block of local queries x these keys (:mod:`.blocks`):
        (o, l) = flashtile.attention(block)                          # exact over the block
        (out, lse)[rows] = merge_states((out, lse)[rows], (o, l))   # float32 / float64
    wait

Backward, from the saved global ``out`` and ``lse`` (no probabilities kept):
``flashtile.attention_backward`` of one block with the *global* ``out`` and
``lse`` gives that block's exact share of ``dq``, ``dk`` and ``dv``. K/V go
round again; next to them travels a ``dK/dV`` buffer for the shard's owner to
which each rank adds its share, and a last hop returns it to the owner. The
sums run in one fixed order (owner, owner+1, ...), so gradients are
bit-identical from run to run.

K/V travel in the input dtype (16-bit inputs send 16-bit bytes) and are
widened per step; ``dK/dV`` travel in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import flashtile

from .comm import Ring, shift, wait
from .inputs import as_work, work_dtype
from .threads import kernel_threads


@dataclass(frozen=True)
class Setup:
    """One call's plan: the ring (None = no communication), the blocks of each
    step (``steps[s]``: against the K/V of rank ``rank - s``), the
    position-free keywords passed to every block, and how many processes share
    the node's cores (for :func:`.threads.kernel_threads`)."""

    ring: Ring | None
    steps: tuple
    keywords: dict
    procs: int = 1

    @property
    def size(self) -> int:
        return 1 if self.ring is None else self.ring.size


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.detach().reshape(-1), v.detach().reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape, v_shape, work) -> tuple[np.ndarray, np.ndarray]:
    n = int(np.prod(k_shape))
    return as_work(buf[:n].view(k_shape), work), as_work(buf[n:].view(v_shape), work)


def _rows(a: np.ndarray, blk) -> np.ndarray:
    return a[:, :, blk.q0 : blk.q1]


def _cols(a: np.ndarray, blk) -> np.ndarray:
    return a[:, :, blk.k0 : blk.k1]


def ring_forward(setup: Setup, q, k, v) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` of this rank's queries over every rank's keys, in the work dtype."""
    work = work_dtype(q.dtype)
    qn = as_work(q, work)
    out = np.zeros(q.shape[:-1] + v.shape[-1:], dtype=qn.dtype)
    lse = np.full(q.shape[:-1], -np.inf, dtype=qn.dtype)
    seen = np.zeros(q.shape[2], dtype=bool)  # rows that hold a partial result already
    kv = _pack(k, v)
    spare = torch.empty_like(kv)
    for step, blocks in enumerate(setup.steps):
        works = shift(setup.ring, kv, spare) if step < setup.size - 1 else None
        if blocks:
            kn, vn = _unpack(kv, k.shape, v.shape, work)
        for blk in blocks:
            o, o_lse = flashtile.attention(
                _rows(qn, blk),
                _cols(kn, blk),
                _cols(vn, blk),
                return_lse=True,
                **blk.kwargs(),
                **setup.keywords,
            )
            if seen[blk.q0 : blk.q1].any():
                o, o_lse = flashtile.merge_states(_rows(out, blk), _rows(lse, blk), o, o_lse)
            # else: merging into the empty state would give (o, o_lse) bit for bit
            out[:, :, blk.q0 : blk.q1], lse[:, :, blk.q0 : blk.q1] = o, o_lse
            seen[blk.q0 : blk.q1] = True
        wait(works)
        kv, spare = spare, kv
    return out, lse


def _block_grads(setup: Setup, blocks, arrays, kv_arrays, dq, dkv_arrays) -> None:
    """Add each block's exact gradient shares into ``dq`` and the K/V owner's ``dk/dv``."""
    qn, outn, lse, doutn = arrays
    kn, vn = kv_arrays
    dkn, dvn = dkv_arrays
    for blk in blocks:
        gq, gk, gv = flashtile.attention_backward(
            _rows(qn, blk),
            _cols(kn, blk),
            _cols(vn, blk),
            _rows(outn, blk),
            _rows(lse, blk),
            _rows(doutn, blk),
            **blk.kwargs(),
            **setup.keywords,
        )
        _rows(dq, blk)[...] += gq
        _cols(dkn, blk)[...] += gk
        _cols(dvn, blk)[...] += gv


def ring_backward(setup: Setup, q, k, v, out, lse, dout):
    """``(dq, dk, dv)`` in the work dtype for this rank's q and its own k, v."""
    work = work_dtype(q.dtype)
    arrays = (as_work(q, work), as_work(out, work), as_work(lse, work), as_work(dout, work))
    dq = np.zeros(q.shape, dtype=arrays[0].dtype)
    kv = _pack(k, v)
    spare = torch.empty_like(kv)
    incoming = sending = dkv_works = None
    last = setup.size - 1
    for step, blocks in enumerate(setup.steps):
        kv_works = shift(setup.ring, kv, spare) if step < last else None
        dkv = torch.zeros(kv.numel(), dtype=work)
        if blocks:
            kv_arrays = _unpack(kv, k.shape, v.shape, work)
            _block_grads(setup, blocks, arrays, kv_arrays, dq, _unpack(dkv, k.shape, v.shape, work))
        if step > 0:
            wait(dkv_works)  # the shares of the ranks before this one, for the same owner
            dkv = incoming + dkv
        if last > 0:
            sending, incoming = dkv, torch.empty_like(dkv)
            dkv_works = shift(setup.ring, sending, incoming, tag=1)
        wait(kv_works)
        kv, spare = spare, kv
    if last > 0:
        wait(dkv_works)  # the last hop brings this rank its own total
        dkv = incoming
    del sending
    dk, dv = _unpack(dkv, k.shape, v.shape, work)
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """``(out, lse)`` of :func:`ring_forward`; the backward runs :func:`ring_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, setup: Setup):
        with kernel_threads(setup.procs):
            out, lse = ring_forward(setup, q, k, v)
        out, lse = torch.from_numpy(out), torch.from_numpy(lse)
        ctx.setup = setup
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with kernel_threads(ctx.setup.procs):
            grads = ring_backward(ctx.setup, q, k, v, out, lse, dout)
        dq, dk, dv = (
            torch.from_numpy(g).to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)
        )
        return dq, dk, dv, None
