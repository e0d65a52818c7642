"""The fused CPU kernel (flashtile.attention / attention_backward) vs the reference.

Small tile sizes are passed on purpose so that short sequences still cross
many query/key tiles, partial edge tiles and the causal diagonal.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashtile as ft
from dense import dense_attention, dense_attention_backward, rel_err

SHAPES = [  # (Tq, Tk, d, dv)
    (1, 1, 1, 1),
    (7, 7, 3, 3),
    (97, 97, 59, 59),
    (97, 33, 64, 5),
    (33, 97, 128, 64),
    (1, 1025, 1, 2),
    (1025, 1025, 64, 64),
]
TILES = [(16, 24), (128, 512)]


def _inputs(rng, tq, tk, d, dv, dtype, lead=(2, 3)):
    q = rng.standard_normal((*lead, tq, d)).astype(dtype)
    k = rng.standard_normal((*lead, tk, d)).astype(dtype)
    v = rng.standard_normal((*lead, tk, dv)).astype(dtype)
    return q, k, v


def _f64(*arrays):
    return [a.astype(np.float64) for a in arrays]


def _naive_f32_error(q, k, v, causal):
    """Relative error the naive computation makes in float32 on the same inputs."""
    out32, _ = ft.naive_attention(q, k, v, causal)
    ref, _ = dense_attention(*_f64(q, k, v), causal)
    return rel_err(out32, ref)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference_float64(rng, shape, causal, tiles):
    tq, tk, d, dv = shape
    lead = (1, 2) if tq * tk > 10**5 else (2, 3)
    q, k, v = _inputs(rng, tq, tk, d, dv, np.float64, lead)
    out, lse = ft.attention(
        q, k, v, causal=causal, return_lse=True, block_q=tiles[0], block_k=tiles[1]
    )
    ref, ref_lse = ft.tiled_attention(q, k, v, 64, causal, return_lse=True)
    assert rel_err(out, ref) < 1e-12
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_float32_accuracy(rng, shape, causal):
    """float32 error below 1e-5 and within 3x of naive float32 attention."""
    tq, tk, d, dv = shape
    q, k, v = _inputs(rng, tq, tk, d, dv, np.float32, (1, 2))
    out, lse = ft.attention(q, k, v, causal=causal, return_lse=True, block_q=16, block_k=24)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    ref, ref_lse = dense_attention(*_f64(q, k, v), causal)
    err = rel_err(out, ref)
    assert err < 1e-5
    assert err <= 3 * max(_naive_f32_error(q, k, v, causal), 1e-7)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:-1])
def test_backward_matches_reference(rng, shape, causal, tiles):
    tq, tk, d, dv = shape
    q, k, v = _inputs(rng, tq, tk, d, dv, np.float64)
    dout = rng.standard_normal((2, 3, tq, dv))
    out, lse = ft.attention(q, k, v, causal=causal, return_lse=True)
    grads = ft.attention_backward(
        q, k, v, out, lse, dout, causal=causal, block_q=tiles[0], block_k=tiles[1]
    )
    ref = ft.tiled_attention_backward(q, k, v, out, lse, dout, block_size=64, causal=causal)
    for got, want in zip(grads, ref, strict=True):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-11


@pytest.mark.parametrize("causal", [False, True])
def test_backward_float32_and_deterministic(rng, causal):
    q, k, v = _inputs(rng, 301, 257, 64, 64, np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = ft.attention(q, k, v, causal=causal, return_lse=True)
    first = ft.attention_backward(q, k, v, out, lse, dout, causal=causal, block_q=64, block_k=96)
    again = ft.attention_backward(q, k, v, out, lse, dout, causal=causal, block_q=64, block_k=96)
    ref = ft.tiled_attention_backward(*_f64(q, k, v, out, lse, dout), block_size=128, causal=causal)
    for got, repeat, want in zip(first, again, ref, strict=True):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, repeat)  # bit-identical
        assert rel_err(got, want) < 1e-5


def test_forward_is_deterministic(rng):
    q, k, v = _inputs(rng, 200, 300, 64, 64, np.float32)
    a = ft.attention(q, k, v, causal=True, block_q=32, block_k=64)
    np.testing.assert_array_equal(a, ft.attention(q, k, v, causal=True, block_q=32, block_k=64))


@pytest.mark.parametrize("ndim", [2, 3, 4])
def test_ranks_and_scale(rng, ndim):
    lead = (2, 3)[: ndim - 2]
    q, k, v = _inputs(rng, 20, 30, 8, 5, np.float64, lead)
    out, lse = ft.attention(q, k, v, scale=0.37, return_lse=True)
    ref, ref_lse = dense_attention(q, k, v, scale=0.37)
    assert out.shape == (*lead, 20, 5) and lse.shape == (*lead, 20)
    assert rel_err(out, ref) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    dout = rng.standard_normal(out.shape)
    grads = ft.attention_backward(q, k, v, out, lse, dout, scale=0.37)
    want = dense_attention_backward(q, k, v, dout, scale=0.37)
    for got, ref_grad in zip(grads, want, strict=True):
        assert got.shape == ref_grad.shape and rel_err(got, ref_grad) < 1e-11


def test_rows_that_see_no_key(rng):
    """Tq > Tk causal: the first Tq - Tk queries see nothing -> zeros, -inf, zero grads."""
    q, k, v = _inputs(rng, 40, 9, 16, 16, np.float32)
    out, lse = ft.attention(q, k, v, causal=True, return_lse=True, block_q=16, block_k=4)
    assert np.all(out[..., :31, :] == 0) and np.all(np.isneginf(lse[..., :31]))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[..., 31:]))
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = ft.attention_backward(q, k, v, out, lse, dout, causal=True, block_q=16)
    assert np.all(dq[..., :31, :] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))


def test_float16_is_upcast_and_returned_as_float16(rng):
    q, k, v = _inputs(rng, 50, 50, 32, 32, np.float16)
    out, lse = ft.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref, _ = dense_attention(*_f64(q, k, v), True)
    assert rel_err(out, ref) < 2e-3


def test_non_contiguous_inputs(rng):
    q, k, v = _inputs(rng, 33, 33, 16, 16, np.float64)
    qt = np.ascontiguousarray(np.swapaxes(q, -1, -2)).swapaxes(-1, -2)  # strided view
    kt = np.ascontiguousarray(np.swapaxes(k, -1, -2)).swapaxes(-1, -2)
    assert not qt.flags.c_contiguous and not kt.flags.c_contiguous
    out = ft.attention(qt, kt, v[..., ::-1, :][..., ::-1, :], causal=True)
    assert rel_err(out, dense_attention(q, k, v, True)[0]) < 1e-12


def test_large_logits_do_not_overflow(rng):
    q, k, v = _inputs(rng, 64, 64, 16, 16, np.float32)
    out = ft.attention(q * 300, k * 300, v)
    ref, _ = dense_attention(*_f64(q * 300, k * 300, v))
    assert np.all(np.isfinite(out)) and rel_err(out, ref) < 1e-5


def test_long_sequence_uses_linear_memory():
    """T=16384: the dense scores would be 1 GiB; the kernel runs and stays exact."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 16384, 16384, 16, 16, np.float32, (1, 1))
    out = ft.attention(q, k, v, causal=True)
    # Row i of causal attention is non-causal attention over keys [0, i].
    for row in (0, 1, 5000, 16383):
        keys = slice(0, row + 1)
        want, _ = dense_attention(*_f64(q[..., [row], :], k[..., keys, :], v[..., keys, :]))
        assert rel_err(out[..., [row], :], want) < 1e-5


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"q": np.zeros((1, 1, 2, 3, 4, 8))}, ValueError, "6 dims"),
        ({"k": np.zeros((1, 3, 9, 8))}, ValueError, "leading dims differ"),
        ({"k": np.zeros((2, 3, 9, 7))}, ValueError, "d=8 but k has d=7"),
        ({"v": np.zeros((2, 3, 8, 8))}, ValueError, "Tk=9"),
        ({"q": np.zeros((2, 3, 4, 8), dtype=np.int32)}, TypeError, "int32"),
        ({"causal": 1}, TypeError, "causal"),
        ({"block_q": 0}, ValueError, "block_q must be >= 1"),
        ({"scale": float("nan")}, ValueError, "scale must be finite"),
    ],
)
def test_bad_inputs_give_clear_errors(kwargs, exc, match):
    args = {
        "q": np.zeros((2, 3, 4, 8)),
        "k": np.zeros((2, 3, 9, 8)),
        "v": np.zeros((2, 3, 9, 8)),
    }
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=match):
        ft.attention(q, k, v, **args)


