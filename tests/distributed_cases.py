"""The registry of the multi-process cases that ``tests/test_distributed.py``
runs: every case registered here runs in the same process groups (one per
world size), on every rank. Cases live in ``test_distributed.py`` and in
``distributed_fault_cases.py`` (faults and the backward's precision rule).
"""

from __future__ import annotations

import torch

WORLD_SIZES = (2, 3, 4)
#: Seconds a whole world may take (spawn, imports, every case) before it counts as hung.
WORLD_TIMEOUT = 240
CASES: dict = {}


def case(*worlds):
    """Register a case ``fn(rank, world)`` for the given world sizes (default: all)."""

    def register(fn):
        CASES[fn.__name__] = (fn, worlds or WORLD_SIZES)
        return fn

    return register


def small_shard(world, dtype=torch.float64, requires_grad=False):
    """A ``(1, world, 4, 8)`` shard, the same on every rank."""
    x = torch.randn(1, world, 4, 8, dtype=dtype, generator=torch.Generator().manual_seed(1))
    return x.requires_grad_(requires_grad)
