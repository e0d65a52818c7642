"""flashtile.flash_attn: flash-attn 2's API on flashtile's kernels.

Every function is compared with a float64 dense oracle written here in torch
from flash-attn's formulas (flash-attn's ``(batch, seqlen, nheads, headdim)``
layout; checked once against tests/dense.py): forward values, ``softmax_lse``,
``S_dmask``, gradients by torch autograd through the oracle, the caches
after an in-place append. The same oracle run in float32 is the naive
float32 attention of the accuracy rule (a float32 result within 3x of its
error). Shapes are tiny and odd; the dropout and sinks paths of the fixed
functions skip until flashtile.torch.attention takes those keywords.
"""

from __future__ import annotations

import inspect
import math
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashtile  # noqa: E402
import flashtile.flash_attn as fa  # noqa: E402
import flashtile.torch as ftt  # noqa: E402
from dense import dense_variant_attention, rel_err, variant_visibility  # noqa: E402
from flashtile.flash_attn import checks  # noqa: E402


def _torch_takes(keyword: str) -> bool:
    return keyword in inspect.signature(ftt.attention).parameters


def _has_dropout() -> bool:
    return _torch_takes("dropout_p")


def _has_sinks() -> bool:
    return _torch_takes("sinks")


needs_torch_dropout = pytest.mark.skipif(
    not _has_dropout(), reason="flashtile.torch.attention has no dropout_p yet"
)
needs_torch_sinks = pytest.mark.skipif(
    not _has_sinks(), reason="flashtile.torch.attention has no sinks yet"
)


# -- the oracle ------------------------------------------------------------------------


def _dense(q, k, v, causal=False, window=None, softcap=None, alibi=None, scale=None, sinks=None,
           keep=None, dropout_p=0.0):  # fmt: skip
    """``(out (B, Tq, H, dv), lse (B, H, Tq), P (B, H, Tq, Tk))`` in the inputs' dtype.

    flash-attn's layout; k/v repeated per query head (GQA); ``keep (B, H, Tq, Tk)``
    applies dropout as ``P * keep / (1 - p)``. A row that sees no key gives zeros
    and ``lse = -inf`` (with sinks: ``lse = sink``).
    """
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    kr = k.repeat_interleave(hq // hkv, dim=2)
    vr = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kr) * (1 / math.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        slopes = alibi.to(s.dtype).reshape(-1 if alibi.ndim == 2 else 1, hq, 1, 1)
        dist = (torch.arange(tq)[:, None] + tk - tq - torch.arange(tk)[None, :]).abs()
        s = s - slopes * dist.to(s.dtype)
    vis = torch.from_numpy(variant_visibility((b, hq, tq, tk), causal, window=window))
    s = s.masked_fill(~vis, -torch.inf)
    row_max = s.amax(-1, keepdim=True) if tk else s.new_full((b, hq, tq, 1), -torch.inf)
    if sinks is not None:
        sink = sinks.to(s.dtype)[None, :, None, None]
        row_max = torch.maximum(row_max, sink)
    m = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - m)
    ell = e.sum(-1, keepdim=True)
    if sinks is not None:
        ell = ell + torch.exp(sink - m)
    p = e / torch.where(ell > 0, ell, torch.ones_like(ell))
    lse = torch.where(ell > 0, m + torch.log(ell), torch.full_like(ell, -torch.inf))[..., 0]
    pd = p if keep is None else p * keep / (1 - dropout_p)
    return torch.einsum("bhij,bjhd->bihd", pd, vr), lse, p


def _inputs(b, tq, tk, hq, hkv, d, dv=None, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, tq, hq, d), (b, tk, hkv, d), (b, tk, hkv, dv or d))
    return tuple(torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes)


def _f64(*ts):
    return tuple(None if t is None else t.detach().double() for t in ts)


def _assert_float32_accuracy(out, q, k, v, **kw):
    """The accuracy rule: within 3x the error of naive float32 attention, vs float64."""
    ref = _dense(*_f64(q, k, v), **kw)[0]
    naive = _dense(q, k, v, **kw)[0]
    err = rel_err(out.detach().numpy(), ref.numpy())
    assert err <= 3 * max(rel_err(naive.detach().numpy(), ref.numpy()), 1e-7), err
    return ref


