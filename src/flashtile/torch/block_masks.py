"""FlexAttention's ``BlockMask`` as flashtile reads and writes it.

A ``BlockMask`` lists, per query block of each batch entry and head, its
partial key blocks (``kv_num_blocks``/``kv_indices``: ``mask_mod`` decides)
and its full ones (``full_kv_*``: every key kept); an unlisted block hides
its keys. flashtile turns the lists into tile states (``TILE_*`` of
:mod:`flashtile.masks`, :func:`block_states`) and back
(:func:`block_mask_of_states`), and the Triton kernels walk lists made by
:func:`block_lists`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, noop_mask

from ..masks import TILE_FULL, TILE_PARTIAL


def block_lists(states: np.ndarray, state: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts (..., rows), indices (..., rows, cols))`` int32: per row of
    the tile states ``(..., rows, cols)``, how many tiles are in ``state``
    and which, in order (the rest of each row after them)."""
    hits = states == state
    counts = hits.sum(axis=-1).astype(np.int32)
    order = np.argsort(~hits, axis=-1, kind="stable").astype(np.int32)
    return torch.from_numpy(counts), torch.from_numpy(order)


def block_mask_of_states(states: np.ndarray, block, mask_mod, seq_lengths) -> BlockMask:
    """PyTorch's BlockMask of ``(B, H, nQ, nK)`` tile states: per query tile,
    the partial key tiles and the full ones, in key order."""
    partial, full = block_lists(states, TILE_PARTIAL), block_lists(states, TILE_FULL)
    return BlockMask.from_kv_blocks(
        *partial, *full, BLOCK_SIZE=tuple(block), mask_mod=mask_mod, seq_lengths=seq_lengths
    )


def block_states(block_mask: BlockMask) -> np.ndarray:
    """``(B, H, nQ, nK)`` int8 tile states of a PyTorch BlockMask."""
    kv_num = block_mask.kv_num_blocks.cpu().numpy()
    kv_idx = block_mask.kv_indices.cpu().numpy()
    q_len, kv_len = block_mask.seq_lengths
    bq, bk = block_mask.BLOCK_SIZE
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    states = np.zeros(kv_num.shape[:2] + (nq, nk), dtype=np.int8)
    pairs = [(kv_num, kv_idx, TILE_PARTIAL)]
    if block_mask.full_kv_num_blocks is not None:
        full = block_mask.full_kv_num_blocks.cpu().numpy(), block_mask.full_kv_indices.cpu().numpy()
        pairs.append((*full, TILE_FULL))
    for num, idx, state in pairs:
        b, h, qb, j = np.nonzero(np.arange(idx.shape[-1]) < num[..., None])
        keep = (qb < nq) & (idx[b, h, qb, j] < nk)
        states[b[keep], h[keep], qb[keep], idx[b, h, qb, j][keep]] = state
    return states


def mask_mod_of(block_mask, tq: int, tk: int):
    """The ``mask_mod`` of a call's ``block_mask`` (None without one),
    checked to be a BlockMask for the call's lengths."""
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a BlockMask (from create_block_mask), got "
            f"{type(block_mask).__name__}"
        )
    if tuple(block_mask.seq_lengths) != (tq, tk):
        raise ValueError(
            f"block_mask was built for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)}, "
            f"the call has ({tq}, {tk}): build it for the call's lengths"
        )
    return block_mask.mask_mod or noop_mask
