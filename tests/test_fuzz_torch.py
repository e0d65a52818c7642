"""Fuzz the torch operator ``flashtile.torch.attention`` (forward and gradients).

The verdict is in :mod:`fuzz_support`: match the float64 oracle (NaN only
where the policy allows), or raise ValueError/TypeError naming an argument.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashtile as ft
from fuzz_support import (
    arrays,
    call_or_refusal,
    check_lse,
    check_rows,
    conditioning,
    flags,
    fuzz_settings,
    max_abs,
    maybe,
    mostly,
    scales,
    sizes,
    softcaps,
    windows,
)

torch = pytest.importorskip("torch")
ftt = pytest.importorskip("flashtile.torch")

NAMES = (
    *("q", "k", "v", "causal", "scale", "window", "alibi_slopes", "softcap", "mask"),
    *("enable_gqa", "return_lse", "Hq", "Hkv", "heads", "d"),
)
GOOD = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
ODD = (torch.int32, torch.complex64, torch.bool)
#: Rounding of each output dtype, and the dtype the kernels compute in.
EPS_GRAD = {torch.float32: np.float32, torch.float64: np.float64}
EPS = {torch.float64: 2.2e-16, torch.float32: 1.2e-7, torch.float16: 9.8e-4, torch.bfloat16: 7.9e-3}


def tensor(a: np.ndarray, dtype):
    with np.errstate(invalid="ignore", over="ignore"):
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(dtype)
    return t


@st.composite
def torch_calls(draw):
    ndim = draw(mostly(st.sampled_from([4, 4, 3]), st.sampled_from([2, 5])))
    b, hkv = (
        draw(mostly(st.integers(1, 2), st.just(0))),
        draw(mostly(st.integers(1, 2), st.just(0))),
    )
    group = draw(st.sampled_from([1, 2]))
    tq, tk, d, dv = (draw(sizes(4)) for _ in range(4))
    lead = (1, b) if ndim == 5 else (b,)
    shapes = [
        (*lead, h, t, w)[-ndim:] for h, t, w in ((hkv * group, tq, d), (hkv, tk, d), (hkv, tk, dv))
    ]
    dtype = draw(mostly(st.sampled_from(GOOD), st.sampled_from(ODD)))
    q, k, v = (tensor(draw(arrays(s, np.float64, layouts=False)), dtype) for s in shapes)
    if draw(st.integers(0, 3)) == 0 and q.ndim >= 2:  # not contiguous
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    gqa = st.just(True) if group > 1 else st.booleans()  # GQA needs enable_gqa, as in SDPA
    kw = {
        "causal": draw(flags()),
        "enable_gqa": draw(mostly(gqa, flags())),
        "return_lse": draw(flags()),
    }
    for name, strategy in (("scale", scales()), ("window", windows()), ("softcap", softcaps())):
        if (value := draw(maybe(strategy))) is not None:
            kw[name] = value
    if draw(st.integers(0, 3)) == 0:
        slopes = draw(arrays((hkv * group,), np.float64, specials=False))
        kw["alibi_slopes"] = tensor(slopes, torch.float32)
    kind = draw(st.sampled_from([None, None, "bool", "float"]))
    if kind:
        shape = draw(mostly(st.sampled_from([(tq, tk), (1, tk)]), st.just((tq + 1, tk))))
        m = draw(arrays(shape, np.float64))
        kw["mask"] = torch.from_numpy(m > -0.5 if kind == "bool" else np.where(m > 1.5, -np.inf, m))
    return q, k, v, kw, draw(st.booleans())


@fuzz_settings(40)
@given(torch_calls())
def test_fuzz_torch_attention(case):
    q, k, v, kw, grad = case
    if grad and q.dtype.is_floating_point:
        q.requires_grad_(True)
    got = call_or_refusal(lambda: ftt.attention(q, k, v, **kw), NAMES)
    if got is None:
        return
    out, lse = got if kw["return_lse"] else (got, None)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:-1], v.shape[-1])
    variants = {key: val for key, val in kw.items() if key not in ("enable_gqa", "return_lse")}
    for key in ("mask", "alibi_slopes"):
        if key in variants:
            variants[key] = variants[key].numpy()
    q64, k64, v64 = (t.detach().double().numpy() for t in (q, k, v))
    with np.errstate(all="ignore"):
        ref = ft.naive_attention(q64, k64, v64, **variants)[0]
        ref_lse = ft.tiled_attention(q64, k64, v64, 3, return_lse=True, **variants)[1]
    work = np.float64 if q.dtype == torch.float64 else np.float32
    scale = 1 / np.sqrt(q.shape[-1]) if kw.get("scale") is None else float(kw["scale"])
    extra = max_abs(kw.get("alibi_slopes", torch.zeros(1)).numpy()) * (q.shape[-2] + k.shape[-2])
    if kind_is_float(kw):
        extra += max_abs(kw["mask"].numpy())
    cond = conditioning(work, scale, q.shape[-1], q64, k64, extra)
    kv_bad = not (np.isfinite(k64).all() and np.isfinite(v64).all())
    free = ~np.isfinite(q64).all(axis=-1) | kv_bad
    wide = out.detach().float() if q.dtype == torch.bfloat16 else out.detach()
    out_dtype = np.float32 if q.dtype == torch.bfloat16 else wide.numpy().dtype
    cond_out = cond + (EPS[torch.bfloat16] if q.dtype == torch.bfloat16 else 0.0)
    check_rows(wide.numpy(), ref, free, cond_out, max_abs(v64), out_dtype, "torch out")
    if lse is not None:
        check_lse(lse.numpy(), ref_lse, free, cond)
    if q.requires_grad and not free.any() and cond < 1e-4 and q.dtype in EPS_GRAD:
        dout = torch.ones_like(out)
        out.backward(dout)
        want = ft.attention_backward(q64, k64, v64, ref, ref_lse, np.ones(ref.shape), **variants)[0]
        with np.errstate(over="ignore"):  # rounded to the gradient's dtype (inf past it)
            want = want.astype(EPS_GRAD[q.dtype]).astype(np.float64)
            tol = 1e3 * (cond + EPS[q.dtype]) * (1 + max_abs(want))
        np.testing.assert_allclose(q.grad.double().numpy(), want, rtol=0, atol=tol)


def kind_is_float(kw) -> bool:
    return "mask" in kw and kw["mask"].dtype != torch.bool