def test_oracle_agrees_with_tests_dense():
    q, k, v = _inputs(2, 5, 9, 4, 2, 3)
    alibi = torch.tensor([[0.5, 0.1, 0.2, 0.0], [0.3, 0.3, 0.05, 0.7]], dtype=torch.float64)
    kw = {"causal": True, "window": (4, None), "softcap": 1.5}
    out, lse, _ = _dense(q, k, v, alibi=alibi, **kw)
    want, want_lse = dense_variant_attention(
        *(t.transpose(1, 2).numpy() for t in (q, k, v)), alibi_slopes=alibi.numpy(), **kw
    )
    assert rel_err(out.transpose(1, 2).numpy(), want) < 1e-14
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-14)


# -- fixed length ----------------------------------------------------------------------

# (B, Tq, Tk, Hq, Hkv, d, dv, keywords of flash_attn_func)
FIXED_CASES = [
    ("plain Tq<Tk", (2, 5, 13, 3, 3, 8, 8), {}),
    ("causal GQA window softcap", (2, 7, 13, 4, 2, 8, 5),
     {"causal": True, "window_size": (4, -1), "softcap": 3.0, "softmax_scale": 0.4}),
    ("causal Tq>Tk MQA batch alibi", (2, 11, 6, 4, 1, 8, 8), {"causal": True, "alibi": "batch"}),
    ("two-sided window head alibi", (1, 9, 9, 2, 2, 3, 3),
     {"window_size": (2, 1), "alibi": "head"}),
]  # fmt: skip


def _fixed_case(dims, keywords, dtype, grad=False):
    b, tq, tk, hq, hkv, d, dv = dims
    q, k, v = _inputs(b, tq, tk, hq, hkv, d, dv, dtype=dtype, seed=tq * tk, grad=grad)
    kw = dict(keywords)
    alibi = kw.pop("alibi", None)
    if alibi == "batch":
        alibi = torch.linspace(0.05, 0.9, b * hq).reshape(b, hq)
    elif alibi == "head":
        alibi = torch.tensor([0.5, 0.125])
    window = kw.get("window_size", (-1, -1))
    oracle = {
        "causal": kw.get("causal", False), "softcap": kw.get("softcap"), "alibi": alibi,
        "scale": kw.get("softmax_scale"),
        "window": None if window == (-1, -1) else tuple(None if s < 0 else s for s in window),
    }  # fmt: skip
    return (q, k, v), dict(kw, alibi_slopes=alibi), oracle


@pytest.mark.parametrize(("name", "dims", "keywords"), FIXED_CASES, ids=[c[0] for c in FIXED_CASES])
def test_flash_attn_func_float32_matches_the_oracle(name, dims, keywords):
    (q, k, v), kw, oracle = _fixed_case(dims, keywords, torch.float32)
    out, lse, probs = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert out.shape == (*q.shape[:3], v.shape[3]) and out.is_contiguous()
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    _assert_float32_accuracy(out, q, k, v, **oracle)
    _, ref_lse, ref_p = _dense(*_f64(q, k, v), **oracle)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs.double(), ref_p, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("name", "dims", "keywords"), FIXED_CASES, ids=[c[0] for c in FIXED_CASES])
def test_flash_attn_func_gradients_match_autograd_float64(name, dims, keywords):
    (q, k, v), kw, oracle = _fixed_case(dims, keywords, torch.float64, grad=True)
    out = fa.flash_attn_func(q, k, v, deterministic=True, **kw)
    ref = _dense(q, k, v, **oracle)[0]
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    assert rel_err(out.detach().numpy(), ref.detach().numpy()) < 1e-12
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and rel_err(g.numpy(), w.numpy()) < 1e-11


def test_packed_fixed_functions_equal_flash_attn_func():
    q, k, v = _inputs(2, 7, 7, 4, 4, 8, grad=True)
    kw = {"causal": True, "softcap": 2.0}
    qkv = torch.stack([q, k, v], dim=2).detach().requires_grad_()
    kv = torch.stack([k, v], dim=2).detach().requires_grad_()
    want = fa.flash_attn_func(q, k, v, **kw)
    torch.testing.assert_close(fa.flash_attn_qkvpacked_func(qkv, **kw), want, rtol=0, atol=0)
    out = fa.flash_attn_kvpacked_func(q, kv, **kw)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    dout = torch.randn_like(want)
    (dkv,) = torch.autograd.grad(out, (kv,), dout)
    dk, dv = torch.autograd.grad(want, (k, v), dout)
    torch.testing.assert_close(dkv, torch.stack([dk, dv], dim=2), rtol=1e-12, atol=1e-12)
    (dqkv,) = torch.autograd.grad(fa.flash_attn_qkvpacked_func(qkv, **kw), (qkv,), dout)
    assert dqkv.shape == qkv.shape


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float16, 5e-3), (torch.bfloat16, 3e-2),
                                              (torch.float64, 1e-13)])  # fmt: skip
