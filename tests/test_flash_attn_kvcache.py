"""flashtile.flash_attn: flash_attn_with_kvcache, rotary embeddings, the Triton
paths (in Triton's interpreter), the import shim and the errors, against the
float64 oracle of tests/flash_attn_oracle.py (fixed length and varlen:
test_flash_attn.py)."""

from __future__ import annotations

import math
import sys
import types

import pytest

torch = pytest.importorskip("torch")

import flashtile  # noqa: E402
import flashtile.flash_attn as fa  # noqa: E402
from dense import rel_err  # noqa: E402
from flash_attn_oracle import _dense, _f64, _inputs, _varlen_case, _varlen_oracle  # noqa: E402
from flashtile.flash_attn import checks  # noqa: E402

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


@pytest.mark.parametrize(
    "hkv, dtype, lengths, extra",
    [
        (1, torch.float32, torch.int32, {"causal": True, "softmax_scale": 0.4}),
        (2, torch.bfloat16, torch.int64, {"window_size": (3, 0), "softcap": 2.0}),
        (2, torch.float32, int, {"causal": True}),  # no new keys
        (2, torch.float16, None, {}),  # every key, no new keys
    ],
)
def test_a_decoding_loop_is_checked_once_then_runs_its_stored_step(
    monkeypatch, hkv, dtype, lengths, extra
):
    """A serving loop's calls (one metadata; cache_seqlens growing unevenly as
    a tensor, an int, or none) take the whole check once; later calls run the
    stored step (kvcache_steps): they append where the whole path does, give
    its results bit for bit and the oracle's, and lengths past the capacity
    still get the whole check's error. MQA (hkv=1) reads the transposed cache,
    GQA one-token pages."""
    from flashtile import frontdoor
    from flashtile.flash_attn import kvcache

    frontdoor._PREPARED.clear()  # (a record of an earlier test would skip the first check)
    checked = []
    check_caches = kvcache._check_caches
    monkeypatch.setattr(kvcache, "_check_caches", lambda *a: checked.append(1) or check_caches(*a))
    batch, hq, d, capacity = 2, 4, 16, 40
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(batch, capacity, hkv, d, generator=g).to(dtype) for _ in "kv")
    seqlens = torch.tensor([3, 11], dtype=torch.int32)
    appending = lengths in (torch.int32, torch.int64)
    oracle = {"causal": extra.get("causal", False), "scale": extra.get("softmax_scale")}
    oracle |= {"window": (3, 0), "softcap": 2.0} if "softcap" in extra else {}
    for step in range(4):
        q = torch.randn(batch, 1, hq, d, generator=g).to(dtype)
        k, v = (torch.randn(batch, 1, hkv, d, generator=g).to(dtype) for _ in "kv")
        new = {"k": k, "v": v} if appending else {}
        given = seqlens.to(lengths) if appending else None
        if lengths is int:
            given = int(seqlens[0])
        kw = {"cache_seqlens": given, "return_softmax_lse": True, **new, **extra}
        out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
        if appending:  # (written through NumPy: the caches' versions still count it)
            assert k_cache._version == v_cache._version == step + 1 + (step > 2)
            for b in range(batch):
                assert torch.equal(k_cache[b, seqlens[b]], k[b, 0])
                assert torch.equal(v_cache[b, seqlens[b]], v[b, 0])
        seen = {None: torch.full((batch,), capacity), int: seqlens[:1].expand(batch)}
        ends = seen.get(lengths, seqlens + 1)
        zero = torch.zeros(batch, dtype=torch.int32)
        ref, ref_lse = _kvcache_oracle(*_f64(q, k_cache, v_cache), zero, ends, **oracle)
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        assert rel_err(out.double().numpy(), ref.numpy()) < tolerance
        if dtype == torch.float32:
            torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
        if step == 2:  # the whole path (no stored steps), appending the same rows again
            frontdoor._PREPARED.clear()
            whole = fa.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
            assert torch.equal(whole[0], out) and torch.equal(whole[1], lse)
        seqlens = seqlens + torch.tensor([1 + step, 2], dtype=torch.int32)
    assert len(checked) == 2  # the first call, and the one after the clear
    if lengths is not None:  # out of range: a tensor past the capacity, a negative int
        kw["cache_seqlens"] = -1 if lengths is int else torch.tensor([capacity, 0], dtype=lengths)
        with pytest.raises(ValueError, match="cache_seqlens"):
            fa.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
        assert len(checked) == 3


def test_a_paged_decoding_loop_runs_its_stored_step(monkeypatch, rng):
    """With a block_table: the stored step (checked once) appends into the pages
    the table names and gives the whole path's results bit for bit and the
    oracle's; a table entry out of range on a stored key gets the whole
    check's error."""
    from flashtile import frontdoor
    from flashtile.flash_attn import kvcache

    frontdoor._PREPARED.clear()
    checked = []
    check_caches = kvcache._check_caches
    monkeypatch.setattr(kvcache, "_check_caches", lambda *a: checked.append(1) or check_caches(*a))
    batch, hq, hkv, d, t = 2, 4, 2, 16, 40
    g = torch.Generator().manual_seed(6)
    k_rows, v_rows = (torch.randn(batch, t, hkv, d, generator=g) for _ in "kv")
    k_pages, v_pages, table = _paged(k_rows, v_rows, 8, rng)
    seqlens = torch.tensor([3, 11], dtype=torch.int32)
    for step in range(3):
        q = torch.randn(batch, 1, hq, d, generator=g)
        k, v = (torch.randn(batch, 1, hkv, d, generator=g) for _ in "kv")
        kw = {"cache_seqlens": seqlens, "block_table": table, "causal": True}
        out, lse = fa.flash_attn_with_kvcache(
            q, k_pages, v_pages, k, v, return_softmax_lse=True, **kw
        )
        k_seen, v_seen = _logical(k_pages, table, t), _logical(v_pages, table, t)
        for b in range(batch):
            assert torch.equal(k_seen[b, seqlens[b]], k[b, 0])
        zero = torch.zeros(batch, dtype=torch.int32)
        ref = _kvcache_oracle(*_f64(q, k_seen, v_seen), zero, seqlens + 1, causal=True)[0]
        assert rel_err(out.numpy(), ref.numpy()) < 1e-5
        if step == 1:  # the whole path, appending the same rows again
            frontdoor._PREPARED.clear()
            whole = fa.flash_attn_with_kvcache(
                q, k_pages, v_pages, k, v, return_softmax_lse=True, **kw
            )
            assert torch.equal(whole[0], out) and torch.equal(whole[1], lse)
        seqlens = seqlens + torch.tensor([1, 3], dtype=torch.int32)
    assert len(checked) == 2
    kw["block_table"] = table.clone()
    kw["block_table"][1, 1] = k_pages.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = .* is not a page"):
        fa.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, **kw)
    assert len(checked) == 3