def test_backward_rejects_swapped_lse_and_dout(rng):
    q, k, v = _inputs(rng, 5, 6, 4, 4, np.float64)
    out, lse = ft.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"has shape \(2, 3, 5\), expected"):
        ft.attention_backward(q, k, v, out, out, lse)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scores_that_keep_rising_across_tiles(rng, dtype):
    """Each key tile beats the previous running max by far more than the
    kernel's headroom, so every tile takes the rebase path."""
    q = np.abs(rng.standard_normal((1, 2, 40, 8))).astype(dtype)
    growth = np.linspace(0.0, 60.0, 300)[:, None]  # scores climb ~ 60 * |q| over the keys
    k = (np.abs(rng.standard_normal((1, 2, 300, 8))) * 0.1 + growth).astype(dtype)
    v = rng.standard_normal((1, 2, 300, 8)).astype(dtype)
    out, lse = ft.attention(q, k, v, return_lse=True, block_q=16, block_k=32)
    ref, ref_lse = dense_attention(*_f64(q, k, v))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(out, ref) < tol and rel_err(lse, ref_lse) < tol


def test_nan_in_a_query_row_stays_in_that_row(rng):
    q, k, v = _inputs(rng, 20, 30, 8, 8, np.float32)
    q[0, 1, 5, 3] = np.nan
    out = ft.attention(q, k, v, block_q=8, block_k=8)
    assert np.all(np.isnan(out[0, 1, 5]))
    mask = np.ones(out.shape[:-1], dtype=bool)
    mask[0, 1, 5] = False
    assert np.all(np.isfinite(out[mask]))