def test_other_dtypes(dtype, bound):
    q, k, v = _inputs(1, 6, 10, 4, 2, 16, dtype=dtype, grad=True)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref = _dense(*_f64(q, k, v), causal=True)[0]
    assert rel_err(out.detach().double().numpy(), ref.numpy()) < bound
    dq = torch.autograd.grad(out.float().sum(), q)[0]
    assert dq.dtype == dtype and torch.isfinite(dq).all()


@needs_torch_sinks
def test_fixed_sinks_match_the_oracle_and_get_gradients():
    q, k, v = _inputs(2, 5, 9, 4, 2, 8, grad=True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    out, lse, probs = fa.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_attn_probs=True)
    ref, ref_lse, ref_p = _dense(q, k, v, causal=True, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(probs, ref_p.detach(), rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    want = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def _check_dropout_pattern(out, probs, q, k, v, p, **oracle):
    """``S_dmask`` marks what was dropped: the output and the gradients are the
    oracle's with that keep pattern."""
    keep = probs >= 0
    assert (~keep).any() and keep.any()
    _, _, ref_p = _dense(*_f64(q, k, v), **oracle)
    torch.testing.assert_close(probs.abs(), ref_p, rtol=1e-12, atol=1e-12)
    ref = _dense(q, k, v, keep=keep, dropout_p=p, **oracle)[0]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@needs_torch_dropout
def test_fixed_dropout_pattern_and_gradients():
    q, k, v = _inputs(2, 6, 9, 4, 2, 8, grad=True)
    torch.manual_seed(7)
    out, _, probs = fa.flash_attn_func(q, k, v, 0.3, causal=True, return_attn_probs=True)
    torch.manual_seed(7)
    torch.testing.assert_close(fa.flash_attn_func(q, k, v, 0.3, causal=True), out)
    _check_dropout_pattern(out, probs, q, k, v, 0.3, causal=True)


# -- variable length -------------------------------------------------------------------

# Sequence lengths (queries, keys): one without queries, one whose queries see no key.
VARLEN_Q, VARLEN_K = [3, 0, 5, 4, 2], [5, 4, 7, 0, 9]


def _varlen_case(hq, hkv, d, dtype, grad=False, seed=3):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor(np.cumsum([0, *VARLEN_Q]), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0, *VARLEN_K]), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g, dtype=dtype).requires_grad_(grad)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=g, dtype=dtype).requires_grad_(grad)
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=g, dtype=dtype).requires_grad_(grad)
    return q, k, v, cu_q, cu_k


def _varlen_oracle(q, k, v, cu_q, cu_k, alibi=None, **kw):
    """Sequence by sequence through :func:`_dense`: ``(out, lse (H, total_q), S padded)``."""
    outs, lses = [], []
    probs = torch.zeros(len(cu_q) - 1, q.shape[1], max(VARLEN_Q), max(VARLEN_K), dtype=q.dtype)
    for s in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if qb == qa:
            continue
        if kb == ka:
            outs.append(q.new_zeros(qb - qa, q.shape[1], v.shape[2]) * q[qa:qb].sum())
            lses.append(torch.full((q.shape[1], qb - qa), -torch.inf, dtype=q.dtype))
            continue
        slopes = None if alibi is None else (alibi if alibi.ndim == 1 else alibi[s])
        o, lse, p = _dense(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], alibi=slopes, **kw)
        outs.append(o[0])
        lses.append(lse[0])
        probs[s, :, : qb - qa, : kb - ka] = p[0].detach()
    return torch.cat(outs), torch.cat(lses, 1), probs


VARLEN_KEYWORDS = [
    ("causal GQA", {"causal": True}),
    ("window softcap", {"window_size": (2, 1), "softcap": 2.5}),
    ("causal per-sequence alibi", {"causal": True, "alibi": "batch"}),
]


def _varlen_keywords(keywords, hq):
    kw = dict(keywords)
    alibi = kw.pop("alibi", None)
    if alibi == "batch":
        alibi = torch.linspace(0.05, 1.0, len(VARLEN_Q) * hq).reshape(len(VARLEN_Q), hq)
    window = kw.get("window_size", (-1, -1))
    oracle = {
        "causal": kw.get("causal", False), "softcap": kw.get("softcap"), "alibi": alibi,
        "window": None if window == (-1, -1) else window,
    }  # fmt: skip
    return dict(kw, alibi_slopes=alibi), oracle


