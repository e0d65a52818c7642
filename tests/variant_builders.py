"""Shared builders for the attention-variant tests.

A :class:`Case` is one attention problem: a shape ``(B, Hq, Hkv, Tq, Tk, d,
dv)``, a causal flag and a *maker* that draws the variant keyword arguments
(window, ALiBi slopes, softcap, padding, masks) for that shape. The makers
below compose with :func:`combine`. The assertion helpers compare a path's
``out``/``lse``/gradients with the dense oracle in ``dense.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import flashtile as ft
from dense import rel_err, variant_visibility

#: Fast-kernel tiles that divide none of the test sequence lengths.
TILES = {"block_q": 16, "block_k": 24}

# --------------------------------------------------------------------------------------
# Variant makers: (rng, shape) -> keyword arguments
# --------------------------------------------------------------------------------------


def no_variants(rng, shape):
    return {}


def window(left, right):
    return lambda rng, shape: {"window": (left, right)}


def alibi(per_batch: bool = False):
    def make(rng, shape):
        b, hq = shape[:2]
        return {"alibi_slopes": rng.uniform(0.05, 1.0, (b, hq) if per_batch else (hq,))}

    return make


def softcap(cap: float):
    return lambda rng, shape: {"softcap": cap}


def scale(value: float):
    return lambda rng, shape: {"scale": value}


def lengths(*kv_lengths):
    return lambda rng, shape: {"kv_lengths": np.array(kv_lengths, dtype=np.int64)}


def padding_mask(rng, shape):
    b, tk = shape[0], shape[4]
    keep = rng.random((b, tk)) < 0.7
    keep[:, 0] = True
    return {"key_padding_mask": keep}


def _mask_shape(dims: str, shape) -> tuple[int, ...]:
    """``dims`` spells the mask shape: b=B, h=Hq, q=Tq, k=Tk, 1=1 (e.g. ``"b1qk"``)."""
    b, hq, _, tq, tk = shape[:5]
    sizes = {"b": b, "h": hq, "q": tq, "k": tk, "1": 1}
    return tuple(sizes[c] for c in dims)


def bool_mask(dims: str, density: float = 0.6):
    return lambda rng, shape: {"mask": rng.random(_mask_shape(dims, shape)) < density}


def float_mask(dims: str, p_hidden: float = 0.15):
    def make(rng, shape):
        mshape = _mask_shape(dims, shape)
        mask = rng.standard_normal(mshape)
        mask[rng.random(mshape) < p_hidden] = -np.inf
        return {"mask": mask}

    return make


def combine(*makers):
    def make(rng, shape):
        out = {}
        for m in makers:
            out.update(m(rng, shape))
        return out

    return make


def block_sparse_mask(rng, shape, cell=10):
    """A bool mask of ``shape`` made of ``cell x cell`` cells that are all-False,
    all-True or random, so a block summary has empty, full and partial tiles."""
    b, h, tq, tk = shape
    kind = rng.integers(0, 3, size=(b, h, -(-tq // cell), -(-tk // cell)))
    kind = np.repeat(np.repeat(kind, cell, axis=2), cell, axis=3)[:, :, :tq, :tk]
    noise = rng.random(shape) < 0.5
    return np.where(kind == 0, False, np.where(kind == 1, True, noise))


# --------------------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One attention problem: shape ``(B, Hq, Hkv, Tq, Tk, d, dv)`` plus variants."""

    name: str
    shape: tuple[int, int, int, int, int, int, int]
    causal: bool = False
    make: Callable = no_variants
    block: int = 7  # reference tile size: does not divide the sequence lengths
    amp: float = 1.0  # scale of q and k (large enough for softcap to bite)

    def build(self, rng, dtype=np.float64):
        """``q, k, v, dout`` in ``dtype`` and the variant keyword arguments."""
        b, hq, hkv, tq, tk, d, dv = self.shape
        q = (self.amp * rng.standard_normal((b, hq, tq, d))).astype(dtype)
        k = (self.amp * rng.standard_normal((b, hkv, tk, d))).astype(dtype)
        v = rng.standard_normal((b, hkv, tk, dv)).astype(dtype)
        dout = rng.standard_normal((b, hq, tq, dv)).astype(dtype)
        return q, k, v, dout, self.make(rng, self.shape)


def ids(cases):
    return [c.name for c in cases]


def f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def visibility(case, var):
    """The oracle's ``(B, Hq, Tq, Tk)`` visibility for a case and its variants."""
    b, hq, _, tq, tk = case.shape[:5]
    return variant_visibility(
        (b, hq, tq, tk),
        case.causal,
        window=var.get("window"),
        kv_lengths=var.get("kv_lengths"),
        key_padding_mask=var.get("key_padding_mask"),
        mask=var.get("mask"),
    )


def forward_backward(path, q, k, v, dout, causal, block=7, **var):
    """``out, lse, (dq, dk, dv)`` from the reference (tiles of ``block`` keys) or
    the fast kernel (:data:`TILES`): both backwards take one argument order."""
    if path == "reference":
        out, lse = ft.tiled_attention(q, k, v, block, causal, return_lse=True, **var)
        backward, tiles = ft.tiled_attention_backward, {"block_size": block}
    else:
        out, lse = ft.attention(q, k, v, causal=causal, return_lse=True, **TILES, **var)
        backward, tiles = ft.attention_backward, TILES
    return out, lse, backward(q, k, v, out, lse, dout, causal=causal, **tiles, **var)


# --------------------------------------------------------------------------------------
# Assertions
# --------------------------------------------------------------------------------------


def assert_lse_close(lse, ref, tol):
    """Same shape, ``-inf`` in the same places, finite entries within ``tol``."""
    lse = np.asarray(lse, dtype=np.float64)
    assert lse.shape == ref.shape
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    finite = np.isfinite(ref)
    if finite.any():
        assert rel_err(lse[finite], ref[finite]) < tol


def assert_grads_close(got, want, tol):
    """``(dq, dk, dv)`` of the same shapes, each within relative error ``tol``."""
    assert len(got) == 3
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape, name
        assert rel_err(g, w) < tol, name
