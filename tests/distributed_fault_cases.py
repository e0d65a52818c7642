"""Cases of ``tests/test_distributed.py`` for issue 33: a failure on one rank
reaches every rank promptly (faults), and the backward's precision rule is
decided by every rank together (a rank whose rows need float64 takes every
rank there; a refusal is every rank's)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import flashtile
import flashtile.distributed as fd
from dense import rel_err
from distributed_cases import case, small_shard

# ------------------------------------------------------------------ faults
# Each case runs on a group of its own (a failure leaves its group unusable:
# the failed rank closes its connections); the world group stays whole.

#: Seconds within which every surviving rank must raise.
FAULT_SECONDS = 10
#: The timeout of each case's own group: past it a wait raises (well within
#: the world group's 90 s, so that a hung case fails alone, with its traceback).
GROUP_SECONDS = 45


def _inject(rank, world, run, *, kernel, after, expect_refusal=False):
    """Rank 1's ``kernel`` (of the CPU kernels: attend, grads, decode) raises
    on its call after the first ``after``; every rank runs ``run(group)``
    twice (a rank that needed nothing more from rank 1 finishes its first
    call, whole, and meets the failure in the next) and must raise within
    FAULT_SECONDS: rank 1 its own error, the others PeerFailure naming it
    (ValueError with ``expect_refusal``: the fault came before any message,
    and the group still works)."""
    import dataclasses

    from flashtile.distributed import kernels
    from flashtile.distributed.faults import PeerFailure

    # (a rank still waiting after GROUP_SECONDS raises: the case fails, the world goes on)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_SECONDS))
    saved, calls = kernels.CPU, [0]
    injected = RuntimeError(f"injected into {kernel}")

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] > after:
            raise injected
        return getattr(saved, kernel)(*args, **kwargs)

    if rank == 1:
        kernels.CPU = dataclasses.replace(saved, **{kernel: failing})
    start, error = time.perf_counter(), None
    try:
        run(group)
        run(group)
    except Exception as exc:  # (pytest.raises' failure would end the whole world)
        error = exc
    finally:
        kernels.CPU = saved
    took = time.perf_counter() - start
    assert took < FAULT_SECONDS, f"rank {rank} raised after {took:.1f} s"
    if rank == 1:
        assert error is injected, repr(error)
    elif expect_refusal:
        assert isinstance(error, ValueError), repr(error)
        assert "rank 1 of the group refused" in str(error)
    else:
        assert isinstance(error, PeerFailure), repr(error)
        assert "rank 1 of the group failed" in str(error), str(error)
        assert "injected into" in str(error), str(error)
    if expect_refusal:  # nothing was in flight: the group works
        fd.ring_attention(*(torch.zeros(1, 2, 2 * world, 4),) * 3, group=group)


@case(2, 4)
def a_failure_mid_ring_forward_reaches_every_rank(rank, world):
    def run(group):
        x = small_shard(world)
        fd.ring_attention(x, x, x, group=group, causal=True)

    _inject(rank, world, run, kernel="attend", after=1)


@case(2, 3)
def a_failure_in_the_ring_backward_reaches_every_rank(rank, world):
    def run(group):
        x = small_shard(world, requires_grad=True)
        fd.ring_attention(x, x, x, group=group, layout="contiguous").sum().backward()

    _inject(rank, world, run, kernel="grads", after=world - 1)  # the last step


@case(2)
def a_failure_between_ulysses_exchanges_reaches_every_rank(rank, world):
    def run(group):
        x = small_shard(world)
        fd.ulysses_attention(x, x, x, group=group)

    _inject(rank, world, run, kernel="attend", after=0)


@case(3)
def a_decode_failure_is_refused_by_every_rank(rank, world):
    def run(group):
        q, cache = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
        fd.context_parallel_decode(q, cache, cache, group=group)

    _inject(rank, world, run, kernel="decode", after=0, expect_refusal=True)


@case(3)
def ranks_that_disagree_on_shapes_all_refuse(rank, world):
    x = torch.zeros(1, 2, 2 * (1 + (rank == 2)), 4)  # rank 2's shard is twice as long
    try:
        fd.ring_attention(x, x, x)
        raise AssertionError("not refused")
    except ValueError as exc:
        assert "disagree" in str(exc), str(exc)
    y = torch.zeros(1, 2, 2, 4, requires_grad=rank != 2)  # rank 2 would skip the backward
    try:
        fd.ring_attention(y, y, y)
        raise AssertionError("not refused")
    except ValueError as exc:
        assert "disagree" in str(exc), str(exc)
    fd.ring_attention(*(torch.zeros(1, 2, 2, 4),) * 3)  # nothing was in flight


# The whole matrix (FLASHTILE_FAULT_MATRIX=1 pytest tests/test_distributed.py,
# about a minute per world size; make test runs the few cases above): an
# exception on rank 1 at the first, second and last ring step, forward and
# backward, ring (contiguous, one block per step) and Ulysses, every world size.


def _matrix_case(fn, kernel, step):
    def run_case(rank, world):
        after = world - 1 if step == "last" else step

        def run(group):
            x = small_shard(world, requires_grad=kernel == "grads")
            out = fn(x, x, x, group=group, layout="contiguous")
            if kernel == "grads":
                out.sum().backward()

        _inject(rank, world, run, kernel=kernel, after=0 if fn is fd.ulysses_attention else after)

    return run_case


if os.environ.get("FLASHTILE_FAULT_MATRIX"):
    for _fn in (fd.ring_attention, fd.ulysses_attention):
        for _kernel in ("attend", "grads"):
            for _step in (0, 1, "last") if _fn is fd.ring_attention else (0,):
                _name = f"matrix_{_fn.__name__}_{_kernel}_at_step_{_step}"
                _run = _matrix_case(_fn, _kernel, _step)
                _run.__name__ = _name
                case()(_run)


# ------------------------------------------------------------------ the backward's precision rule


def _offset_case(world, rank, fn, *, offset, head=None):
    """Run ``fn`` (ring or Ulysses, contiguous layout) forward and backward in
    float32 on a problem whose rank-0 rows (of ``head`` only, or of every
    head) see every score raised by ``offset``: past float32's reach from
    1024 (:mod:`flashtile.precision`), so those rows need float64 while
    the others do not. Returns this rank's gradients and the float64
    one-process ones (sharded)."""
    rng = np.random.default_rng(7)
    q, k, v, dout = (rng.standard_normal((1, world, 4 * world, 8)) for _ in range(4))
    top = np.sqrt(offset * np.sqrt(8))  # q0 k0 / sqrt(d) = offset
    heads = slice(None) if head is None else slice(head, head + 1)
    q[:, heads, :4, 0], k[..., 0] = top, top  # rows :4 are rank 0's (contiguous)
    q, k, v, dout = (a.astype(np.float32).astype(np.float64) for a in (q, k, v, dout))

    def shard(x):
        return torch.from_numpy(fd.shard_sequence(x, rank, world, layout="contiguous", dim=-2))

    ours = [shard(x).float().requires_grad_() for x in (q, k, v)]
    fn(*ours, layout="contiguous").backward(shard(dout).float())  # (refused: raises here)
    out, lse = flashtile.attention(q, k, v, return_lse=True)
    refs = flashtile.attention_backward(q, k, v, out, lse, dout)
    pairs = zip(ours, refs, strict=True)
    return [rel_err(x.grad.double().numpy(), shard(r).numpy()) for x, r in pairs]


@case(2)
def ring_gradients_past_float32_are_computed_in_float64_on_every_rank(rank, world):
    errors = _offset_case(world, rank, fd.ring_attention, offset=5e3)
    assert max(errors) < 1e-5, f"rank {rank}: dq, dk, dv errors {errors}"


@case(2)
def ulysses_gradients_past_float32_are_computed_in_float64_on_every_rank(rank, world):
    errors = _offset_case(world, rank, fd.ulysses_attention, offset=5e3, head=0)
    assert max(errors) < 1e-5, f"rank {rank}: dq, dk, dv errors {errors}"


@case(3)
def a_backward_float64_cannot_compute_is_refused_by_every_rank(rank, world):
    try:
        _offset_case(world, rank, fd.ring_attention, offset=1e15)
        raise AssertionError("not refused")
    except ValueError as exc:
        assert "refused the call (ValueError: the ring's backward: the gradients" in str(exc) or (
            rank == 0 and "even in float64" in str(exc)
        ), exc
    x = small_shard(world, requires_grad=True)  # the messages were done: the group works
    fd.ring_attention(x, x, x).sum().backward()