@pytest.mark.parametrize(("name", "keywords"), VARLEN_KEYWORDS, ids=[c[0] for c in VARLEN_KEYWORDS])
def test_varlen_float32_matches_the_oracle(name, keywords):
    q, k, v, cu_q, cu_k = _varlen_case(4, 2, 8, torch.float32)
    kw, oracle = _varlen_keywords(keywords, 4)
    out, lse, probs = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), return_attn_probs=True, **kw
    )
    assert out.shape == (q.shape[0], 4, 8) and out.is_contiguous() and lse.shape == (4, 14)
    ref, ref_lse, ref_p = _varlen_oracle(*_f64(q, k, v), cu_q, cu_k, **oracle)
    naive = _varlen_oracle(q, k, v, cu_q, cu_k, **oracle)[0]
    err = rel_err(out.numpy(), ref.numpy())
    assert err <= 3 * max(rel_err(naive.numpy(), ref.numpy()), 1e-7)
    np.testing.assert_array_equal(torch.isinf(lse).numpy(), torch.isinf(ref_lse).numpy())
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], rtol=1e-5, atol=1e-5)
    assert probs.shape == ref_p.shape
    torch.testing.assert_close(probs.double(), ref_p, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("name", "keywords"), VARLEN_KEYWORDS, ids=[c[0] for c in VARLEN_KEYWORDS])
def test_varlen_gradients_match_autograd_float64(name, keywords):
    q, k, v, cu_q, cu_k = _varlen_case(4, 2, 8, torch.float64, grad=True)
    kw, oracle = _varlen_keywords(keywords, 4)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), **kw)
    ref = _varlen_oracle(q, k, v, cu_q, cu_k, **oracle)[0]
    assert rel_err(out.detach().numpy(), ref.detach().numpy()) < 1e-12
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g.numpy(), w.numpy()) < 1e-11


def test_packed_and_paged_varlen_equal_flash_attn_varlen_func(rng):
    q, k, v, cu_q, cu_k = _varlen_case(2, 2, 8, torch.float64, grad=True)
    want = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 9, causal=True)
    kv = torch.stack([k, v], dim=1)
    out = fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 5, 9, causal=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # Same lengths for queries and keys: the qkv-packed form.
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    qkv = torch.randn(11, 3, 2, 8, dtype=torch.float64)
    got = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True)
    ref = fa.flash_attn_varlen_func(*qkv.unbind(1), cu, cu, 7, 7, causal=True)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # Paged keys: pages of 3 keys scattered by a random block table.
    page, lengths = 3, np.diff(cu_k.numpy())
    blocks = -(-lengths // page)
    order = rng.permutation(int(blocks.sum()) + 2)  # two spare pages never read
    table = torch.full((len(lengths), int(blocks.max())), -1, dtype=torch.int32)
    k_pages = torch.zeros(len(order), page, 2, 8, dtype=torch.float64)
    v_pages = torch.zeros_like(k_pages)
    used = 0
    for s in range(len(lengths)):
        for j in range(int(blocks[s])):
            table[s, j] = int(order[used])
            rows = slice(
                int(cu_k[s]) + j * page, min(int(cu_k[s + 1]), int(cu_k[s]) + (j + 1) * page)
            )
            k_pages[order[used], : rows.stop - rows.start] = k.detach()[rows]
            v_pages[order[used], : rows.stop - rows.start] = v.detach()[rows]
            used += 1
    paged = fa.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_q, cu_k, 5, 9, causal=True, block_table=table
    )
    torch.testing.assert_close(paged, want, rtol=0, atol=0)


def test_varlen_without_any_query_or_key():
    q = torch.randn(0, 2, 4, requires_grad=True)
    k = torch.randn(5, 2, 4, requires_grad=True)
    none = torch.tensor([0, 0, 0], dtype=torch.int32)
    out, lse, _ = fa.flash_attn_varlen_func(
        q, k, k, none, torch.tensor([0, 2, 5], dtype=torch.int32), 0, 3, return_attn_probs=True
    )
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)
    q = torch.randn(3, 2, 4, requires_grad=True)
    out, lse, probs = fa.flash_attn_varlen_func(
        q, k[:0], k[:0], torch.tensor([0, 3], dtype=torch.int32), none[:2], 3, 0,
        return_attn_probs=True,
    )  # fmt: skip
    assert (out == 0).all() and torch.isneginf(lse).all() and probs.shape == (1, 2, 3, 0)
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert (dq == 0).all()


