"""How each provider runs a variant case, and the target lines of the ``variants`` preset.

The runner asks this module, for a case with a :class:`~.variant_cases.Variant`,
whether a provider runs it (:func:`skip_reason`), which problem it really
solves (:func:`provider_case`: the dense baseline drops the mask, so it is
verified against the dense reference and credited the dense FLOPs) and for a
zero-argument call (:func:`make_call`). Everything a call needs (masks,
BlockMask summaries, per-sequence slices, padded torch batches) is built here,
before the timed calls.

* ``flashtile``: :func:`flashtile.attention` with the variant keywords, or
  :func:`flashtile.varlen_attention` on the packed batch.
* ``flashtile-blockmask``: the same mask summarised once with
  :func:`flashtile.block_mask` at the pattern's block size, passed with
  ``block_q = block_k =`` that size (the documented way to reuse a mask).
* ``flashtile-dense``: the same inputs without the mask.
* ``flashtile-per-seq``: :func:`flashtile.attention` on each packed sequence.
* ``torch-sdpa``: a dense ``(T, T)`` bool ``attn_mask`` for windows and masks
  (``is_causal=False``), ``is_causal`` + ``enable_gqa`` for GQA, and for varlen
  a right-padded batch with ``is_causal`` (a valid query never sees a padded
  key under a causal mask, so no mask is needed; without causal a key-padding
  bool mask is built).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict

import numpy as np

import flashtile
from flashtile.masks import normalize_window, visible

from .cases import Case
from .providers import Provider, _import_torch
from .targets import target_line
from .variant_cases import block_fraction, cu_seqlens, dense_mask, flashtile_kwargs


class Packed:
    """Per-sequence outputs ``(1, H, L_s, d)`` joined into one packed array only when read.

    The timed call returns this, so the per-sequence baseline is not charged
    for a concatenation that :func:`flashtile.varlen_attention` never does.
    """

    def __init__(self, parts):
        self.parts = parts

    def __array__(self, dtype=None, copy=None):
        return np.concatenate(self.parts, axis=-2).astype(dtype or self.parts[0].dtype)


def needs_dense_mask(case: Case) -> bool:
    """Whether torch SDPA is given a dense ``(T, T)`` bool mask for this case."""
    va = case.variant
    return va.seqlens is None and (va.window is not None or va.sparse_block is not None)


def skip_reason(provider: str, case: Case, max_slow_t: int) -> str | None:
    """Why ``provider`` does not run the variant ``case`` (None when it does)."""
    va = case.variant
    if provider in ("numpy-naive", "numpy-tiled", "flashtile-torch"):
        return f"{provider} does not run variant cases"
    if provider in ("flashtile-dense", "flashtile-blockmask") and va.sparse_block is None:
        return f"{provider} runs only on block-sparse mask cases"
    if provider == "flashtile-per-seq" and va.seqlens is None:
        return f"{provider} runs only on varlen cases"
    if provider == "torch-sdpa" and needs_dense_mask(case) and max_slow_t < case.T:
        mib = f"{case.T * case.T / 2**20:.3g}"
        return f"torch-sdpa needs a {mib} MiB T x T mask; runs up to T={max_slow_t} (--max-slow-T)"
    return None


def provider_case(provider: str, case: Case) -> Case:
    """The problem ``provider`` solves on ``case`` (its reference and its FLOPs)."""
    if case.variant is not None and provider == "flashtile-dense":
        return dataclasses.replace(case, variant=case.variant.without_mask())
    return case


def make_call(provider: Provider, case: Case, inputs):
    """A zero-argument function running ``provider`` on the variant ``case`` once."""
    va, name, causal = case.variant, provider.name, case.causal
    q, k, v = (inputs[n] for n in "qkv")
    kw = flashtile_kwargs(va, case.T)
    if name == "torch-sdpa":
        return _torch_call(case, q, k, v)
    if va.seqlens is not None:
        cu = cu_seqlens(va)
        if name == "flashtile-per-seq":
            parts = [
                tuple(np.ascontiguousarray(a[:, :, s:e]) for a in (q, k, v))
                for s, e in itertools.pairwise(cu)
            ]
            return lambda: (Packed([flashtile.attention(*p, causal=causal, **kw) for p in parts]),)
        q3, k3, v3 = q[0], k[0], v[0]
        return lambda: (flashtile.varlen_attention(q3, k3, v3, cu, cu, causal=causal, **kw)[None],)
    if name == "flashtile-dense":
        kw.pop("mask")
    elif name == "flashtile-blockmask":
        b = va.sparse_block
        kw.update(mask=flashtile.block_mask(kw["mask"], b, b), block_q=b, block_k=b)
    return lambda: (flashtile.attention(q, k, v, causal=causal, **kw),)


def _torch_call(case: Case, q, k, v):
    torch = _import_torch()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    va = case.variant
    opts = {"enable_gqa": True} if va.kv_heads is not None else {}
    post = None
    if va.seqlens is not None:
        q, k, v, post = _padded(case, q, k, v, opts)
    elif needs_dense_mask(case):
        opts["attn_mask"] = torch.from_numpy(dense_mask(va, case.T, case.causal))
    else:
        opts["is_causal"] = case.causal
    qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))

    def call():
        with torch.no_grad():
            out = sdpa(qt, kt, vt, **opts).numpy()
        return (out if post is None else post(out),)

    return call


def _padded(case: Case, q, k, v, opts):
    """Right-padded ``(S, H, L_max, d)`` copies, the mask or is_causal, and the un-padding."""
    va = case.variant
    lens, cu = np.array(va.seqlens), cu_seqlens(va)
    L = int(lens.max())

    def pad(a):
        out = np.zeros((len(lens), a.shape[1], L, a.shape[3]), dtype=a.dtype)
        for s, (a0, n) in enumerate(zip(cu[:-1], lens, strict=True)):
            out[s, :, :n] = a[0, :, a0 : a0 + n]
        return out

    if case.causal and va.window is None:
        opts["is_causal"] = True  # right padding: valid queries never see padded keys
    else:
        left, right = normalize_window(va.window, case.causal)
        idx = np.arange(L)
        keep = visible(idx, idx, L, L, case.causal, left, right, kv_len=lens)
        opts["attn_mask"] = _import_torch().from_numpy(np.ascontiguousarray(keep))

    def post(out):
        return Packed([out[s : s + 1, :, :n] for s, n in enumerate(lens)])

    return pad(q), pad(k), pad(v), post


#: The goals of the variants preset, each a time ratio or a speedup.
WINDOW_SPEEDUP, WINDOW_STRETCH = 10.0, 20.0  # torch-sdpa with a bool mask / flashtile
SPARSE_RATIO = 1.5  # time / (kept block fraction x dense time)
GQA_SPEEDUP = 1.0  # torch-sdpa with enable_gqa / flashtile
VARLEN_RATIO = 1.2  # varlen_attention / per-sequence attention, summed
LINEARITY_RATIO = 1.3  # time(T2) / (T2/T1 x time(T1)) for a window


def target_lines(results) -> list[str]:
    """One line per target of the variants preset that the timed results allow to compute."""
    by_case = defaultdict(dict)
    for r in results:
        if r.case.variant is not None and r.median_s:
            by_case[r.case][r.provider] = r.median_s
    lines, windows = [], defaultdict(list)
    for case, t in by_case.items():
        va, f = case.variant, t.get("flashtile")
        if not f:
            continue
        name = f"{va.describe(case.H)} T={case.T} d={case.d}{' causal' if case.causal else ''}"
        torch = t.get("torch-sdpa")
        if va.window is not None and va.seqlens is None and va.sparse_block is None:
            windows[(va, case.causal, case.B, case.H, case.d)].append((case.T, f))
            if torch:
                what = f"{name}: time(torch-sdpa, bool mask) / time(flashtile)"
                lines.append(
                    target_line(
                        what,
                        torch / f,
                        WINDOW_SPEEDUP,
                        at_least=True,
                        unit="x",
                        stretch=WINDOW_STRETCH,
                    )
                )
        if va.sparse_block is not None and t.get("flashtile-dense"):
            frac = block_fraction(va, case.T)
            for p in ("flashtile", "flashtile-blockmask"):
                if p in t:
                    what = f"{name}: time({p}) / ({frac:.4f} x time(flashtile-dense))"
                    x = t[p] / (frac * t["flashtile-dense"])
                    lines.append(target_line(what, x, SPARSE_RATIO, at_least=False))
        if va.kv_heads is not None and torch:
            what = f"{name}: time(torch-sdpa, enable_gqa) / time(flashtile)"
            lines.append(target_line(what, torch / f, GQA_SPEEDUP, at_least=True, unit="x"))
        if va.seqlens is not None and t.get("flashtile-per-seq"):
            what = f"{name}: time(varlen_attention) / time(per-sequence attention, summed)"
            x = f / t["flashtile-per-seq"]
            lines.append(target_line(what, x, VARLEN_RATIO, at_least=False))
    for (va, *_, H, _d), points in windows.items():
        points.sort()
        for (t1, s1), (t2, s2) in itertools.pairwise(points):
            what = f"{va.describe(H)} linearity: time(T={t2}) / ({t2 / t1:g} x time(T={t1}))"
            lines.append(target_line(what, s2 / (t2 / t1 * s1), LINEARITY_RATIO, at_least=False))
    return lines
