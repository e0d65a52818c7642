"""flashtile.flash_attn: flash-attn 2's API on flashtile's kernels.

Every function is compared with a float64 dense oracle written here in torch
from flash-attn's formulas (flash-attn's ``(batch, seqlen, nheads, headdim)``
layout; checked once against tests/dense.py): forward values, ``softmax_lse``,
``S_dmask``, gradients by torch autograd through the oracle, the caches
after an in-place append. The same oracle run in float32 is the naive
float32 attention of the accuracy rule (a float32 result within 3x of its
error). Shapes are tiny and odd. The KV cache, rotary, the Triton paths,
the import shim and the errors: test_flash_attn_kvcache.py.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashtile.flash_attn as fa  # noqa: E402
from dense import dense_variant_attention, rel_err  # noqa: E402
from flash_attn_oracle import (  # noqa: E402
    VARLEN_K,
    VARLEN_Q,
    _assert_float32_accuracy,
    _dense,
    _f64,
    _inputs,
    _varlen_case,
    _varlen_oracle,
)


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


def test_fixed_dropout_pattern_and_gradients():
    q, k, v = _inputs(2, 6, 9, 4, 2, 8, grad=True)
    torch.manual_seed(7)
    out, _, probs = fa.flash_attn_func(q, k, v, 0.3, causal=True, return_attn_probs=True)
    torch.manual_seed(7)
    torch.testing.assert_close(fa.flash_attn_func(q, k, v, 0.3, causal=True), out)
    _check_dropout_pattern(out, probs, q, k, v, 0.3, causal=True)


# -- variable length -------------------------------------------------------------------

# Sequence lengths (queries, keys): one without queries, one whose queries see no key.
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


def test_varlen_probabilities_are_padded_to_the_max_seqlen_passed():
    # flash-attn sizes S_dmask by the max_seqlen arguments: a bucketed length pads it.
    q, k, v, cu_q, cu_k = _varlen_case(4, 2, 8, torch.float32)
    longest_q, longest_k = max(VARLEN_Q), max(VARLEN_K)
    _, _, want = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, longest_q, longest_k, return_attn_probs=True
    )
    _, _, probs = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, longest_q + 3, longest_k + 5, return_attn_probs=True
    )
    assert probs.shape == (len(VARLEN_Q), 4, longest_q + 3, longest_k + 5)
    torch.testing.assert_close(probs[:, :, :longest_q, :longest_k], want, rtol=0, atol=0)
    assert not probs[:, :, longest_q:].any() and not probs[..., longest_k:].any()


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