@pytest.mark.parametrize("jump", [100.0, 1000.0, 1e6])
def test_a_score_far_above_every_earlier_tile(jump):
    """One key in a later tile scores `jump` (natural units) above the rest:
    the exponent must not wrap around, the row must be re-based."""
    q = np.zeros((1, 1, 2, 4), dtype=np.float32)
    q[..., 0] = 1.0
    k = np.zeros((1, 1, 600, 4), dtype=np.float32)
    k[0, 0, 550, 0] = jump
    v = np.zeros((1, 1, 600, 1), dtype=np.float32)
    v[0, 0, 550, 0] = 1.0
    out, lse = ft.attention(q, k, v, scale=1.0, return_lse=True, block_k=512)
    np.testing.assert_allclose(out[..., 0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(lse, jump, rtol=1e-6)


def test_exp2_kernel_accuracy_and_edges():
    from numba import njit

    from flashtile.cpu.rowops import exp2_into

    @njit
    def run(x, shift):
        tile = x.reshape((1, x.size))
        total = exp2_into(tile, tile, 0, 0, x.size, shift)
        return x, total

    x = np.linspace(-126.0, 0.0, 100_001).astype(np.float32)
    got, total = run(x.copy(), np.float32(0.0))
    want = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 3e-7
    assert abs(total / want.sum() - 1) < 1e-5
    edge, _ = run(np.array([-np.inf, -500.0, np.nan, 300.0], dtype=np.float32), np.float32(0.0))
    assert edge[0] == 0.0 and edge[1] == 0.0 and np.isnan(edge[2])
    assert np.isfinite(edge[3]) and edge[3] > 1e38  # clamped, never wrapped around


def test_tanh_kernel_accuracy_and_edges():
    """The softcap's vectorised float32 tanh (rowops.tanh_of): within 3 float32
    ulps of float64's over the series, the switch at 0.55 and the exp-based
    range, tiny values kept (no cancellation), inf to +-1, NaN to NaN; float64
    scores keep libm's."""
    from numba import njit

    from flashtile.cpu.rowops import tanh_of

    @njit
    def run(x):
        out, slope = np.empty_like(x), np.empty_like(x)
        for c in range(x.size):
            out[c], slope[c] = tanh_of(x[c])
        return out, slope

    x = np.concatenate([np.linspace(-40.0, 40.0, 200_001), np.geomspace(1e-30, 0.6, 5001)])
    x = np.concatenate([x, -x]).astype(np.float32)
    got, slope = (a.astype(np.float64) for a in run(x))
    want = np.tanh(x.astype(np.float64))
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-38)) < 3 * 2.0**-23
    # the derivative 1 - tanh^2 without cancelling (it is 6e-8 at 9, 2e-34 at
    # 40), as exact as x in float32 lets it be (its condition number is 2|x|)
    dwant = 1.0 / np.cosh(x.astype(np.float64)) ** 2
    rel = np.abs(slope - dwant) / np.maximum(dwant, 1e-38)
    assert np.all(rel < (4 + 2 * np.abs(x)) * 2.0**-23)
    edge, edge_slope = run(np.array([np.inf, -np.inf, np.nan, 1e30, -0.0], dtype=np.float32))
    assert edge[0] == 1.0 and edge[1] == -1.0 and np.isnan(edge[2]) and edge[3] == 1.0
    assert edge[4] == 0.0 and edge_slope[0] == 0.0 and edge_slope[4] == 1.0
    wide = np.linspace(-3.0, 3.0, 1001)
    np.testing.assert_allclose(run(wide)[0], np.tanh(wide), rtol=1e-15)  # float64: libm tanh


