"""Fuzz decoding and merging: decode_attention, KVCache, merge_states.

The verdict is in :mod:`fuzz_support`: match the float64 oracle (NaN only
where the policy allows), or raise ValueError/TypeError naming an argument.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import flashtile as ft
from flashtile.kvlayout import check_cache
from fuzz_support import (
    ODDS,
    arrays,
    as64,
    call_or_refusal,
    check_lse,
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

DECODE_NAMES = (
    *("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "num_splits", "causal"),
    *("scale", "window", "alibi_slopes", "softcap", "return_lse", "Hq", "Hkv", "B", "d"),
)
CACHE_NAMES = (
    *("batch", "kv_heads", "head_dim", "capacity", "value_dim", "dtype", "page_size"),
    *("num_pages", "k", "v", "batch_index", *DECODE_NAMES),
)


@st.composite
def decode_calls(draw):
    b, hkv = (
        draw(mostly(st.integers(1, 2), st.just(0))),
        draw(mostly(st.integers(1, 2), st.just(0))),
    )
    hq = draw(mostly(st.sampled_from([1, 2]).map(lambda g: g * hkv), st.integers(0, 3)))
    tq, d, dv = draw(sizes(3)), draw(sizes(3)), draw(sizes(3))
    dtype = draw(dtypes())
    kw = {}
    if draw(st.booleans()):  # paged
        page, pages, width = draw(sizes(3)), draw(sizes(5)), draw(sizes(3))
        lead, rows = pages, page
        entry = mostly(st.integers(0, max(pages - 1, 0)), st.sampled_from([-1, pages]), 4 * ODDS)
        table = draw(st.lists(entry, min_size=b * width, max_size=b * width))
        kw["block_table"] = np.array(table, dtype=np.int64).reshape(b, width)
    else:
        lead, rows = b, draw(sizes(6))
    layouts = draw(odd())  # the cache must be C-contiguous
    k_cache = draw(arrays((lead, hkv, rows, d), dtype, layouts=layouts))
    v_cache = draw(arrays((lead, hkv, rows, dv), dtype, layouts=layouts))
    q = draw(arrays((b, hq, tq, d), draw(mostly(st.just(dtype), dtypes()))))
    if draw(st.booleans()):
        capacity = rows * (kw["block_table"].shape[1] if "block_table" in kw else 1)
        length = mostly(st.integers(0, capacity), st.sampled_from([-1, capacity + 1]), 4 * ODDS)
        lengths = draw(st.lists(length, min_size=b, max_size=b))
        cu_dtype = draw(mostly(st.sampled_from(["i8", "u4"]), st.just("f8")))
        kw["cache_seqlens"] = np.array(lengths).astype(cu_dtype)
    if (splits := draw(maybe(ints(1, 4)))) is not None:
        kw["num_splits"] = splits
    for name, strategy in (("window", windows()), ("softcap", softcaps()), ("scale", scales())):
        if (value := draw(maybe(strategy))) is not None:
            kw[name] = value
    if draw(st.integers(0, 3)) == 0:
        shape = draw(st.sampled_from([(hq,), (b, hq)]))
        kw["alibi_slopes"] = draw(arrays(shape, np.float64, specials=False))
    kw["causal"], kw["return_lse"] = draw(flags()), draw(flags())
    return q, k_cache, v_cache, kw


@fuzz_settings(60)
@given(decode_calls())
def test_fuzz_decode_attention(case):
    q, k_cache, v_cache, kw = case
    got = call_or_refusal(lambda: ft.decode_attention(q, k_cache, v_cache, **kw), DECODE_NAMES)
    if got is None:
        return
    out, lse = got if kw["return_lse"] else (got, None)
    ref_kw = {key: val for key, val in kw.items() if key not in ("num_splits", "return_lse")}
    with np.errstate(all="ignore"):
        ref, ref_lse = ft.reference.decode_attention(
            as64(q), as64(k_cache), as64(v_cache), return_lse=True, **ref_kw
        )
    _, layout = check_cache(q, k_cache, v_cache, kw.get("cache_seqlens"), kw.get("block_table"))
    seqs = [layout.sequence(b) for b in range(q.shape[0])]
    kv_bad = np.array(
        [not (np.isfinite(as64(k)).all() and np.isfinite(as64(v)).all()) for k, v in seqs]
    )
    free = ~np.isfinite(as64(q)).all(axis=-1) | kv_bad.reshape(-1, 1, 1)
    scale = 1 / np.sqrt(q.shape[-1]) if kw.get("scale") is None else float(kw["scale"])
    capacity = layout.table.shape[1] * layout.page
    extra = max_abs(kw.get("alibi_slopes", 0.0)) * (capacity + q.shape[2])
    d = q.shape[-1]
    cond = max([conditioning(k_cache.dtype, scale, d, q, k, extra) for k, _ in seqs], default=0.0)
    assert out.dtype == q.dtype
    check_rows(out, ref, free, cond, max_abs(*[v for _, v in seqs]), q.dtype, "decode out")
    if lse is not None:
        check_lse(lse, ref_lse, free, cond)


@st.composite
def cache_sessions(draw):
    args = {
        "batch": draw(ints(1, 3)),
        "kv_heads": draw(ints(1, 2)),
        "head_dim": draw(ints(1, 3)),
        "capacity": draw(ints(1, 6)),
    }
    for name, lo, hi in (("value_dim", 1, 3), ("page_size", 1, 4), ("num_pages", 1, 8)):
        if name == "num_pages" and "page_size" not in args and draw(mostly(st.just(1), st.none())):
            break  # num_pages needs page_size: passing it alone is refused
        if (value := draw(maybe(ints(lo, hi)))) is not None:
            args[name] = value
    args["dtype"] = draw(dtypes())
    steps = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**32 - 1)), max_size=4))
    return args, steps, draw(st.data())


def some_rows(b: int):
    """A non-empty subset of ``range(b)``, in any order."""
    return st.permutations(range(b)).flatmap(lambda p: st.integers(1, b).map(lambda n: p[:n]))


@fuzz_settings(40)
@given(cache_sessions())
def test_fuzz_kv_cache(session):
    args, steps, data = session
    cache = call_or_refusal(lambda: ft.KVCache(**args), CACHE_NAMES)
    if cache is None:
        return
    b, hkv, d, dv = cache.batch, cache.k.shape[1], cache.k.shape[3], cache.v.shape[3]
    history = [[np.zeros((hkv, 0, d)), np.zeros((hkv, 0, dv))] for _ in range(b)]
    for t, _seed in steps:
        fair = st.one_of(st.none(), some_rows(b))  # all sequences, or some in any order
        rows = data.draw(mostly(fair, st.lists(st.integers(-1, b), max_size=b)))
        n = b if rows is None else len(rows)
        k = data.draw(arrays((n, hkv, t, d), data.draw(dtypes())))
        v = data.draw(arrays((n, hkv, t, dv), k.dtype))
        before = cache.lengths.copy()
        done = call_or_refusal(
            lambda k=k, v=v, rows=rows: cache.append(k, v, batch_index=rows) or True, CACHE_NAMES
        )
        if done is None:  # refused: nothing may have been written
            assert (cache.lengths == before).all()
            continue
        for i, seq in enumerate(range(b) if rows is None else rows):
            with np.errstate(over="ignore", invalid="ignore"):
                stored = [a[i].astype(cache.dtype).astype(np.float64) for a in (k, v)]
            for a, kept in zip((k, v), stored, strict=True):  # a finite value never turns inf
                assert (np.isfinite(kept) == np.isfinite(as64(a[i]))).all(), "stored as inf"
            history[seq] = [
                np.concatenate([h, s], axis=1) for h, s in zip(history[seq], stored, strict=True)
            ]
    hq = hkv * data.draw(st.sampled_from([1, 2]))
    q = data.draw(arrays((b, hq, data.draw(st.integers(1, 2)), d), np.float32, specials=False))
    out = cache.attend(q)  # a valid call: any error fails the test
    for seq in range(b):
        k_seq, v_seq = history[seq]
        assert k_seq.shape[1] == cache.lengths[seq]
        if not (np.isfinite(k_seq).all() and np.isfinite(v_seq).all()):
            continue
        if k_seq.shape[1] == 0:  # an empty sequence: zeros
            assert (out[seq] == 0).all()
            continue
        with np.errstate(all="ignore"):
            ref = ft.naive_attention(as64(q[seq]), k_seq, v_seq, causal=True)[0]
        cond = conditioning(cache.dtype, 1 / np.sqrt(d), d, q[seq], k_seq)
        check_rows(
            out[seq], ref, np.zeros(ref.shape[:-1], bool), cond, max_abs(v_seq), q.dtype, "cache"
        )


LSE_VALUES = (0.0, 1.5, -3.0, -np.inf, -np.inf, np.nan, 1e300, -1e300, 700.0)


@fuzz_settings(60)
@given(st.data())
def test_fuzz_merge_states(data):
    lead = tuple(data.draw(st.lists(st.integers(0, 2), max_size=2)))
    t, dv = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    parts = []
    for _ in range(2):
        shape = data.draw(mostly(st.just((*lead, t, dv)), st.just((t + 1, dv))))
        out = data.draw(arrays(shape, data.draw(dtypes())))
        lse_shape = data.draw(mostly(st.just(shape[:-1]), st.just(shape)))
        value = mostly(st.sampled_from(LSE_VALUES), st.just(np.inf))  # +inf is refused
        picks = data.draw(st.lists(value, min_size=1, max_size=4))
        with np.errstate(over="ignore"):  # 1e300 in float32 or float16: inf
            lse = np.resize(np.array(picks), lse_shape).astype(data.draw(dtypes(odd=False)))
        parts.append((out, lse))
    (oa, la), (ob, lb) = parts
    names = ("out_a", "lse_a", "out_b", "lse_b")
    got = call_or_refusal(lambda: ft.merge_states(oa, la, ob, lb), names)
    if got is None:
        return
    out, lse = got
    a, b = as64(la), as64(lb)
    with np.errstate(all="ignore"):
        want_lse = np.logaddexp(a, b)
        m = np.where(np.isneginf(np.maximum(a, b)), 0.0, np.maximum(a, b))
        ea, eb = np.exp(a - m), np.exp(b - m)  # relative to the max: exact at 1e300 too
        wa, wb = ea / (ea + eb), eb / (ea + eb)
        wa, wb = np.nan_to_num(wa), np.nan_to_num(wb)  # both sides empty: 0 / 0
        want = np.nan_to_num(wa[..., None] * as64(oa)) + np.nan_to_num(wb[..., None] * as64(ob))
    free = np.isnan(a) | np.isnan(b)
    free |= (wa > 0) & ~np.isfinite(as64(oa)).all(axis=-1)
    free |= (wb > 0) & ~np.isfinite(as64(ob)).all(axis=-1)
    assert not (np.isposinf(a).any() or np.isposinf(b).any()), "lse = +inf must be refused"
    # As precise as the least precise input (float32 lse: float32 weights).
    eps = 4 * max(float(np.finfo(a.dtype).eps) for a in (oa, la, ob, lb))  # (a float16 eps
    # scalar would keep the tolerance in float16, where eps * 6e-21 underflows to 0)
    check_rows(out, want, free, eps, max_abs(oa, ob) + 1e-300, out.dtype, "merged out")
    keep = ~free
    np.testing.assert_allclose(as64(lse)[keep], want_lse[keep], rtol=eps, atol=eps)
