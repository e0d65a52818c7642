"""bfloat16 inputs: the bf16 tile products (oneMKL on a CPU with bf16
instructions) and the widening path, judged by FlashAttention's rule.

The rule: on the same bf16 inputs, flashtile's error against float64 is at
most twice the error of the same math done in bf16 by PyTorch (scores in
bf16, softmax in float32, probabilities cast to bf16), plus the error that
rounding the exact output to bf16 makes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import flashtile as ft
import flashtile.cpu.blas as blas
from dense import dense_attention, dense_attention_backward, rel_err
from flashtile import routes
from flashtile.cpu.half import bf16_bits, bf16_operand_bits, bf16_value, to_bfloat16

torch = pytest.importorskip("torch")

BF16 = ml_dtypes.bfloat16
#: The ways this machine can run bf16 products (the "bf16" route's usable
#: candidates): widened to float32 always; flashtile's vdpbf16ps gemm with
#: AVX512-BF16, oneMKL's bf16 gemm with bf16 instructions and oneMKL.
PATHS = list(blas.bf16_available())

# (B, Hq, Hkv, Tq, Tk, d): awkward sizes, Tq != Tk both ways, GQA and MQA.
SHAPES = [
    (1, 2, 2, 97, 97, 64),
    (2, 4, 2, 130, 257, 59),
    (1, 3, 1, 7, 1025, 3),
    (1, 2, 1, 600, 33, 128),
]


@pytest.fixture(params=PATHS)
def path(request):
    """Runs the test on each path, the route forced: ``"widen"`` (no bf16
    products) or a bf16 gemm (yields ``"bf16"`` then)."""
    with routes.force("bf16", request.param):
        assert blas.bf16_products() == (request.param != "widen")
        yield "widen" if request.param == "widen" else "bf16"


def bf16_qkv(rng, b, hq, hkv, tq, tk, d):
    def make(h, t):
        return rng.standard_normal((b, h, t, d)).astype(BF16)

    return make(hq, tq), make(hkv, tk), make(hkv, tk)


def torch_bf16_math(q, k, v, causal, dout=None):
    """The same attention done in bf16 by PyTorch: scores and ``P @ V`` in
    bf16, the softmax in float32, ``P`` cast to bf16. With ``dout``, the
    gradients of ``sum(out * dout)`` through that same math (autograd)."""
    tq_, tk_, tv_ = (as_torch(a).requires_grad_() for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = (tq_ @ tk_.repeat_interleave(group, 1).transpose(-1, -2)) * (1.0 / np.sqrt(q.shape[-1]))
    tq, tk = q.shape[2], k.shape[2]
    if causal:
        hidden = torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1)
        s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(torch.bfloat16)
    out = p @ tv_.repeat_interleave(group, 1)
    if dout is None:
        return out.detach().float().numpy()
    out.backward(as_torch(dout))
    return [t.grad.float().numpy() for t in (tq_, tk_, tv_)]


def as_torch(a):
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def float64_reference(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k64, v64 = (np.repeat(a.astype(np.float64), group, axis=1) for a in (k, v))
    return dense_attention(q.astype(np.float64), k64, v64, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_accuracy_rule(rng, path, shape, causal):
    q, k, v = bf16_qkv(rng, *shape)
    out, lse = ft.attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == BF16 and lse.dtype == np.float32
    ref, ref_lse = float64_reference(q, k, v, causal)
    rounding = rel_err(ref.astype(BF16), ref)
    limit = 2 * rel_err(torch_bf16_math(q, k, v, causal), ref) + rounding
    assert rel_err(out, ref) <= limit
    assert rel_err(out, ref) < 2 * rounding  # tighter: this test's inputs stay near the rounding
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-3


def test_no_float32_copy_of_the_inputs(rng, path):
    from flashtile.api import check_call
    from flashtile.planning import plan_forward

    q, k, v = bf16_qkv(rng, 1, 4, 2, 64, 80, 32)
    plan = plan_forward(check_call(q, k, v, True, None, {}))
    kept = path == "bf16"
    assert (plan.q4.dtype == BF16) == kept
    assert all(np.shares_memory(a, b) == kept for a, b in ((plan.q4, q), (plan.k4, k)))


def test_variants_and_empty_rows(rng, path):
    """A window, softcap, ALiBi and padding: the same variant code on bf16
    operands; a batch entry with no valid key gives zeros and -inf, no NaN."""
    q, k, v = bf16_qkv(rng, 2, 4, 2, 50, 70, 16)
    kw = dict(window=(20, 3), softcap=5.0, alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05]))
    out, lse = ft.attention(q, k, v, kv_lengths=np.array([0, 61]), return_lse=True, **kw)
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    ref, ref_lse = ft.attention(q32, k32, v32, kv_lengths=np.array([0, 61]), return_lse=True, **kw)
    assert not np.any(out[0]) and np.all(lse[0] == -np.inf)
    assert rel_err(out[1], ref[1]) < 1e-2
    assert np.abs(lse[1] - ref_lse[1]).max() < 1e-2


def test_scores_that_climb_rebase_exactly(rng, path):
    """Keys whose scores jump far above the first tile's: the re-base path
    recomputes rows from the bf16 operands and their scale."""
    q, k, v = bf16_qkv(rng, 1, 1, 1, 16, 1500, 8)
    k[0, 0, 1200] = (np.asarray(q[0, 0].astype(np.float32).mean(0)) * 40).astype(BF16)
    out = ft.attention(q, k, v, block_k=256)
    ref, _ = float64_reference(q, k, v, False)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "x".join(map(str, s)))
def test_gradient_accuracy_rule(rng, path, shape, causal):
    q, k, v = bf16_qkv(rng, *shape)
    out, lse = ft.attention(q, k, v, causal=causal, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(BF16)
    grads = ft.attention_backward(q, k, v, out, lse, dout, causal=causal)
    group = q.shape[1] // k.shape[1]
    k64, v64 = (np.repeat(a.astype(np.float64), group, axis=1) for a in (k, v))
    refs = list(dense_attention_backward(q, k64, v64, dout, causal=causal))
    for i in (1, 2):  # sum the GQA group's query heads back onto their kv head
        refs[i] = refs[i].reshape(k.shape[:2] + (group,) + refs[i].shape[2:]).sum(2)
    torch_grads = torch_bf16_math(q, k, v, causal, dout)
    for g, t, r in zip(grads, torch_grads, refs, strict=True):
        assert g.dtype == BF16
        assert rel_err(g, r) <= 2 * rel_err(t, r) + rel_err(r.astype(BF16), r)


def test_backward_with_softcap_and_parts(rng, path):
    """bf16 gradients against the float32 kernel: softcap's chain factor, and
    one kv head split into parts (B = Hkv = 1)."""
    q, k, v = bf16_qkv(rng, 1, 2, 1, 40, 60, 16)
    out, lse = ft.attention(q, k, v, causal=True, softcap=3.0, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(BF16)
    grads = ft.attention_backward(q, k, v, out, lse, dout, causal=True, softcap=3.0)
    f32 = [a.astype(np.float32) for a in (q, k, v, out, lse, dout)]
    f32_grads = ft.attention_backward(*f32, causal=True, softcap=3.0)
    for g, r in zip(grads, f32_grads, strict=True):
        assert g.dtype == BF16
        assert rel_err(g, r) < 1e-2


@njit
def _round_trip(x, bits, back):
    for i in range(x.size):
        bits[i] = bf16_bits(x[i])
        back[i] = bf16_value(bits[i])


@njit
def _operand_bits(x, bits):
    for i in range(x.size):
        bits[i] = bf16_operand_bits(x[i])


def test_bf16_bit_conversions_match_ml_dtypes(rng):
    # Ties (low half exactly 0x8000) both ways, infinities, NaN, denormals.
    special = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00008000, 0x80018000], np.uint32)
    x = np.concatenate(
        [
            rng.standard_normal(1000).astype(np.float32) * 1e3,
            special.view(np.float32),
            np.array([np.inf, -np.inf, 0.0, -0.0, 1e-40], np.float32),
        ]
    )
    bits, back = np.empty(x.size, np.uint16), np.empty(x.size, np.float32)
    _round_trip(x, bits, back)
    assert np.array_equal(bits, x.astype(BF16).view(np.uint16))
    assert np.array_equal(back, x.astype(BF16).astype(np.float32))
    rounded = to_bfloat16(x.reshape(2, -1))  # the gradients' compiled rounding
    assert rounded.dtype == BF16 and rounded.shape == (2, x.size // 2)
    assert np.array_equal(rounded.reshape(-1).view(np.uint16), bits)
    nan_bits = np.empty(1, np.uint16)
    _round_trip(np.array([np.nan], np.float32), nan_bits, np.empty(1, np.float32))
    assert np.isnan(nan_bits.view(BF16).astype(np.float32)[0])
    # Operands (P, dS) round the same, but for float32 denormals, which the
    # CPU's conversion instruction may flush to zero.
    operand = np.empty(x.size, np.uint16)
    _operand_bits(x, operand)
    normal = (np.abs(x) >= np.finfo(np.float32).tiny) | (x == 0)
    assert np.array_equal(operand[normal], bits[normal])
    assert np.all(np.abs(operand[~normal].view(BF16).astype(np.float32)) < 1.2e-38)


def test_the_widened_paths_casts_match_ml_dtypes(rng):
    # Without bf16 products the inputs are widened (their bits shifted) and
    # the result rounded back (compiled): on any layout, as ml_dtypes casts,
    # bit for bit but for NaN payloads (kept; ml_dtypes gives the quiet NaN).
    from flashtile.planning import contiguous
    from flashtile.precision import narrow_out

    x = rng.standard_normal((3, 4, 5, 6)).astype(np.float32) * 1e3
    x.flat[:7] = [np.nan, np.inf, -np.inf, 1e-40, -0.0, 3.4e38, 1.00390625]  # (the last: a tie)
    x.view(np.uint32).flat[7] = 0x7F812345  # a NaN with a payload
    nan = np.isnan(x)
    with np.errstate(invalid="ignore"):  # (ml_dtypes warns of the NaNs it casts)
        rounded = x.astype(BF16)
    full = narrow_out(x, BF16)
    for view in (lambda a: a, lambda a: a.transpose(0, 2, 1, 3), lambda a: a[:, ::2, :, 1:]):
        narrow = narrow_out(view(x), BF16)
        assert narrow.dtype == BF16 and narrow.shape == view(x).shape
        got, want, keep = narrow.view(np.uint16), view(rounded).view(np.uint16), ~view(nan)
        assert np.array_equal(got[keep], want[keep]) and np.isnan(view(x)[~keep]).all()
        assert np.array_equal(np.isnan(narrow.astype(np.float32)), view(nan))
        wide = contiguous(view(full), np.float32)  # (its NaN payloads too)
        assert wide.flags.c_contiguous and wide.shape == view(x).shape
        want = view(full).astype(np.float32)
        assert np.array_equal(wide.view(np.uint32), want.view(np.uint32))


def test_hardware_rounding_follows_numbas_target_features(monkeypatch):
    # NUMBA_CPU_NAME=generic sets CPU_FEATURES to "": no conversion
    # instruction may be assumed then (LLVM would call a missing helper).
    from numba.core import config

    from flashtile.cpu import half

    monkeypatch.setattr(config, "CPU_FEATURES", "")
    assert not half._converts_bf16()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+avx512bf16")
    assert half._converts_bf16()


def test_torch_bf16_reaches_the_kernels_without_a_copy(rng, monkeypatch):
    import flashtile.torch as ftt
    from flashtile.torch import _ops

    seen = []
    real = _ops.flashtile.attention

    def spy(q, *args, **kw):
        seen.append(q)
        return real(q, *args, **kw)

    monkeypatch.setattr(_ops.flashtile, "attention", spy)
    q, k, v = (as_torch(a) for a in bf16_qkv(rng, 1, 4, 2, 33, 40, 16))
    q.requires_grad_()
    out, lse = ftt.attention(q, k, v, causal=True, enable_gqa=True, return_lse=True)
    assert seen[0].dtype == BF16 and seen[0].ctypes.data == q.data_ptr()
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = torch_bf16_math(
        *(t.detach().view(torch.int16).numpy().view(BF16) for t in (q, k, v)), True
    )
    assert rel_err(out.detach().float().numpy(), ref) < 2e-2
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad.float()).all()


def test_varlen_and_decode_take_bf16(rng, path):
    """Packed sequences run the same kernel; a bf16 KV cache is decoded
    correctly (widened to float32 for now)."""
    cu = np.array([0, 50, 130])
    q, k = (rng.standard_normal((h, 130, 32)).astype(BF16) for h in (4, 2))
    out = ft.varlen_attention(q, k, k, cu, cu, causal=True)
    ref = ft.varlen_attention(*(a.astype(np.float32) for a in (q, k, k)), cu, cu, causal=True)
    assert out.dtype == BF16 and rel_err(out, ref) < 1e-2
    q = rng.standard_normal((2, 8, 1, 64)).astype(BF16)
    kc, vc = (rng.standard_normal((2, 2, 300, 64)).astype(BF16) for _ in range(2))
    lengths = np.array([300, 123])
    out = ft.decode_attention(q, kc, vc, cache_seqlens=lengths)
    f32 = (a.astype(np.float32) for a in (q, kc, vc))
    assert out.dtype == BF16
    assert rel_err(out, ft.decode_attention(*f32, cache_seqlens=lengths)) < 1e-2


def test_path_follows_cpu_features(rng, monkeypatch):
    """Without bf16 instructions bf16 inputs take the widening path (said in
    the bench header line), and the results stay bf16."""
    monkeypatch.setattr(blas, "bf16_features", lambda: ())
    monkeypatch.setattr(blas.bf16_gemm, "available", lambda: False)
    monkeypatch.setattr(routes, "_chosen", {})  # (the fixed rule again, for these features)
    assert blas.bf16_available() == ("widen",)
    assert not blas.bf16_products()
    assert blas.half_path() == "bf16 widened to float32 (no bf16 instructions)"
    q, k, v = bf16_qkv(rng, 1, 2, 2, 20, 30, 8)
    out = ft.attention(q, k, v, causal=True)
    ref, _ = float64_reference(q, k, v, True)
    assert out.dtype == BF16 and rel_err(out, ref) < 2 * rel_err(ref.astype(BF16), ref)


def test_scores_past_float32_range_run_in_float64(rng, path):
    q, k, v = bf16_qkv(rng, 1, 2, 2, 9, 13, 8)
    q[0, 0, 3, 1] = np.inf  # left out of the bound (the NaN policy covers its row)
    out = ft.attention(q, k, v, scale=1e38)
    with np.errstate(invalid="ignore"):  # the inf row, NaN by the policy
        want, _ = dense_attention(*(a.astype(np.float64) for a in (q, k, v)), scale=1e38)
    fine = np.ones(out.shape[:-1], bool)
    fine[0, 0, 3] = False
    assert out.dtype == BF16 and not np.isnan(out.astype(np.float32)[fine]).any()
    assert rel_err(out.astype(np.float64)[fine], want[fine]) < 1e-2


def test_bf16_bound_reads_the_bits():
    from flashtile.precision import finite_max_abs

    a = np.array([1.0, -3e38, np.nan, -np.inf, 2.5], dtype=BF16)
    assert finite_max_abs(a) == float(np.abs(a[[0, 1, 4]].astype(np.float64)).max())
    assert finite_max_abs(a[2:4]) == 0.0 and finite_max_abs(a[::4]) == 2.5


def test_tiny_scale_with_huge_values_keeps_float32_products(rng, path):
    # bf16 products sum q . k before the scale: 1e40 overflows float32 there.
    q, k, v = bf16_qkv(rng, 1, 2, 2, 5, 9, 16)
    q, k = (a.astype(np.float32) * np.float32(1e20) for a in (q, k))
    q, k = q.astype(BF16), k.astype(BF16)
    out = ft.attention(q, k, v, scale=8e-40)
    want, _ = dense_attention(*(a.astype(np.float64) for a in (q, k, v)), scale=8e-40)
    assert np.isfinite(out.astype(np.float32)).all()
    assert rel_err(out.astype(np.float64), want) < 1e-2


def _paged(rng, k, v, page):
    """``(k_pages, v_pages, block_table)``: every sequence in shuffled pages of ``page`` keys."""
    batch, hkv, t, d = k.shape
    per_seq = -(-t // page)
    order = rng.permutation(batch * per_seq)
    pad = ((0, 0), (0, 0), (0, per_seq * page - t), (0, 0))
    out = []
    for a in (k, v):
        pages = np.pad(a, pad).reshape(batch, hkv, per_seq, page, d).transpose(0, 2, 1, 3, 4)
        shuffled = np.empty((batch * per_seq, hkv, page, d), dtype=a.dtype)
        shuffled[order] = pages.reshape(-1, hkv, page, d)
        out.append(shuffled)
    return out[0], out[1], order.reshape(batch, per_seq)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("heads", [(6, 6), (8, 2)], ids=["mha", "gqa"])
def test_decoding_accuracy_rule(rng, path, heads, page):
    """bf16 queries against a bf16 cache: bf16 products where the CPU has
    them (tiles in place, or their bits gathered across pages; items that
    read rows in place widen them), judged by
    FlashAttention's rule, as the forward is."""
    from flashtile.decode_planning import plan_decode
    from flashtile.kvlayout import check_cache, decode_variants

    q, k, v = bf16_qkv(rng, 2, heads[0], heads[1], 1, 777, 64)
    kc, vc, table = (k, v, None) if page is None else _paged(rng, k, v, page)
    lengths = np.array([777, 777])  # (pages hold a few more)
    out, lse = ft.decode_attention(
        q, kc, vc, cache_seqlens=lengths, block_table=table, return_lse=True
    )
    assert out.dtype == BF16 and lse.dtype == np.float32
    layout = check_cache(q, kc, vc, lengths, table)[1]
    plan = plan_decode(q, layout, decode_variants(q, layout), 0.125, None)
    # The walk is a measured route; rows are widened in registers (never bf16 products).
    assert (plan.q.dtype == BF16) == (path == "bf16" and plan.walk != "rows")
    ref, ref_lse = float64_reference(q, k, v, False)
    rounding = rel_err(ref.astype(BF16), ref)
    assert rel_err(out, ref) <= 2 * rel_err(torch_bf16_math(q, k, v, False), ref) + rounding
    assert np.abs(lse - ref_lse).max() < 1e-3
    # A decode-shaped flashtile.attention call runs the same kernel.
    np.testing.assert_array_equal(ft.attention(q, k, v), ft.decode_attention(q, k, v))