def test_exp2_bf16_probabilities_and_row_max():
    """The bf16 path's shorter polynomial rounds like the exact exponential
    (within one bf16 step), sums like it, and the row max keeps NaN."""
    import ml_dtypes
    from numba import njit

    from flashtile.cpu.rowops import exp2_into, row_max

    @njit
    def run(s, p, lo, hi, shift):
        return exp2_into(s, p, 0, lo, hi, shift)

    x = np.linspace(-126.0, 0.0, 60_001).astype(np.float32)[None, :]
    p = np.full(x.shape, 7, dtype=np.uint16)
    total = run(x, p, 3, x.shape[1] - 2, np.float32(0.0))
    want = np.exp2(x[0, 3:-2].astype(np.float64))
    got = p[0, 3:-2].view(ml_dtypes.bfloat16).astype(np.float64)
    assert np.max(np.abs(got / want - 1)) <= 2.0**-8  # one bf16 rounding at most
    assert abs(total / want.sum() - 1) < 1e-5
    assert (p[0, :3] == 7).all() and (p[0, -2:] == 7).all()  # [lo, hi) only
    row = np.full((2, 37), -np.inf, dtype=np.float32)
    row[1, 20] = np.nan
    assert row_max(row, 0, 0, 37) == -np.inf and np.isnan(row_max(row, 1, 0, 37))
    assert row_max(x, 0, 5, 9) == x[0, 8]


def test_wide_vectors_hint_gives_512_bit_loops_on_avx512():
    """The kernels' width hint (cpu/vectors.py) reaches LLVM: a loop in a
    function that calls it uses 512-bit registers where the target has them."""
    import llvmlite.binding as llvm
    from numba import njit
    from numba.core import config

    from flashtile.cpu import FASTMATH
    from flashtile.cpu.vectors import wide_vectors

    features = config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    if "+avx512f" not in features.split(",") or config.CPU_NAME == "generic":
        pytest.skip("the target has no 512-bit vectors")

    @njit(fastmath=FASTMATH)
    def scaled_sum(x, c):
        wide_vectors()
        total = np.float32(0.0)
        for i in range(x.size):
            x[i] *= c
            total += x[i]
        return total

    x = np.arange(100, dtype=np.float32)
    assert scaled_sum(x, np.float32(2.0)) == np.float32(9900.0)
    asm = next(iter(scaled_sum.inspect_asm().values()))
    assert "%zmm" in asm