def test_varlen_sinks_match_the_oracle_and_get_gradients():
    q, k, v, cu_q, cu_k = _varlen_case(4, 2, 8, torch.float64, grad=True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    out, lse, _ = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 5, 9, causal=True, sinks=sinks, return_attn_probs=True
    )
    ref, ref_lse = [], []
    for s in range(len(VARLEN_Q)):
        qa, qb, ka, kb = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        o, l_, _ = _dense(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], True, sinks=sinks)
        ref.append(o[0])
        ref_lse.append(l_[0])
    ref, ref_lse = torch.cat(ref), torch.cat(ref_lse, 1)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse.detach(), rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    want = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_varlen_dropout_pattern_and_gradients():
    q, k, v, cu_q, cu_k = _varlen_case(2, 2, 8, torch.float64, grad=True)
    torch.manual_seed(11)
    out, _, probs = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 5, 9, 0.4, causal=True, return_attn_probs=True
    )
    torch.manual_seed(11)
    again = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 9, 0.4, causal=True)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert (probs < 0).any()
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    # The oracle with the keep pattern S_dmask shows, sequence by sequence.
    ref = []
    for s in range(len(VARLEN_Q)):
        qa, qb, ka, kb = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        if qb == qa:
            continue
        keep = probs[s : s + 1, :, : qb - qa, : kb - ka] >= 0
        o = _dense(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], True, keep=keep, dropout_p=0.4)
        ref.append(o[0][0])
    ref = torch.cat(ref)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


# -- KV cache --------------------------------------------------------------------------