def test_a_models_layers_share_their_steps_plan(monkeypatch):
    """The layers of a decoding step (caches of one metadata, the same lengths)
    plan once per step (decode_planning.LengthsPlan): each layer still gets
    its own cache's results, and a new length or a route change plans again."""
    from flashtile import decode_planning, frontdoor, routes

    frontdoor._PREPARED.clear()
    planned = []
    plan = decode_planning.plan_decode
    monkeypatch.setattr(decode_planning, "plan_decode", lambda *a: planned.append(1) or plan(*a))
    batch, hq, hkv, d, capacity = 2, 4, 2, 16, 48
    g = torch.Generator().manual_seed(7)
    caches = [[torch.randn(batch, capacity, hkv, d, generator=g) for _ in "kv"] for _ in "ab"]
    seqlens = torch.tensor([5, 17], dtype=torch.int32)
    zero = torch.zeros(batch, dtype=torch.int32)
    for step in range(3):
        planned.clear()
        for k_cache, v_cache in caches:
            q = torch.randn(batch, 1, hq, d, generator=g)
            k, v = (torch.randn(batch, 1, hkv, d, generator=g) for _ in "kv")
            out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
            ref = _kvcache_oracle(*_f64(q, k_cache, v_cache), zero, seqlens + 1)[0]
            assert rel_err(out.numpy(), ref.numpy()) < 1e-5
        assert len(planned) == 1  # (in the first step, the second layer's)
        if step == 1:  # a route change (GENERATION moves): the same call plans again
            routes.forget()
            again = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
            assert len(planned) == 2 and torch.equal(again, out)
        seqlens = seqlens + torch.tensor([2, 1], dtype=torch.int32)


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
    # Dropout on the Triton path draws the CPU path's mask for the same seed, also
    # sequence by sequence (per-sequence ALiBi slopes: one call and offset each).
    slopes = torch.rand(5, 2, generator=torch.Generator().manual_seed(2)) + 0.1
    for alibi in (None, slopes):
        dropped = []
        for path in ("triton", "cpu"):
            torch.manual_seed(9)
            checks.on_gpu = lambda t, gpu=path == "triton": gpu  # (the fixture restores it)
            dropped.append(
                fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 9, 0.3, causal=True,
                                          alibi_slopes=alibi)
            )  # fmt: skip
        torch.testing.assert_close(dropped[0], dropped[1], rtol=1e-5, atol=1e-6)


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


def test_empty_batches_bad_sinks_and_bad_rotary_positions():
    """No key (or no query) in a fixed-length call gives zeros as flash-attn does;
    sinks are checked there too; rotary positions must be integers in range."""
    q, k, v = _inputs(2, 3, 0, 2, 1, 8)
    out, lse, probs = fa.flash_attn_func(q, k, v, return_attn_probs=True, sinks=[0.5, -1.0])
    assert out.shape == (2, 3, 2, 8) and not out.any() and probs.shape == (2, 2, 3, 0)
    assert torch.equal(
        lse, torch.tensor([0.5, -1.0], dtype=lse.dtype)[None, :, None].expand(2, 2, 3)
    )
    with pytest.raises(ValueError, match="NaN"):
        fa.flash_attn_func(q, k, v, sinks=[float("nan"), 0.0])
    with pytest.raises(ValueError, match=r"\(Hq,\) = \(2,\)"):
        fa.flash_attn_func(q, k, v, sinks=[0.0])
    x = torch.randn(1, 4, 2, 8)
    cos, sin = torch.ones(16, 4), torch.zeros(16, 4)
    with pytest.raises(ValueError, match="negative"):
        fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=-5)
    with pytest.raises(TypeError, match="integers"):
        fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([1.7]))
    with pytest.raises(TypeError, match="both rotary_cos and rotary_sin"):
        fa.apply_rotary_emb(x, cos, None)


def test_kvcache_window_past_the_cache_is_not_local_for_rotary():
    """flash-attn counts a window side of at least the cache length as unbounded,
    also when it picks the queries' rotary positions (seqlen_q > 1, non-causal)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 2, 8, generator=g, dtype=torch.float64)
    kc, vc = (torch.randn(1, 6, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    kn, vn = (torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = (
        torch.rand(8, 4, generator=g, dtype=torch.float64),
        torch.rand(8, 4, dtype=torch.float64),
    )
    outs = [
        fa.flash_attn_with_kvcache(
            q, kc.clone(), vc.clone(), kn, vn, cos, sin, cache_seqlens=3, window_size=window
        )
        for window in ((-1, -1), (6, -1))
    ]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