def test_concurrent_calls_agree_and_restore_blas_threads(rng):
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_info

    before = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    q, k, v = _inputs(rng, 300, 300, 32, 32, np.float32)
    want = ft.attention(q, k, v, causal=True)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: ft.attention(q, k, v, causal=True), range(12)))
    for out in outs:
        np.testing.assert_array_equal(out, want)
    after = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    assert after[: len(before)] == before


@settings(max_examples=40, deadline=None)
@given(
    tq=st.integers(1, 40),
    tk=st.integers(1, 40),
    group=st.sampled_from([1, 2, 3]),
    block_q=st.integers(1, 48),
    block_k=st.integers(1, 48),
    causal=st.booleans(),
    window=st.sampled_from([None, (0, 0), (3, None), (None, 2), (5, 1)]),
    softcap=st.sampled_from([None, 2.0]),
    alibi=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_for_any_tiles_and_variants(
    tq, tk, group, block_q, block_k, causal, window, softcap, alibi, seed
):
    """Any tile sizes, any mix of variants: forward and backward equal the reference."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 2 * group, tq, 5))
    k = rng.standard_normal((2, 2, tk, 5))
    v = rng.standard_normal((2, 2, tk, 3))
    variants = {"window": window, "softcap": softcap}
    if alibi:
        variants["alibi_slopes"] = rng.uniform(0.1, 1.0, 2 * group)
    tiles = {"block_q": block_q, "block_k": block_k}
    out, lse = ft.attention(q, k, v, causal=causal, return_lse=True, **tiles, **variants)
    ref, ref_lse = ft.tiled_attention(q, k, v, 7, causal, return_lse=True, **variants)
    assert rel_err(out, ref) < 1e-12
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-12, atol=1e-12)
    dout = rng.standard_normal(out.shape)
    grads = ft.attention_backward(q, k, v, out, lse, dout, causal=causal, **tiles, **variants)
    want = ft.tiled_attention_backward(
        q, k, v, ref, ref_lse, dout, block_size=5, causal=causal, **variants
    )
    for got, expected in zip(grads, want, strict=True):
        # Relative to max(|ref|, 1): with one visible key dq is exactly 0 in
        # exact arithmetic and the reference's is rounding noise.
        scale = max(np.linalg.norm(expected), 1.0)
        assert np.all(np.isfinite(got)) and np.linalg.norm(got - expected) < 1e-10 * scale


@pytest.mark.parametrize("shape", [(200, 200), (150, 230), (230, 150)])
@pytest.mark.parametrize(
    "causal, variants",
    [
        (True, {}),
        (True, {"window": (50, None)}),
        (False, {"window": (40, 10)}),
        (True, {"softcap": 3.0, "alibi_slopes": np.array([0.3, 0.7])}),
        (True, {"mask": "bool"}),
    ],
    ids=["causal", "causal-window", "window", "softcap-alibi", "bool-mask"],
)
def test_tiles_split_across_the_diagonal_match_the_reference(rng, shape, causal, variants):
    """Tiles of 128 rows (one head each) crossing the diagonal or a window's
    right edge are computed as two row blocks, the top one over fewer keys
    (tiles.diagonal_split): forward and backward still equal the reference."""
    tq, tk = shape
    q, k, v = _inputs(rng, tq, tk, 16, 8, np.float64, lead=(1, 2))
    variants = dict(variants)
    if variants.get("mask") == "bool":
        variants["mask"] = rng.random((tq, tk)) < 0.8
    tiles = {"block_q": 128, "block_k": 128}
    out, lse = ft.attention(q, k, v, causal=causal, return_lse=True, **tiles, **variants)
    ref, ref_lse = ft.tiled_attention(q, k, v, 32, causal, return_lse=True, **variants)
    assert rel_err(out, ref) < 1e-12
    dout = rng.standard_normal(out.shape)
    grads = ft.attention_backward(q, k, v, out, lse, dout, causal=causal, **tiles, **variants)
    want = ft.tiled_attention_backward(
        q, k, v, ref, ref_lse, dout, block_size=32, causal=causal, **variants
    )
    for got, expected in zip(grads, want, strict=True):
        assert np.all(np.isfinite(got)) and rel_err(got, expected) < 1e-11


def test_skipped_tiles_are_never_computed(rng):
    """Count the score tiles the forward computes: the causal/window band and a
    block mask's empty tiles must be skipped, nothing else."""
    from flashtile.api import visited_tiles

    q, k, v = _inputs(rng, 128, 128, 8, 8, np.float32, (1, 2))
    tiles = {"block_q": 16, "block_k": 16}  # an 8 x 8 grid of tiles per head
    assert visited_tiles(q, k, v, **tiles) == 2 * 64
    assert visited_tiles(q, k, v, causal=True, **tiles) == 2 * 36  # diagonal and below
    # window (16, 0): each query block needs its own and the previous key block.
    assert visited_tiles(q, k, v, causal=True, window=(16, 0), **tiles) == 2 * (1 + 7 * 2)
    keep = np.zeros((8, 8), dtype=bool)
    keep[np.arange(8), np.arange(8)] = True
    keep[3, 0] = keep[7, 2] = True
    mask = np.kron(keep, np.ones((16, 16), dtype=bool))
    mask[0, 1] = False  # a partial tile is still visited
    bm = ft.block_mask(mask, 16, 16)
    assert bm.counts() == {"empty": 54, "partial": 1, "full": 9}
    assert visited_tiles(q, k, v, mask=bm, **tiles) == 2 * 10
    assert visited_tiles(q, k, v, mask=mask, **tiles) == 2 * 10


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gathered_block_mask_tiles_with_rising_scores(rng, dtype):
    """Kept blocks of a block mask are gathered into wide tiles (512 keys); a
    score that passes the reference in a later gathered tile must re-base that
    row, with the mask, softcap and ALiBi re-applied to the recomputed scores."""
    tk = 1500
    q = np.abs(rng.standard_normal((1, 2, 40, 8))).astype(dtype)
    growth = np.linspace(0.0, 60.0, tk)[:, None]
    k = (np.abs(rng.standard_normal((1, 2, tk, 8))) * 0.1 + growth).astype(dtype)
    v = rng.standard_normal((1, 2, tk, 8)).astype(dtype)
    mask = rng.random((1, 2, 40, tk)) < 0.6
    mask[..., 64:128] = False  # whole empty blocks to skip
    variants = {"mask": mask, "softcap": 400.0, "alibi_slopes": np.array([0.01, 0.02])}
    out, lse = ft.attention(q, k, v, return_lse=True, block_q=16, block_k=32, **variants)
    ref, ref_lse = ft.tiled_attention(*_f64(q, k, v), 50, return_lse=True, **variants)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(out, ref) < tol and rel_err(lse, ref_lse) < tol


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_splits_a_lone_head_over_threads_deterministically(rng, dtype):
    """B=1 with one kv head (MQA): fewer items than threads, so the backward
    splits the head into parts with private dk/dv sums; still exact and
    bit-identical from run to run."""
    import numba

    q = rng.standard_normal((1, 3, 200, 16)).astype(dtype)
    k = rng.standard_normal((1, 1, 150, 16)).astype(dtype)
    v = rng.standard_normal((1, 1, 150, 8)).astype(dtype)
    dout = rng.standard_normal((1, 3, 200, 8)).astype(dtype)
    out, lse = ft.attention(q, k, v, causal=True, return_lse=True)
    tiles = {"block_q": 32, "block_k": 48}
    first = ft.attention_backward(q, k, v, out, lse, dout, causal=True, **tiles)
    again = ft.attention_backward(q, k, v, out, lse, dout, causal=True, **tiles)
    want = ft.tiled_attention_backward(*_f64(q, k, v, out, lse, dout), block_size=64, causal=True)
    tol = 1e-5 if dtype == np.float32 else 1e-11
    for got, repeat, expected in zip(first, again, want, strict=True):
        np.testing.assert_array_equal(got, repeat)
        assert rel_err(got, expected) < tol
    from flashtile.api import check_call
    from flashtile.planning import plan_backward

    plan = plan_backward(check_call(q, k, v, True, None, {}), **tiles)
    assert plan.parts == min(numba.get_num_threads(), 7)  # 7 query blocks of 32 rows
