"""Attention-variant cases of ``flashtile bench`` (``--preset variants``).

A variant case is a :class:`~.cases.Case` with a :class:`Variant`: a sliding
window, a block-sparse boolean mask, GQA (fewer k/v heads) or a packed
variable-length batch. This module holds what does not depend on the
provider: the exact count of visible ``(query, key)`` pairs behind the
useful-FLOP figure, the seeded masks, the inputs and the float64 reference
(:func:`flashtile.tiled_attention` with the same keywords). The providers'
calls and the target lines live in :mod:`.variant_providers`.

Layouts: ``q (B, Hq, T, d)``, ``k, v (B, Hkv, T, d)``; a varlen case packs its
sequences along T (``B = 1``, ``T`` = the total length).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

import flashtile
from flashtile.masks import key_bounds, normalize_window, visible

from .cases import Case

#: Queries per chunk of the windowed float64 reference (see :func:`reference`).
REFERENCE_CHUNK = 512
REFERENCE_BLOCK = 128


@dataclass(frozen=True)
class Variant:
    """What a case adds to plain attention (frozen, hashable: a cache key).

    Attributes:
        window: flashtile's ``window=(left, right)``, or None.
        kv_heads: GQA/MQA: k and v have this many heads (q has ``case.H``).
        sparse_block: block size of a block-sparse boolean mask, or None.
        sparse_density: fraction of those blocks kept (diagonal always kept).
        seqlens: lengths of the packed sequences of a varlen case, or None.
        seed: the block pattern's seed.
    """

    window: tuple[int, int] | None = None
    kv_heads: int | None = None
    sparse_block: int | None = None
    sparse_density: float = 0.0
    seqlens: tuple[int, ...] | None = None
    seed: int = 0

    def describe(self, H: int) -> str:
        parts = []
        if self.window is not None:
            parts.append(f"window=({self.window[0]},{self.window[1]})")
        if self.sparse_block is not None:
            b = self.sparse_block
            parts.append(f"block-sparse {self.sparse_density:.0%} of {b}x{b}")
        if self.kv_heads is not None:
            parts.append(f"GQA {H}q/{self.kv_heads}kv")
        if self.seqlens is not None:
            lens = self.seqlens
            parts.append(f"varlen {len(lens)} seqs {min(lens)}..{max(lens)}")
        return " ".join(parts) or "plain"

    def pairs(self, T: int, causal: bool) -> int:
        """Visible ``(query, key)`` pairs per (batch, head): the useful work."""
        if self.seqlens is not None:
            return sum(positional_pairs(n, causal, self.window) for n in self.seqlens)
        if self.sparse_block is not None:
            return int(np.count_nonzero(dense_mask(self, T, causal)))
        return positional_pairs(T, causal, self.window)

    def without_mask(self) -> Variant:
        """The same problem without the block-sparse mask (the dense baseline)."""
        return dataclasses.replace(self, sparse_block=None, sparse_density=0.0, seed=0)


@lru_cache(maxsize=64)
def positional_pairs(T: int, causal: bool, window) -> int:
    """Keys visible by position, summed over the ``T`` queries (``Tq == Tk``)."""
    left, right = normalize_window(window, causal)
    return sum(
        max(0, hi - lo)
        for lo, hi in (key_bounds(i, T, T, causal, left, right, T) for i in range(T))
    )


@lru_cache(maxsize=4)
def block_pattern(T: int, block: int, density: float, seed: int) -> np.ndarray:
    """Seeded ``(nb, nb)`` bool pattern: the diagonal plus random off-diagonal blocks.

    ``round(density * nb^2)`` blocks are kept in all (at least the diagonal,
    so that no query row is empty).
    """
    nb = -(-T // block)
    pattern = np.eye(nb, dtype=bool)
    extra = max(0, round(density * nb * nb) - nb)
    off = np.flatnonzero(~pattern.ravel())
    pattern.ravel()[np.random.default_rng(seed).choice(off, extra, replace=False)] = True
    return pattern


def block_fraction(variant: Variant, T: int) -> float:
    """Fraction of blocks the sparse mask actually keeps (the nominal density, rounded)."""
    return float(
        block_pattern(T, variant.sparse_block, variant.sparse_density, variant.seed).mean()
    )


def sparse_mask(variant: Variant, T: int) -> np.ndarray:
    """``(T, T)`` bool, True = keep: the block pattern expanded to elements."""
    b = variant.sparse_block
    pattern = block_pattern(T, b, variant.sparse_density, variant.seed)
    return np.repeat(np.repeat(pattern, b, axis=0), b, axis=1)[:T, :T]


@lru_cache(maxsize=2)
def dense_mask(variant: Variant, T: int, causal: bool) -> np.ndarray:
    """Every rule of the case as one ``(T, T)`` bool mask (what torch SDPA is given)."""
    left, right = normalize_window(variant.window, causal)
    idx = np.arange(T)
    keep = visible(idx, idx, T, T, causal, left, right)
    if variant.sparse_block is not None:
        keep &= sparse_mask(variant, T)
    return keep


def flashtile_kwargs(variant: Variant, T: int) -> dict:
    """The variant keywords of :func:`flashtile.attention` (GQA is in the shapes)."""
    kw = {}
    if variant.window is not None:
        kw["window"] = variant.window
    if variant.sparse_block is not None:
        kw["mask"] = sparse_mask(variant, T)
    return kw


def cu_seqlens(variant: Variant) -> np.ndarray:
    """``(S + 1,)`` int64 offsets of the packed sequences."""
    return np.concatenate([[0], np.cumsum(variant.seqlens)]).astype(np.int64)


def make_inputs(case: Case, seed: int) -> dict[str, np.ndarray]:
    """Seeded standard-normal float32 ``q, dout (B, H, T, d)``, ``k, v (B, Hkv, T, d)``."""
    va = case.variant
    hkv = va.kv_heads or case.H
    rng = np.random.default_rng([seed, case.B, case.H, hkv, case.T, case.d])
    shapes = {n: (case.B, case.H if n in ("q", "dout") else hkv, case.T, case.d) for n in "qkv"}
    shapes["dout"] = shapes["q"]
    return {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}


def reference(case: Case, inputs) -> dict[str, np.ndarray]:
    """Float64 ``{"out": ...}`` from :func:`flashtile.tiled_attention` with the variant.

    A varlen case runs it per sequence. A causal window runs it on chunks of
    :data:`REFERENCE_CHUNK` queries with only the keys the chunk can see
    (bottom-right alignment keeps ``p - j`` unchanged), so T=16384 costs
    ``T * window``, not ``T^2``.
    """
    va = case.variant
    q, k, v = (inputs[n].astype(np.float64) for n in "qkv")
    kw, causal = flashtile_kwargs(va, case.T), case.causal
    out = np.empty(q.shape[:-1] + (v.shape[-1],))

    def tiled(sl_q, sl_k):
        qs, ks, vs = q[..., sl_q, :], k[..., sl_k, :], v[..., sl_k, :]
        out[..., sl_q, :] = flashtile.tiled_attention(qs, ks, vs, REFERENCE_BLOCK, causal, **kw)

    if va.seqlens is not None:
        cu = cu_seqlens(va)
        for a, b in itertools.pairwise(cu):
            tiled(slice(a, b), slice(a, b))
    elif causal and "mask" not in kw and normalize_window(va.window, causal)[0] >= 0:
        left = normalize_window(va.window, causal)[0]
        for i0 in range(0, case.T, REFERENCE_CHUNK):
            i1 = min(i0 + REFERENCE_CHUNK, case.T)
            tiled(slice(i0, i1), slice(max(0, i0 - left), i1))
    else:
        tiled(slice(None), slice(None))
    return {"out": out}


def variant_cases(
    B: int = 1,
    H: int = 8,
    *,
    T: int = 4096,
    long_T: int = 16384,
    d: int = 64,
    window: int = 256,
    block: int = 128,
    density: float = 0.1,
    gqa: tuple[int, int, int] = (4, 2048, 128),
    seqlens: tuple[int, ...] | None = None,
) -> list[Case]:
    """The variants preset's cases; the keywords shrink them (tests use T=64).

    A window at two lengths (``T`` and ``long_T``: is the time linear in T?),
    a block-sparse mask, GQA and a packed varlen batch.

    ``gqa = (group, T, d)``: ``group * H`` query heads on ``H`` k/v heads.
    ``seqlens`` defaults to 8 lengths spread 128..2048.
    """
    if seqlens is None:
        seqlens = tuple(int(n) for n in np.linspace(128, 2048, 8).astype(int))
    win = Variant(window=(window, 0))
    group, gqa_t, gqa_d = gqa
    with_torch = ("flashtile", "torch-sdpa")
    sparse = ("flashtile", "flashtile-blockmask", "flashtile-dense", "torch-sdpa")
    per_seq = ("flashtile", "flashtile-per-seq", "torch-sdpa")
    return [
        Case(T, d, True, "fwd", B, H, with_torch, win),
        Case(long_T, d, True, "fwd", B, H, with_torch, win),
        Case(T, d, False, "fwd", B, H, sparse, Variant(sparse_block=block, sparse_density=density)),
        Case(gqa_t, gqa_d, True, "fwd", B, group * H, with_torch, Variant(kv_heads=H)),
        Case(sum(seqlens), d, True, "fwd", 1, H, per_seq, Variant(seqlens=tuple(seqlens))),
    ]
