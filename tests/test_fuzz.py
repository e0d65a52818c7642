"""Fuzz the batched entry points: attention, attention_backward, varlen_attention,
block_mask/BlockMask. Hostile but fair arguments; the verdict is in
:mod:`fuzz_support` (match the float64 oracle, or NaN where the policy allows,
or a ValueError/TypeError naming an argument)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashtile as ft
from fuzz_support import (
    ODDS,
    arrays,
    as64,
    call_or_refusal,
    check_lse,
    check_narrowed,
    check_rows,
    conditioning,
    dtypes,
    flags,
    fuzz_settings,
    ints,
    max_abs,
    maybe,
    mostly,
    odd,
    scales,
    sizes,
    softcaps,
    windows,
)

ATTENTION_NAMES = (
    *("q", "k", "v", "out", "lse", "dout", "causal", "scale", "return_lse", "block_q"),
    *("block_k", "window", "alibi_slopes", "softcap", "kv_lengths", "key_padding_mask"),
    *("mask", "Tq", "Tk", "d", "dv", "Hq", "Hkv", "cu_seqlens_q", "cu_seqlens_k"),
)


@st.composite
def qkv_shapes(draw, ndim=None):
    """``(q, k, v)`` shapes, usually consistent (GQA groups), sometimes not."""
    ndim = draw(st.sampled_from([4, 4, 4, 3, 2])) if ndim is None else ndim
    b, hkv = (
        draw(mostly(st.integers(1, 2), st.just(0))),
        draw(mostly(st.integers(1, 2), st.just(0))),
    )
    hq = draw(mostly(st.sampled_from([1, 1, 2, 3]).map(lambda g: g * hkv), st.integers(0, 3)))
    tq, tk, d, dv = draw(sizes(6)), draw(sizes(6)), draw(sizes(4)), draw(sizes(4))
    return tuple(s[4 - ndim :] for s in ((b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, dv)))


@st.composite
def variants(draw, shapes):
    """Variant keywords for inputs of ``shapes`` (mostly fitting, sometimes not)."""
    (qs, ks, _), kw = shapes, {}
    b = qs[0] if len(qs) == 4 else 1
    hq = qs[-3] if len(qs) >= 3 else 1
    tq, tk = qs[-2], ks[-2]
    if (window := draw(maybe(windows()))) is not None:
        kw["window"] = window
    if draw(st.integers(0, 3)) == 0 and (len(qs) >= 3 or draw(odd())):  # needs a head axis
        shape = draw(mostly(st.sampled_from([(hq,), (b, hq)]), st.just((hq + 1,))))
        dtype = draw(mostly(st.sampled_from([np.float64, np.float32]), dtypes()))
        kw["alibi_slopes"] = draw(arrays(shape, dtype, specials=False, layouts=False))
    if (softcap := draw(maybe(softcaps()))) is not None:
        kw["softcap"] = softcap
    pad = draw(st.sampled_from([None, None, "lengths", "kpm"]))
    if len(qs) < 4 and not draw(odd()):  # padding needs (B, H, T, d) inputs
        pad = None
    if pad == "lengths":
        length = mostly(st.integers(0, tk), st.sampled_from([-1, tk + 1]), 4 * ODDS)
        lengths = draw(st.lists(length, min_size=b, max_size=b))
        dtype = draw(mostly(st.sampled_from(["i8", "i4", "u8"]), st.just("f8")))
        kw["kv_lengths"] = np.array(lengths).astype(dtype)
    elif pad == "kpm":
        kw["key_padding_mask"] = draw(arrays((b, tk), np.float64, layouts=False)) > 0
    kind = draw(st.sampled_from([None, None, "bool", "float", "block"]))
    if kind and draw(odd()):
        kind = "int"  # refused: masks are bool or float
    good = st.sampled_from([(tq, tk), (b, hq, tq, tk), (1, tk)])
    mshape = draw(mostly(good, st.just((tq + 1, tk))))
    if kind in ("bool", "block"):
        kw["mask"] = draw(arrays(mshape, np.float64, layouts=False)) > -0.5
        if kind == "block":
            bq, bk = draw(ints(1, 5)), draw(ints(1, 5))
            kw["mask"] = call_or_refusal(
                lambda: ft.block_mask(kw["mask"], bq, bk), ("mask", "block_q", "block_k")
            )
    elif kind == "float":
        m = draw(arrays(mshape, draw(mostly(st.just(np.float64), dtypes())), layouts=False))
        kw["mask"] = np.where(m > 1.5, -np.inf, m) if m.dtype.kind == "f" else m
    elif kind == "int":
        kw["mask"] = np.ones(mshape, dtype=np.int32)
    return {key: val for key, val in kw.items() if val is not None}


def existing_keys(kw, shapes) -> np.ndarray | None:
    """``(B, Tk)`` keys that padding leaves, or None."""
    tk = shapes[1][-2]
    if "kv_lengths" in kw:
        return np.arange(tk) < np.asarray(kw["kv_lengths"])[:, None]
    return kw.get("key_padding_mask")


def free_rows(q, k, v, kw, shapes) -> np.ndarray:
    """Rows where the NaN policy allows anything: broadcastable to ``(..., Tq)``."""
    q_bad = ~np.isfinite(as64(q)).all(axis=-1)
    kv_bad = np.concatenate(
        [~np.isfinite(as64(k)).all(axis=-1), ~np.isfinite(as64(v)).all(axis=-1)], axis=-1
    )
    keep = existing_keys(kw, shapes)
    if keep is not None:
        kv_bad = kv_bad & np.concatenate([keep, keep], axis=-1)[:, None, :]
    return q_bad | kv_bad.any()


def score_extra(kw, tq: int, tk: int) -> float:
    extra = max_abs(kw.get("alibi_slopes", 0.0)) * max(tq, tk)
    mask = kw.get("mask")
    if isinstance(mask, np.ndarray) and mask.dtype.kind == "f":
        extra += max_abs(mask)
    return extra


def oracle(q, k, v, causal, scale, kw):
    """float64 ``(out, lse)`` of the reference (naive for out, tiled for lse)."""
    args = (as64(q), as64(k), as64(v))
    with np.errstate(all="ignore"):  # overflowing or non-finite inputs
        out = ft.naive_attention(*args, causal=causal, scale=scale, **kw)[0]
        lse = ft.tiled_attention(*args, 3, causal, scale=scale, return_lse=True, **kw)[1]
    return out, lse


@st.composite
def attention_calls(draw, ndim=None):
    shapes = draw(qkv_shapes(ndim))
    dtype = draw(dtypes())
    q, k, v = (draw(arrays(s, dtype)) for s in shapes)
    call = {"causal": draw(flags()), "scale": draw(scales()), "return_lse": draw(flags())}
    for name in ("block_q", "block_k"):
        if draw(st.integers(0, 3)) == 0:
            call[name] = draw(ints(1, 5))
    return q, k, v, shapes, call, draw(variants(shapes))


def verdict(q, k, v, shapes, call, kw, out, lse):
    """Check a successful forward against the oracle and the NaN policy."""
    causal, scale = call["causal"], call["scale"]
    ref, ref_lse = call_or_refusal(lambda: oracle(q, k, v, causal, scale, kw), ())
    d = shapes[0][-1]
    real_scale = 1 / np.sqrt(d) if scale is None else float(scale)
    cond = conditioning(q.dtype, real_scale, d, q, k, score_extra(kw, shapes[0][-2], shapes[1][-2]))
    free = free_rows(q, k, v, kw, shapes)
    assert out.dtype == q.dtype
    check_rows(out, ref, free, cond, max_abs(v), q.dtype, "attention out")
    if lse is not None:
        assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
        check_lse(lse, ref_lse, free, cond)
    return ref, ref_lse, cond, free


@fuzz_settings(80)
@given(attention_calls())
def test_fuzz_attention(case):
    q, k, v, shapes, call, kw = case
    got = call_or_refusal(lambda: ft.attention(q, k, v, **call, **kw), ATTENTION_NAMES)
    if got is not None:
        out, lse = got if call["return_lse"] else (got, None)
        verdict(q, k, v, shapes, call, kw, out, lse)


@fuzz_settings(30)
@given(attention_calls(ndim=4), st.data())
def test_fuzz_attention_backward(case, data):
    q, k, v, shapes, call, kw = case
    call = {"causal": call["causal"], "scale": call["scale"]}
    fwd = call_or_refusal(
        lambda: ft.attention(q, k, v, return_lse=True, **call, **kw), ATTENTION_NAMES
    )
    if fwd is None:
        return
    ref, ref_lse, cond, free = verdict(q, k, v, shapes, {**call}, kw, *fwd)
    out, lse = fwd
    dout = data.draw(arrays(out.shape, data.draw(dtypes()), specials=False))
    if data.draw(odd()):  # a wrong shape or dtype
        with np.errstate(invalid="ignore"):
            out = data.draw(st.sampled_from([out[..., :1, :], out.astype(np.int32), out.T]))
    grads = call_or_refusal(
        lambda: ft.attention_backward(q, k, v, out, lse, dout, **call, **kw), ATTENTION_NAMES
    )
    if grads is None or free.any() or cond > 1e-4 or not np.isfinite(as64(dout)).all():
        return
    want = ft.tiled_attention_backward(
        as64(q), as64(k), as64(v), out=ref, lse=ref_lse, dout=as64(dout), block_size=3, **call, **kw
    )
    d = shapes[0][-1]
    real_scale = 1 / np.sqrt(d) if call["scale"] is None else abs(float(call["scale"]))
    big = (1 + real_scale) * (1 + max_abs(q, k)) * (1 + max_abs(v)) * (1 + max_abs(dout))
    if big * (shapes[1][-2] + 1) > float(np.finfo(np.float32).max) / 1e3:
        return  # dout . v past float32's range: the policy allows NaN gradients
    for g, w, a, name in zip(grads, want, (q, k, v), ("dq", "dk", "dv"), strict=True):
        assert g.shape == a.shape and g.dtype == a.dtype
        check_narrowed(g, w, 100 * cond * big * (shapes[1][-2] + 1), name)


def test_check_narrowed_takes_only_the_overflows_its_tolerance_allows():
    # A float16 gradient whose true value is 0, off by 8.6e9 in float32 (the
    # fuzz found one: dout near 1e19, one visible key): inf within a 4e16
    # tolerance, but not within 1e3, and never NaN.
    got, want = np.array([0.0, -np.inf], np.float16), np.zeros(2)
    check_narrowed(got, want, 4e16, "dq")
    with pytest.raises(AssertionError, match="1 of 2 outside"):
        check_narrowed(got, want, 1e3, "dq")
    with pytest.raises(AssertionError, match="NaN"):
        check_narrowed(np.array([np.nan], np.float16), np.zeros(1), 4e16, "dq")
    with pytest.raises(AssertionError, match="outside"):  # finite, off by more than atol
        check_narrowed(np.array([70.0, 1.0], np.float16), np.array([1e5, 1.0]), 1e3, "dq")
    check_narrowed(np.array([np.inf], np.float16), np.array([7e4]), 0.0, "dq")  # past the range
    with pytest.raises(AssertionError, match="outside"):  # 65510 rounds to 65504, not inf
        check_narrowed(np.array([np.inf], np.float16), np.array([65500.0]), 10.0, "dq")
    # One float16 step from the oracle, inside the tolerance: 1.0006 rounds to 1.000977.
    check_narrowed(np.array([1.0009765625], np.float16), np.array([1.0004]), 2e-4, "dq")


@st.composite
def varlen_calls(draw):
    hkv = draw(mostly(st.integers(1, 2), st.just(0)))
    group = draw(st.sampled_from([1, 2]))
    lens_q = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
    lens_k = draw(st.lists(st.integers(0, 4), min_size=len(lens_q), max_size=len(lens_q)))
    d, dv, dtype = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(dtypes())
    q = draw(arrays((hkv * group, sum(lens_q), d), dtype))
    k = draw(arrays((hkv, sum(lens_k), d), dtype))
    v = draw(arrays((hkv, sum(lens_k), dv), dtype))
    cu_dtype = draw(
        mostly(st.sampled_from(["i8", "i4", "u4", "u8"]), st.sampled_from(["f8", "b1"]))
    )
    cus = [np.concatenate([[0], np.cumsum(n)]).astype(cu_dtype) for n in (lens_q, lens_k)]
    if draw(odd()):  # shuffled or shifted offsets
        cus[0] = draw(st.permutations(cus[0].tolist())) if cus[0].size > 2 else cus[0] + 1
    kw = {"causal": draw(flags()), "scale": draw(scales())}
    if (window := draw(maybe(windows()))) is not None:
        kw["window"] = window
    if (softcap := draw(maybe(softcaps()))) is not None:
        kw["softcap"] = softcap
    return q, k, v, *cus, lens_q, lens_k, kw


@fuzz_settings(50)
@given(varlen_calls())
def test_fuzz_varlen_attention(case):
    q, k, v, cu_q, cu_k, lens_q, lens_k, kw = case
    out = call_or_refusal(lambda: ft.varlen_attention(q, k, v, cu_q, cu_k, **kw), ATTENTION_NAMES)
    if out is None:
        return
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == q.dtype
    bq, bk = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_k])
    d = q.shape[-1]
    scale = 1 / np.sqrt(d) if kw["scale"] is None else float(kw["scale"])
    for s in range(len(lens_q)):
        if lens_q[s] == 0:
            continue
        qs, ks, vs = q[:, bq[s] : bq[s + 1]], k[:, bk[s] : bk[s + 1]], v[:, bk[s] : bk[s + 1]]
        got = out[:, bq[s] : bq[s + 1]]
        if lens_k[s] == 0:  # sees no key: zeros
            assert (got == 0).all()
            continue
        with np.errstate(all="ignore"):  # overflowing or non-finite inputs
            ref = ft.naive_attention(as64(qs), as64(ks), as64(vs), **kw)[0]
        kv_bad = not (np.isfinite(as64(ks)).all() and np.isfinite(as64(vs)).all())
        free = ~np.isfinite(as64(qs)).all(axis=-1) | kv_bad
        cond = conditioning(q.dtype, scale, d, qs, ks)
        check_rows(got, ref, free, cond, max_abs(vs), q.dtype, f"varlen sequence {s}")


def brute_states(mask4, bq, bk):
    """Tile states by definition: 0 nothing kept, 2 all kept, 1 otherwise."""
    bm, hm, tq, tk = mask4.shape
    nq, nk = -(-tq // bq), -(-tk // bk)
    states = np.zeros((bm, hm, nq, nk), dtype=np.int8)
    for i in range(nq):
        for j in range(nk):
            tile = mask4[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            states[:, :, i, j] = np.where(tile.all(axis=(2, 3)), 2, tile.any(axis=(2, 3)) * 1)
    return states


@fuzz_settings(60)
@given(st.data())
def test_fuzz_block_mask(data):
    ndim = data.draw(mostly(st.integers(2, 4), st.sampled_from([0, 1, 5])))
    shape = tuple(data.draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    mask = data.draw(arrays(shape, np.float64, specials=False)) > 0
    if data.draw(odd()):
        mask = mask.astype(data.draw(st.sampled_from([np.int8, np.float32, object])))
    bq, bk = data.draw(ints(1, 7)), data.draw(ints(1, 7))
    names = ("mask", "block_q", "block_k", "states")
    states = None
    if data.draw(st.booleans()):
        states = data.draw(arrays(data.draw(st.sampled_from([(1, 1, 2, 2), (1,)])), np.float64))
        states = (np.abs(np.nan_to_num(states)) % 3).astype(
            data.draw(st.sampled_from(["i1", "f8"]))
        )
    bm = call_or_refusal(lambda: ft.BlockMask(mask, bq, bk, states), names)
    if bm is None:
        return
    mask4 = np.asarray(mask).reshape((1,) * (4 - mask.ndim) + mask.shape)
    truth = brute_states(mask4, int(bq), int(bk))
    assert bm.states.shape == truth.shape
    assert ((bm.states == truth) | (bm.states == 1)).all()
    if states is None:
        np.testing.assert_array_equal(bm.states, truth)
    tq, tk = mask4.shape[2:]
    if 0 in mask4.shape:
        return
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((*mask4.shape[:2], t, 3)) for t in (tq, tk, tk))
    got = call_or_refusal(lambda: ft.attention(q, k, v, mask=bm), ATTENTION_NAMES)
    if got is not None:
        want = ft.naive_attention(q, k, v, mask=mask4)[0]
        np.testing.assert_allclose(got, want, atol=1e-12)
