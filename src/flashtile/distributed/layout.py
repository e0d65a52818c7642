"""Sequence layouts: which tokens each rank holds, and moving between shards and wholes.

Two layouts of a sequence of ``T`` tokens over ``P`` ranks::

    contiguous: P chunks of T/P;      rank r holds chunk r
    zigzag:     2P chunks of T/(2P);  rank r holds chunks r and 2P-1-r (in that order)

    T = 16, P = 2, zigzag:  chunks 0 1 2 3 (4 tokens each)
                            rank 0 holds 0 and 3, rank 1 holds 1 and 2

Under a causal mask a contiguous layout gives the last rank P times the work
of the first; zigzag pairs an early chunk with a late one, so every rank has
the same work. A rank's local tokens keep their global order (chunk r before
chunk 2P-1-r), which :mod:`.blocks` relies on.
"""

from __future__ import annotations

import numbers

import numpy as np

#: The supported values of ``layout``.
LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def num_chunks(world_size: int, layout: str) -> int:
    """How many equal chunks ``layout`` cuts a sequence into over ``world_size`` ranks."""
    return 2 * world_size if check_layout(layout) == "zigzag" else world_size


def check_rank(rank, world_size) -> tuple[int, int]:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, "
            f"world_size={world_size}"
        )
    return int(rank), int(world_size)


def chunk_size(total: int, world_size: int, layout: str, detail: str = "") -> int:
    """``total / chunks``; a ValueError naming the multiple needed if it does not divide."""
    n = num_chunks(world_size, layout)
    if total % n:
        up = -(-total // n) * n
        other = layout == "zigzag" and total % world_size == 0
        raise ValueError(
            f"sequence length {total}{detail} does not split into layout={layout!r} over "
            f"{world_size} ranks: it must be a multiple of {n}"
            f"{' (2 x world size)' if layout == 'zigzag' else ' (the world size)'}; "
            f"pad it to {up}" + (" or use layout='contiguous'" if other else "")
        )
    return total // n


def segments(total: int, rank: int, world_size: int, layout: str) -> list[tuple[int, int]]:
    """Rank ``rank``'s tokens as ``(global start, length)`` runs, in local order."""
    c = chunk_size(total, world_size, layout)
    if layout == "contiguous":
        return [(rank * c, c)]
    return [(rank * c, c), ((2 * world_size - 1 - rank) * c, c)]


def sequence_positions(T: int, rank: int, world_size: int, *, layout: str = "zigzag"):
    """Each local token's position in the whole sequence, as an int64 tensor ``(T / P,)``.

    Feed these to position embeddings (rotary, learned) so that a sharded
    model sees the same positions as the whole-sequence model::

        pos = sequence_positions(T, rank, world, layout="zigzag")  # T=16, P=2, rank 0:
        # tensor([ 0,  1,  2,  3, 12, 13, 14, 15])
    """
    import torch

    rank, world_size = check_rank(rank, world_size)
    runs = segments(T, rank, world_size, layout)
    return torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in runs])


def _take(x, dim: int, start: int, stop: int):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, stop)
    return x[tuple(index)]


def _concat(parts, dim: int, like):
    if isinstance(like, np.ndarray):
        return np.concatenate(parts, axis=dim)
    import torch

    return torch.cat(parts, dim=dim)


def _axis(x, dim: int) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.ndim


def shard_sequence(x, rank: int, world_size: int, *, layout: str = "zigzag", dim: int = -2):
    """This rank's part of a whole sequence ``x`` (torch tensor or NumPy array).

    Args:
        x: the whole sequence along ``dim`` (``(B, H, T, d)`` with the default
            ``dim=-2``; token ids ``(B, T)`` with ``dim=-1``).
        rank, world_size: this process's place in the group.
        layout: ``"zigzag"`` (T a multiple of ``2 * world_size``) or
            ``"contiguous"`` (a multiple of ``world_size``); see :mod:`.layout`.

    Returns:
        A new tensor of ``T / world_size`` tokens along ``dim`` (same type as ``x``),
        differentiable when ``x`` is.
    """
    rank, world_size = check_rank(rank, world_size)
    dim = _axis(x, dim)
    runs = segments(x.shape[dim], rank, world_size, layout)
    return _concat([_take(x, dim, s, s + n) for s, n in runs], dim, x)


def to_sequence_order(x, world_size: int, layout: str, dim: int):
    """The ranks' shards concatenated in rank order -> the sequence in order."""
    dim = _axis(x, dim)
    if layout == "contiguous" or world_size == 1:
        return x
    c = chunk_size(x.shape[dim], world_size, layout)
    # In rank order the chunks are 0, 2P-1, 1, 2P-2, ...: chunk k sits at slot
    # 2k (k < P) or 2(2P-1-k)+1 (k >= P).
    p = world_size
    slots = [2 * k if k < p else 2 * (2 * p - 1 - k) + 1 for k in range(2 * p)]
    return _concat([_take(x, dim, s * c, (s + 1) * c) for s in slots], dim, x)


def to_layout_order(x, world_size: int, layout: str, dim: int):
    """The inverse of :func:`to_sequence_order`: the ranks' shards in rank order."""
    dim = _axis(x, dim)
    if layout == "contiguous" or world_size == 1:
        return x
    parts = [shard_sequence(x, r, world_size, layout=layout, dim=dim) for r in range(world_size)]
    return _concat(parts, dim, x)


def gather_sequence(x_local, *, group=None, layout: str = "zigzag", dim: int = -2):
    """The whole sequence on every rank, in sequence order (the inverse of sharding).

    Args:
        x_local: this rank's shard (a CPU tensor with gloo, CUDA with NCCL); every
            rank's has the same shape.
        group: the process group (default: the whole world).
        layout, dim: as passed to :func:`shard_sequence`.

    Returns:
        ``x`` with ``world_size`` times the tokens along ``dim``. One all-gather;
        not differentiable (for evaluation, logging and tests).
    """
    import torch
    import torch.distributed as dist

    from .comm import ring_of

    check_layout(layout)
    ring, _ = ring_of(group, x_local)
    dim = _axis(x_local, dim)
    x_local = x_local.detach().contiguous()
    parts = [torch.empty_like(x_local) for _ in range(ring.size)]
    dist.all_gather(parts, x_local, group=ring.group)
    return to_sequence_order(torch.cat(parts, dim=dim), ring.size, layout, dim)