def _rotary_oracle(x, cos, sin, positions, interleaved):
    """Pairs rotated by the angle of their position, written from the formula."""
    x, out = x.double(), x.double().clone()
    half = cos.shape[1]
    first = torch.arange(0, 2 * half, 2) if interleaved else torch.arange(half)
    second = first + 1 if interleaved else first + half
    c, s = cos.double()[positions][:, :, None, :], sin.double()[positions][:, :, None, :]
    x1, x2 = x[..., first], x[..., second]
    out[..., first], out[..., second] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def _kvcache_oracle(q, k_rows, v_rows, starts, ends, **kw):
    """Each batch entry's keys ``[start, end)`` of its logical cache row, through :func:`_dense`."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        a, e = int(starts[b]), int(ends[b])
        alibi = kw.get("alibi")
        one = dict(kw, alibi=None if alibi is None else alibi[b])
        if e == a:
            outs.append(torch.zeros(1, *q.shape[1:3], v_rows.shape[-1], dtype=torch.float64))
            lses.append(torch.full((1, q.shape[2], q.shape[1]), -torch.inf, dtype=torch.float64))
            continue
        o, lse, _ = _dense(q[b : b + 1], k_rows[b : b + 1, a:e], v_rows[b : b + 1, a:e], **one)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _paged(k_rows, v_rows, page, rng):
    """Logical ``(B, T, H, d)`` caches as pages shuffled by a random block table (and
    three spare pages of noise): ``(k_pages, v_pages, table)``."""
    b, t = k_rows.shape[:2]
    per = -(-t // page)
    order = torch.from_numpy(rng.permutation(b * per + 3))
    table = order[: b * per].reshape(b, per)
    pages = []
    for rows_ in (k_rows, v_rows):
        tail = rows_.shape[2:]
        p = torch.randn(len(order), page, *tail, dtype=rows_.dtype)
        padded = torch.cat([rows_, rows_.new_zeros(b, per * page - t, *tail)], 1)
        p[table.flatten()] = padded.reshape(b * per, page, *tail)
        pages.append(p)
    return pages[0], pages[1], table.to(torch.int32)


def _logical(pages, table, t):
    return pages[table.long()].flatten(1, 2)[:, :t]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_appends_rotates_and_attends_float64(rng, layout, interleaved):
    batch, tq, tn, hq, hkv, d, capacity, rows_total = 3, 2, 2, 4, 2, 8, 13, 5
    causal = interleaved  # causal: queries at cache_seqlens + i; else all at cache_seqlens
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, tq, hq, d, generator=g, dtype=torch.float64)
    k_new = torch.randn(batch, tn, hkv, d, generator=g, dtype=torch.float64)
    v_new = torch.randn(batch, tn, hkv, d, generator=g, dtype=torch.float64)
    k_rows = torch.randn(rows_total, capacity, hkv, d, generator=g, dtype=torch.float64)
    v_rows = torch.randn(rows_total, capacity, hkv, d, generator=g, dtype=torch.float64)
    seqlens = torch.tensor([4, 0, 9], dtype=torch.int32)
    leftpad = torch.tensor([1, 0, 6], dtype=torch.int32)
    angle = torch.rand(capacity, 3, generator=g, dtype=torch.float64) * 2 * math.pi
    cos, sin = angle.cos(), angle.sin()
    slot = torch.tensor([4, 0, 2]) if layout == "contiguous" else torch.arange(batch)
    kw = {"rotary_cos": cos, "rotary_sin": sin, "cache_seqlens": seqlens, "cache_leftpad": leftpad,
          "causal": causal, "rotary_interleaved": interleaved, "softcap": 4.0,
          "return_softmax_lse": True}  # fmt: skip
    if layout == "contiguous":
        k_cache, v_cache = k_rows.clone(), v_rows.clone()
        out, lse = fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_batch_idx=slot.to(torch.int32), **kw
        )
        k_after, v_after = k_cache[slot], v_cache[slot]
        untouched = [r for r in range(rows_total) if r not in slot.tolist()]
        assert torch.equal(k_cache[untouched], k_rows[untouched])
    else:
        k_cache, v_cache, table = _paged(k_rows[:batch], v_rows[:batch], 4, rng)
        out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                              block_table=table, **kw)  # fmt: skip
        k_after, v_after = _logical(k_cache, table, capacity), _logical(v_cache, table, capacity)
    # The cache after the append: the rotated new keys and the new values, in place.
    at = seqlens.long()[:, None] + torch.arange(tn)
    k_want, v_want = k_rows[slot].clone(), v_rows[slot].clone()
    rows_b = torch.arange(batch)[:, None].expand_as(at)
    k_want[rows_b, at] = _rotary_oracle(k_new, cos, sin, at, interleaved)
    v_want[rows_b, at] = v_new
    torch.testing.assert_close(k_after, k_want, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(v_after, v_want, rtol=0, atol=0)
    q_at = seqlens.long()[:, None] + (torch.arange(tq) if causal else torch.zeros(tq, dtype=int))
    q_rot = _rotary_oracle(q, cos, sin, q_at, interleaved)
    want, want_lse = _kvcache_oracle(q_rot, k_want, v_want, leftpad, seqlens + tn, causal=causal,
                                     softcap=4.0)  # fmt: skip
    assert rel_err(out.numpy(), want.numpy()) < 1e-12
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hkv", [1, 2])
def test_kvcache_float32_variants_and_splits(hkv):
    """No new keys: window, ALiBi per batch entry, a scale, sinks, num_splits; MQA
    (hkv=1) reads the cache as its own pages, GQA as one-token pages."""
    batch, tq, hq, d, capacity = 2, 3, 4, 16, 600
    g = torch.Generator().manual_seed(2)
    q = torch.randn(batch, tq, hq, d, generator=g)
    k_cache = torch.randn(batch, capacity, hkv, d, generator=g)
    v_cache = torch.randn(batch, capacity, hkv, d, generator=g)
    seqlens = torch.tensor([517, 2], dtype=torch.int32)
    alibi = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.5, 0.0, 0.05, 0.01]])
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0])
    kw = {"causal": True, "window_size": (300, -1), "alibi_slopes": alibi, "softmax_scale": 0.3}
    kw["sinks"] = sinks
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=3,
                                     **kw)  # fmt: skip
    oracle = {"causal": True, "window": (300, None), "alibi": alibi, "scale": 0.3, "sinks": sinks}
    zero = torch.zeros(batch, dtype=torch.int32)
    ref = _kvcache_oracle(*_f64(q, k_cache, v_cache), zero, seqlens, **oracle)[0]
    naive = _kvcache_oracle(q, k_cache, v_cache, zero, seqlens, **oracle)[0]
    err = rel_err(out.numpy(), ref.numpy())
    assert err <= 3 * max(rel_err(naive.numpy(), ref.numpy()), 1e-7)
    auto = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **kw)
    torch.testing.assert_close(auto, out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kvcache_16_bit(dtype):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 1, 4, 32, generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(2, 40, 2, 32, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 32, generator=g).to(dtype) for _ in range(2))
    seqlens = torch.tensor([30, 7], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)
    assert out.dtype == dtype and torch.equal(k_cache[1, 7], k[1, 0])
    ref = _kvcache_oracle(*_f64(q, k_cache, v_cache), [0, 0], seqlens + 1, causal=True)[0]
    assert rel_err(out.double().numpy(), ref.numpy()) < 3e-2


def test_apply_rotary_emb_matches_the_formula_and_its_gradient():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    angle = torch.rand(20, 3, generator=g, dtype=torch.float64)
    offsets = torch.tensor([0, 7])
    for interleaved in (True, False):
        out = fa.apply_rotary_emb(x, angle.cos(), angle.sin(), interleaved, seqlen_offsets=offsets)
        at = torch.arange(5)[None, :] + offsets[:, None]
        want = _rotary_oracle(x, angle.cos(), angle.sin(), at, interleaved)
        torch.testing.assert_close(out, want, rtol=1e-14, atol=1e-14)
        (dx,) = torch.autograd.grad(out, x, out)  # a rotation: the gradient of |out|^2 / 2 is x
        torch.testing.assert_close(dx, x.detach(), rtol=1e-13, atol=1e-13)
    packed = fa.apply_rotary_emb(x.detach()[0], angle.cos(), angle.sin(),
                                 cu_seqlens=torch.tensor([0, 2, 5]))  # fmt: skip
    at = torch.tensor([[0, 1, 0, 1, 2]])
    want = _rotary_oracle(x.detach()[:1], angle.cos(), angle.sin(), at, False)[0]
    torch.testing.assert_close(packed, want, rtol=1e-14, atol=1e-14)


# -- the Triton paths, in Triton's interpreter on CPU tensors --------------------------


@pytest.fixture
def triton_paths(monkeypatch):
    """Send the varlen and KV-cache functions down their CUDA branches (Triton kernels),
    which conftest runs in Triton's interpreter on CPU tensors."""
    pytest.importorskip("triton")
    from flashtile import triton as gpu

    if not gpu.INTERPRET:
        pytest.skip("the Triton kernels run in the interpreter only with TRITON_INTERPRET=1")
    monkeypatch.setattr(checks, "on_gpu", lambda t: True)