@pytest.mark.parametrize(
    "variants",
    [{"window": (50, 0)}, {"softcap": 2.0}, {"alibi_slopes": np.array([0.5, 0.25, 0.1, 0.05])}],
    ids=["window", "softcap", "alibi"],
)
def test_decoding_bf16_products_with_variants(rng, path, variants):
    # Two queries of a GQA group, ragged lengths (one sequence shorter than
    # the queries: a row that sees nothing), pages of 40 keys.
    from flashtile.reference import decode_attention as reference_decode

    q, k, v = bf16_qkv(rng, 2, 4, 2, 2, 600, 32)
    kc, vc, table = _paged(rng, k, v, 40)
    lengths = np.array([600, 1])
    kw = dict(cache_seqlens=lengths, block_table=table, return_lse=True, **variants)
    out, lse = ft.decode_attention(q, kc, vc, **kw)
    wide = (a.astype(np.float64) for a in (q, kc, vc))
    want, want_lse = reference_decode(*wide, **kw)
    assert not np.isnan(out.astype(np.float32)).any()
    assert rel_err(out, want) < 2 * rel_err(want.astype(BF16), want)
    seen = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    assert np.abs(lse[seen] - want_lse[seen]).max() < 1e-3


@pytest.mark.parametrize("scale", [8e-40, 1e38], ids=["tiny-scale-huge-values", "huge-scale"])
def test_decoding_past_float32_range_runs_in_float64(rng, path, scale):
    # bf16 products sum q . k before the scale: 1e40 overflows float32 there
    # (the step is computed again in float64, as for a huge scale).
    q, k, v = bf16_qkv(rng, 1, 4, 2, 1, 600, 16)
    if scale < 1:
        q, k = ((a.astype(np.float32) * np.float32(1e20)).astype(BF16) for a in (q, k))
    out = ft.decode_attention(q, k, v, scale=scale)
    want, _ = dense_attention(*float64_inputs(q, k, v), scale=scale)
    assert np.isfinite(out.astype(np.float32)).all()
    assert rel_err(out.astype(np.float64), want) < 1e-2


