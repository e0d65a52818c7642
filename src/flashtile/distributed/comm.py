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


def backend_for(config: str, device_type: str) -> str:
    """The backend a group uses for ``device_type`` tensors, from its config:
    ``"gloo"`` (one for all), or ``"cpu:gloo,cuda:nccl"`` (one per device)."""
    if ":" not in config:
        return config
    entries = dict(entry.split(":", 1) for entry in config.split(","))
    return entries.get(device_type, "none")


def check_device(config: str, *tensors: torch.Tensor) -> torch.device:
    """The one device of ``tensors``, checked against the group's backend
    ``config`` (:func:`backend_for`).

    CPU tensors travel through gloo (or any backend but NCCL) and run
    flashtile's CPU kernels; CUDA tensors travel through NCCL and run its
    Triton kernels (:mod:`.kernels`). Anything else is refused, before any
    message is posted.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(
            f"the tensors are on {sorted(map(str, devices))}: move them to one device (CPU "
            f"tensors with a gloo group, CUDA tensors with an NCCL group)"
        )
    (device,) = devices
    backend = backend_for(config, device.type)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"the tensors are on {device}: flashtile.distributed runs CPU tensors (gloo) and "
            f"CUDA tensors (NCCL, flashtile's Triton kernels)"
        )
    if device.type == "cpu" and backend == "nccl":
        raise ValueError(
            "the process group uses NCCL, which carries CUDA tensors only: create the group "
            "with backend='gloo' for CPU tensors, or move the tensors to the GPU"
        )
    if device.type == "cuda" and backend != "nccl":
        raise ValueError(
            f"CUDA tensors with a {backend} process group: create the group with "
            f"backend='nccl' (gloo's point-to-point ops take CPU tensors), or move the "
            f"tensors to the CPU"
        )
    return device


def ring_of(group, *tensors: torch.Tensor) -> tuple[Ring, torch.device]:
    """Check the group and the tensors' device: this process's :class:`Ring`, and the device."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('gloo') first (torchrun sets the "
            "environment it reads)"
        )
    device = check_device(str(dist.get_backend_config(group)), *tensors)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    if group is not None:  # point-to-point ops take global ranks
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    return Ring(group, rank, size, nxt, prev), device


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
