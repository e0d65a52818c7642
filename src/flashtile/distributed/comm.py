"""The process group as the ring sees it, point-to-point exchange, and device checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import faults


@dataclass(frozen=True)
class Ring:
    """This process's place in ``group``: ``rank`` of ``size``; ``next``/``prev``
    are the *global* ranks of its neighbours (what point-to-point ops take).
    ``config``: the group's backends; ``flag_device``: where a collective of
    the group takes a small tensor; ``polls``: the call's waits poll for a
    peer's failure (CPU tensors, :mod:`.faults`)."""

    group: object
    rank: int
    size: int
    next: int
    prev: int
    config: str = "gloo"
    flag_device: str = "cpu"
    polls: bool = True


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


def group_ring(group) -> Ring:
    """This process's :class:`Ring` in ``group`` (tensors not looked at yet)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('gloo') first (torchrun sets the "
            "environment it reads)"
        )
    config = str(dist.get_backend_config(group))
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    if group is not None:  # point-to-point ops take global ranks
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    on_cpu = backend_for(config, "cpu") not in ("nccl", "none")
    flag = "cpu" if on_cpu else f"cuda:{torch.cuda.current_device()}"
    return Ring(group, rank, size, nxt, prev, config, flag, polls=on_cpu)


def ring_of(group, *tensors: torch.Tensor) -> tuple[Ring, torch.device]:
    """Check the group and the tensors' device: this process's :class:`Ring`, and the device."""
    return with_device(group_ring(group), *tensors)


def with_device(ring: Ring, *tensors: torch.Tensor) -> tuple[Ring, torch.device]:
    """``(ring, device)``: the tensors' one device checked against the group's
    backends; the ring's waits poll for CPU tensors."""
    device = check_device(ring.config, *tensors)
    return dataclasses.replace(ring, polls=device.type == "cpu"), device


def shift(ring: Ring, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> list:
    """Post: send ``send`` to the next rank, receive ``recv`` from the previous one.

    Returns the pending works; :func:`.faults.wait` them before reading ``recv`` or
    writing ``send``. Streams that may be in flight together use different
    ``tag`` values.
    """
    ops = [
        dist.P2POp(dist.isend, send, ring.next, ring.group, tag),
        dist.P2POp(dist.irecv, recv, ring.prev, ring.group, tag),
    ]
    with faults.messages(ring):
        return dist.batch_isend_irecv(ops)


def all_to_all(x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """``x (P, ...)``: slot ``p`` goes to rank ``p``; the result has rank ``p``'s in slot ``p``."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too (empty_like keeps x's strides)
    with faults.messages(ring):
        dist.all_to_all_single(out, x, group=ring.group)
    return out