@pytest.mark.parametrize("entry", ["attention", "decode_attention"])
def test_huge_scale_with_tiny_values_keeps_float32_products(rng, path, entry):
    # bf16 products flush terms of q . k below 2**-126 to zero: at scale 1e38
    # with values near 5e-20 every score would read 0 (scores of std ~3 here).
    # The scale alone sends such calls to float32 products.
    q, k, v = bf16_qkv(rng, 1, 4, 4, 1 if entry == "decode_attention" else 8, 700, 128)
    q, k = ((a.astype(np.float32) * np.float32(5e-20)).astype(BF16) for a in (q, k))
    for scale in (1e38, 2.5e37):
        out = getattr(ft, entry)(q, k, v, scale=scale)
        want, _ = dense_attention(*float64_inputs(q, k, v), scale=scale)
        assert rel_err(out.astype(np.float64), want) < 1e-2


def float64_inputs(q, k, v):
    """q, k, v in float64, k and v repeated for q's heads (GQA)."""
    group = q.shape[1] // k.shape[1]
    return q.astype(np.float64), *(np.repeat(a.astype(np.float64), group, 1) for a in (k, v))


def test_a_forced_bf16_route_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(blas, "bf16_features", lambda: ())
    monkeypatch.setattr(blas.bf16_gemm, "available", lambda: False)
    monkeypatch.setenv("FLASHTILE_BF16", "vdpbf16ps")
    with pytest.raises(ValueError, match=r"'vdpbf16ps' cannot run here.*FLASHTILE_BF16"):
        blas.bf16_library()
    monkeypatch.delenv("FLASHTILE_BF16")
    # An answer remembered before the route was limited: the first usable instead.
    monkeypatch.setattr(routes, "_chosen", {"bf16": ("vdpbf16ps", "fixed rule (not measured)")})
    assert blas.bf16_library() == "widen"
