"""The process group as the ring sees it, point-to-point exchange, and device checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ring:
    """This process's place in ``group``: ``rank`` of ``size``; ``next``/``prev``
    are the *global* ranks of its neighbours (what point-to-point ops take)."""

    group: object
    rank: int
    size: int
    next: int
    prev: int


def check_cpu(*tensors: torch.Tensor) -> None:
    """CPU tensors only, until the ring runs flashtile.triton (a clear error, no fallback)."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(
                f"a tensor is on {t.device}: flashtile.distributed runs flashtile's CPU kernels "
                f"with the gloo backend; CUDA tensors with NCCL are not wired to flashtile's "
                f"GPU kernels (flashtile.triton) yet. Move the tensors to the CPU and init the "
                f"group with backend='gloo'"
            )


def ring_of(group, *tensors: torch.Tensor) -> Ring:
    """Check the group and the tensors' device; this process's :class:`Ring`."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('gloo') first (torchrun sets the "
            "environment it reads)"
        )
    check_cpu(*tensors)
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        raise ValueError(
            "the process group uses NCCL, which carries CUDA tensors only; flashtile runs on "
            "CPU tensors: create the group with backend='gloo' (NCCL comes when the ring "
            "runs flashtile.triton)"
        )
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    if group is not None:  # point-to-point ops take global ranks
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    return Ring(group, rank, size, nxt, prev)


def shift(ring: Ring, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> list:
    """Post: send ``send`` to the next rank, receive ``recv`` from the previous one.

    Returns the pending works; :func:`wait` them before reading ``recv`` or
    writing ``send``. Streams that may be in flight together use different
    ``tag`` values.
    """
    ops = [
        dist.P2POp(dist.isend, send, ring.next, ring.group, tag),
        dist.P2POp(dist.irecv, recv, ring.prev, ring.group, tag),
    ]
    return dist.batch_isend_irecv(ops)


def wait(works) -> None:
    for w in works or ():
        w.wait()


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x (P, ...)``: slot ``p`` goes to rank ``p``; the result has rank ``p``'s in slot ``p``."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too (empty_like keeps x's strides)
    dist.all_to_all_single(out, x, group=group)
    return out