@pytest.mark.usefixtures("triton_paths")
def test_triton_varlen_and_kvcache_paths():
    q, k, v, cu_q, cu_k = _varlen_case(2, 1, 8, torch.float32)
    sinks = torch.tensor([1.0, -0.5])
    out, lse, probs = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 5, 9, causal=True, return_attn_probs=True, sinks=sinks
    )
    ref, ref_lse, ref_p = _varlen_oracle(*_f64(q, k, v), cu_q, cu_k, causal=True, sinks=sinks)
    assert rel_err(out.numpy(), ref.numpy()) < 1e-5
    seen = torch.isfinite(ref_lse)  # (the oracle leaves rows without keys at -inf)
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs.double(), ref_p, rtol=0, atol=1e-5)
    g = torch.Generator().manual_seed(6)
    qd = torch.randn(2, 1, 4, 8, generator=g)
    k_cache, v_cache = (torch.randn(3, 10, 2, 8, generator=g) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 8, generator=g) for _ in range(2))
    seqlens, leftpad = torch.tensor([3, 6], dtype=torch.int32), torch.tensor([0, 2])
    idx = torch.tensor([2, 0], dtype=torch.int32)
    for pad in (None, leftpad.to(torch.int32)):
        kc, vc = k_cache.clone(), v_cache.clone()
        got = fa.flash_attn_with_kvcache(
            qd, kc, vc, k_new, v_new, cache_seqlens=seqlens, cache_batch_idx=idx,
            cache_leftpad=pad, causal=True, sinks=sinks.repeat(2),
        )  # fmt: skip
        kr, vr = kc[idx.long()].double(), vc[idx.long()].double()
        starts = torch.zeros(2, dtype=torch.long) if pad is None else leftpad
        want = _kvcache_oracle(
            qd.double(), kr, vr, starts, seqlens + 1, causal=True, sinks=sinks.repeat(2)
        )[0]
        assert rel_err(got.numpy(), want.numpy()) < 1e-5
        assert torch.equal(kc[2, 3], k_new[0, 0]) and torch.equal(vc[0, 6], v_new[1, 0])
    from flashtile import triton as gpu

    if not checks.accepts(gpu.varlen_attention, "dropout_p"):
        with pytest.raises(TypeError, match="takes no dropout_p="):
            fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 9, 0.1)


# -- the import shim -------------------------------------------------------------------


@pytest.fixture
def clean_flash_attn():
    """Save and restore every ``flash_attn*`` entry of sys.modules and the meta path."""
    saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "flash_attn"}
    for name in saved:
        del sys.modules[name]
    meta_path = list(sys.meta_path)
    yield
    fa.uninstall()
    for name in [n for n in sys.modules if n.split(".")[0] == "flash_attn"]:
        del sys.modules[name]
    sys.modules.update(saved)
    sys.meta_path[:] = meta_path


