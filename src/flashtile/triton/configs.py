"""Tile sizes, warps and pipeline stages each kernel may launch with.

A short list per kernel, head-dim bucket and element size; on a GPU the
fastest of a list is picked on first use per shape class (:mod:`.tuning`),
and :func:`flashtile.triton.compile_report` compiles every entry ahead of
time, so each one the tuner could pick is known to compile and to fit an
A100's (sm_80) shared memory. Sizes follow the usual FlashAttention-2 Triton
choices: 128-row query tiles with 64-128 keys per step in 16-bit types,
smaller tiles for head dim 256. float32 (IEEE products, no tensor-core MMA:
the accuracy path, not the fast one) gets one small configuration per head
dim: its products unroll into FMAs, and larger tiles took ptxas 20-50 s per
kernel (measured on the 2-core development machine), every one of which a
GPU run pays on first use.

Under the interpreter one small configuration per kernel is used; its query
and key tiles differ (16 vs 32) so that a mix-up of the two axes shows in
the tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """One launch configuration (``block_m`` / ``block_n`` are query / key rows per tile;
    decoding sets ``block_m`` from its row count, the merge uses ``block_m`` rows)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def label(self) -> str:
        return f"M{self.block_m}-N{self.block_n}-w{self.num_warps}-s{self.num_stages}"


C = Config
#: kernel -> (element bytes, head-dim bucket) -> configurations, best guess first.
TABLE: dict[str, dict[tuple[int, int], list[Config]]] = {
    "attn_fwd": {
        (2, 64): [C(128, 64, 4, 3), C(128, 128, 8, 3), C(64, 64, 4, 4)],
        (2, 128): [C(128, 64, 8, 3), C(128, 128, 8, 2), C(64, 64, 4, 3)],
        (2, 256): [C(128, 64, 8, 2), C(64, 64, 4, 2)],
        (4, 64): [C(64, 32, 4, 2)],
        (4, 128): [C(32, 32, 4, 2)],
        (4, 256): [C(16, 32, 4, 1)],
    },
    "attn_bwd_dkdv": {
        (2, 64): [C(32, 128, 4, 3), C(64, 64, 4, 3)],
        (2, 128): [C(32, 128, 8, 2), C(64, 64, 4, 2)],
        (2, 256): [C(32, 64, 4, 2), C(16, 64, 4, 1)],
        (4, 64): [C(32, 32, 4, 2)],
        (4, 128): [C(16, 32, 4, 2)],
        (4, 256): [C(16, 16, 4, 1)],
    },
    "attn_bwd_dq": {
        (2, 64): [C(128, 32, 4, 3), C(64, 64, 4, 3)],
        (2, 128): [C(128, 32, 8, 2), C(64, 64, 4, 2)],
        (2, 256): [C(64, 32, 4, 2), C(64, 16, 4, 1)],
        (4, 64): [C(32, 32, 4, 2)],
        (4, 128): [C(32, 16, 4, 2)],
        (4, 256): [C(16, 16, 4, 1)],
    },
    "decode_split": {
        (2, 64): [C(16, 64, 4, 3), C(16, 128, 4, 2)],
        (2, 128): [C(16, 64, 4, 3), C(16, 128, 4, 2)],
        (2, 256): [C(16, 64, 4, 2)],
        (4, 64): [C(16, 32, 4, 2)],
        (4, 128): [C(16, 32, 4, 2)],
        (4, 256): [C(16, 16, 4, 1)],
    },
    "attn_bwd_delta": {(size, d): [C(64, 0, 4, 1)] for size in (2, 4) for d in (64, 128, 256)},
    "decode_merge": {(size, d): [C(16, 0, 4, 1)] for size in (2, 4) for d in (64, 128, 256)},
}

#: Under the interpreter: small tiles, query and key tiles of different sizes.
INTERPRET: dict[str, Config] = {
    "attn_fwd": C(16, 32, 4, 1),
    "attn_bwd_dkdv": C(32, 16, 4, 1),
    "attn_bwd_dq": C(16, 32, 4, 1),
    "decode_split": C(16, 16, 4, 1),
    "attn_bwd_delta": C(16, 0, 4, 1),
    "decode_merge": C(16, 0, 4, 1),
}

#: Configurations a call with a user's mods does not launch: the mods' index
#: tiles take layout conversions through shared memory, and with them the
#: forward's largest head-dim-256 tiles need 178 KiB, past sm_80's 163 KiB
#: (the compile report's "mods" rows).
NOT_WITH_MODS = {("attn_fwd", C(128, 64, 8, 2))}

#: Rows of one decoding tile at most (query heads per kv head x queries per sequence).
DECODE_MAX_ROWS = 64


def head_block(d: int) -> int:
    """The head dim padded to a power of two, at least 16 (the MMA's minimum)."""
    return max(16, 1 << (d - 1).bit_length())


def bucket(block_d: int) -> int:
    """The head-dim bucket of a padded head dim: 64 (up to 64), 128 or 256."""
    return max(64, block_d)


def candidates(kernel: str, element_bytes: int, block_d: int) -> list[Config]:
    """The configurations ``kernel`` may launch with for this element size and head dim."""
    return TABLE[kernel][(4 if element_bytes >= 4 else 2, bucket(block_d))]