@pytest.mark.usefixtures("clean_flash_attn")
def test_install_makes_flash_attn_imports_resolve_to_flashtile():
    module = fa.install()
    assert fa.install() is module and fa.installed()
    import flash_attn
    from flash_attn import flash_attn_func, flash_attn_with_kvcache
    from flash_attn.flash_attn_interface import flash_attn_varlen_func
    from flash_attn.layers.rotary import apply_rotary_emb

    assert flash_attn is module and flash_attn.__version__.endswith(
        f"+flashtile.{flashtile.__version__}"
    )
    assert (
        flash_attn_func is fa.flash_attn_func
        and flash_attn_varlen_func is fa.flash_attn_varlen_func
    )
    assert flash_attn_with_kvcache is fa.flash_attn_with_kvcache
    assert apply_rotary_emb is fa.apply_rotary_emb
    assert flash_attn.flash_attn_interface.flash_attn_func is fa.flash_attn_func
    with pytest.raises(ModuleNotFoundError, match="bert_padding is part of the real flash-attn"):
        import flash_attn.bert_padding
    fa.uninstall()
    assert "flash_attn" not in sys.modules and not fa.installed()


@pytest.mark.usefixtures("clean_flash_attn")
def test_install_refuses_when_a_real_flash_attn_is_imported():
    real = types.ModuleType("flash_attn")
    real.__file__ = "/site-packages/flash_attn/__init__.py"
    sys.modules["flash_attn"] = real
    with pytest.raises(ImportError, match=r"already imported .*site-packages"):
        fa.install()
    assert sys.modules["flash_attn"] is real


# -- clear errors ----------------------------------------------------------------------


def test_clear_errors():
    q, k, v = _inputs(1, 4, 4, 2, 2, 8, dtype=torch.float32)
    func, cache = fa.flash_attn_func, fa.flash_attn_with_kvcache
    k3 = torch.randn(1, 4, 3, 8)
    heads_outer = torch.randn(1, 2, 4, 8).transpose(1, 2)  # a token's heads are not adjacent
    one = torch.zeros(1, dtype=torch.int32)
    cos = torch.ones(4, 2)
    cases = [
        (TypeError, "FP8 descaling", lambda: func(q, k, v, q_descale=1.0)),
        (TypeError, "sinks=", lambda: func(q, k, v, learnable_sink=q)),
        (TypeError, "flash-attn 2.x's signatures", lambda: func(q, k, v, casual=True)),
        (TypeError, "block_table", lambda: cache(q, k, v, page_table=q)),
        (TypeError, "inference only", lambda: cache(q, k, v, dropout_p=0.1)),
        (ValueError, "window_size left=-2", lambda: func(q, k, v, window_size=(-2, 0))),
        (ValueError, "softcap must be 0.0", lambda: func(q, k, v, softcap=-1.0)),
        (ValueError, r"dropout_p must lie in \[0, 1\)", lambda: func(q, k, v, 1.0)),
        (ValueError, "multiple of the number", lambda: func(q, k3, k3)),
        (ValueError, r"expected \(total_q", lambda: fa.flash_attn_varlen_func(q, k, v, 0, 0, 4, 4)),
        (ValueError, "appended at cache_seqlens", lambda: cache(q, k, v, k[:, :1], v[:, :1])),
        (ValueError, "rotate the new keys", lambda: cache(q, k, v, rotary_cos=cos, rotary_sin=cos)),
        (
            ValueError,
            r"cache_seqlens = \[4\] must lie in \[0, 3\]",
            lambda: cache(q, k.clone(), v.clone(), k[:, :1], v[:, :1], cache_seqlens=4),
        ),
        (
            ValueError,
            "reorder block_table",
            lambda: cache(q, k, v, block_table=one[:, None], cache_batch_idx=one),
        ),
        (ValueError, "allocate the cache contiguous", lambda: cache(q, heads_outer, heads_outer)),
        (
            ValueError,
            r"block_table\[0, 1\] = -1 is not a page",
            lambda: cache(q, k, v, block_table=torch.tensor([[0, -1]]).int(), cache_seqlens=6),
        ),
    ]
    for kind, message, call in cases:
        with pytest.raises(kind, match=message):
            call()
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(TypeError, match="FP8 attention is flash-attn 3's"):
            func(q.to(torch.float8_e4m3fn), k, v)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q = 1 but a sequence has 2"):
        fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 1, 2)
    with pytest.raises(ValueError, match="must start at 0, never decrease"):
        fa.flash_attn_varlen_func(q[0], k[0], v[0], cu.flip(0), cu, 2, 2)
