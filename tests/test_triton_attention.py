"""flashtile.triton.attention / varlen_attention against the NumPy reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; with
``TRITON_INTERPRET=0`` on a machine with a GPU the same tests run the
compiled kernels on CUDA tensors (tests/triton_device.py).

The interpreter runs every tile op in NumPy, so the shapes are tiny but
awkward: lengths that no tile size divides, Tq above and below Tk, padded head
dims, GQA and MQA, rows that see no key. Accuracy is judged against the
float64 reference with FlashAttention's rule: at most a small multiple of the
error that the same attention computed densely by PyTorch in the input
precision makes (3x for float32, as in the rest of flashtile; 2x for float16
and bfloat16).
"""

import math

import numpy as np
import pytest

# First: sets the device, skips this module without torch or triton.
from triton_device import DEVICE, ft, torch, triton

# isort: split
import flashtile
from dense import rel_err
from flashtile.masks import normalize_window, visible
from flashtile.triton.tiles import round_bf16

tl = triton.language
FACTOR = {torch.float32: 3.0, torch.float16: 2.0, torch.bfloat16: 2.0}


def dense(q, k, v, causal=False, scale=None, window=None, alibi_slopes=None, softcap=None,
          kv_lengths=None):  # fmt: skip
    """Attention computed densely by torch in the inputs' dtype (differentiable):
    the "same math in that precision" baseline. Visibility is flashtile.masks'."""
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    group = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos = np.arange(tq) + tk - tq
    if alibi_slopes is not None:
        dist = torch.from_numpy(np.abs(pos[:, None] - np.arange(tk)[None, :])).to(s)
        s = s - alibi_slopes.to(s)[..., None, None] * dist
    left, right = normalize_window(window, causal)
    keep = visible(np.arange(tq), np.arange(tk), tq, tk, causal, left, right, kv_lengths)
    s = s.masked_fill(~torch.from_numpy(np.asarray(keep)).to(s.device), float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def reference_kwargs(kw):
    """The variant keywords for flashtile's NumPy reference (float64 arrays)."""
    out = {}
    for key, value in kw.items():
        out[key] = value.double().numpy() if isinstance(value, torch.Tensor) else value
    if "kv_lengths" in out:
        out["kv_lengths"] = np.asarray(out["kv_lengths"])
    return out


def f64(t):
    return t.detach().cpu().double().numpy()


def assert_accurate(got, base, ref, dtype, what):
    """``got``'s error at most FACTOR x ``base``'s (both against the float64 ``ref``)."""
    assert not torch.isnan(got).any(), f"{what}: NaN"
    err, base_err = rel_err(f64(got), ref), rel_err(f64(base), ref)
    floor = 1e-7 if dtype == torch.float32 else 0.0
    assert err <= FACTOR[dtype] * base_err + floor, f"{what}: error {err:.3g} vs {base_err:.3g}"


def make(dims, dtype, seed, grad):
    gen = torch.Generator().manual_seed(seed)
    b, hq, hk, tq, tk, d, dv = dims
    shapes = ((b, hq, tq, d), (b, hk, tk, d), (b, hk, tk, dv))
    return [torch.randn(s, generator=gen).to(dtype).to(DEVICE).requires_grad_(grad) for s in shapes]


def run_case(dims, dtype, kw, grad, seed=0):
    """Forward (and backward) of the kernels against the reference and the dense baseline."""
    q, k, v = make(dims, dtype, seed, grad)
    causal = kw.pop("causal", False)
    out, lse = ft.attention(q, k, v, causal=causal, enable_gqa=True, return_lse=True, **kw)
    qd, kd, vd = (f64(t) for t in (q, k, v))
    ref_kw = reference_kwargs(kw)
    ref, ref_lse = flashtile.tiled_attention(qd, kd, vd, 16, causal, return_lse=True, **ref_kw)
    base_inputs = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    base = dense(*base_inputs, causal=causal, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_accurate(out, base, ref, dtype, "out")
    lse_np = f64(lse)
    assert np.array_equal(np.isneginf(lse_np), np.isneginf(ref_lse)), "rows without keys differ"
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_np[finite], ref_lse[finite], rtol=2e-6, atol=2e-5)
    assert not np.isnan(lse_np).any()
    if not grad:
        return None
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    out.backward(dout)
    base.backward(dout)
    grads = flashtile.tiled_attention_backward(
        q=qd, k=kd, v=vd, out=ref, dout=f64(dout), lse=ref_lse, block_size=16, causal=causal,
        **ref_kw,
    )  # fmt: skip
    for name, t, b, g in zip("qkv", (q, k, v), base_inputs, grads, strict=True):
        assert t.grad.shape == t.shape and t.grad.dtype == dtype
        assert_accurate(t.grad, b.grad, g, dtype, f"d{name}")
    return q, k, v, dout


def slopes(*shape):
    """ALiBi slopes, float32-exact so the kernels and the reference use the same values."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(7)).float() + 0.1


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (dims (B, Hq, Hkv, Tq, Tk, d, dv), dtype, variants, with gradients)
CASES = {
    "plain": ((1, 2, 2, 37, 50, 24, 24), F32, {}, True),
    "causal_tq_above_tk_gqa": ((1, 4, 2, 50, 20, 16, 40), F32, {"causal": True}, True),
    "causal_tq_below_tk": ((1, 2, 1, 20, 50, 32, 32), F32, {"causal": True}, False),
    "window_both_sides": ((1, 2, 2, 33, 70, 32, 32), F32, {"window": (5, 3)}, False),
    "causal_window_softcap_alibi_mqa": (
        (2, 2, 1, 20, 45, 3, 5),
        F32,
        {"causal": True, "window": (7, None), "softcap": 2.0, "alibi_slopes": slopes(2, 2)},
        True,
    ),
    "kv_lengths": ((2, 2, 2, 17, 40, 8, 8), F32, {"kv_lengths": [0, 23]}, True),
    "causal_kv_lengths": (
        (2, 1, 1, 17, 40, 8, 8),
        F32,
        {"causal": True, "kv_lengths": [40, 9]},
        False,
    ),
    "one_query": ((1, 2, 2, 1, 37, 16, 16), F32, {"causal": True, "scale": 0.3}, False),
    "float16_causal_gqa": ((1, 4, 2, 37, 50, 64, 64), F16, {"causal": True}, True),
    "bfloat16_softcap_alibi": (
        (1, 2, 2, 37, 50, 24, 24),
        BF16,
        {"causal": True, "softcap": 5.0, "alibi_slopes": slopes(2)},
        True,
    ),
    "bfloat16_window": ((1, 2, 1, 30, 30, 40, 40), BF16, {"window": (4, 6)}, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_the_reference(name):
    dims, dtype, kw, grad = CASES[name]
    run_case(dims, dtype, dict(kw), grad)


def test_rows_without_keys_get_zero_output_and_zero_gradients_deterministically():
    # Tq > Tk causal: the first 30 queries see no key.
    q, k, v, dout = run_case((1, 4, 2, 50, 20, 16, 40), F32, {"causal": True}, True)
    grads = [t.grad.clone() for t in (q, k, v)]
    assert torch.all(grads[0][:, :, :30] == 0)
    for t in (q, k, v):
        t.grad = None
    out = ft.attention(q, k, v, causal=True, enable_gqa=True)
    assert torch.all(out[:, :, :30] == 0)
    out.backward(dout)
    for before, t in zip(grads, (q, k, v), strict=True):
        assert torch.equal(before, t.grad), "the backward is not bit-identical run to run"


def test_three_dim_inputs_and_strided_views():
    q, k, v = make((1, 2, 2, 19, 23, 16, 16), F32, 3, False)
    out = ft.attention(q[0], k[0], v[0], causal=True)
    assert out.shape == (2, 19, 16)
    ref = flashtile.tiled_attention(f64(q[0]), f64(k[0]), f64(v[0]), 16, True)
    assert rel_err(f64(out), ref) < 1e-6
    # a (B, T, H, d) tensor seen as (B, H, T, d): strided rows, unit stride on d
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(ft.attention(qt, k, v), ft.attention(q, k, v))


def test_attention_backward_from_kept_out_and_lse_equals_autograd():
    q, k, v = make((1, 4, 2, 13, 17, 16, 16), F32, 5, True)  # GQA 4/2, Tq != Tk
    kw = {"causal": True, "window": (6, 0), "softcap": 4.0, "enable_gqa": True}
    out, lse = ft.attention(q, k, v, return_lse=True, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    plain = [t.detach() for t in (q, k, v)]
    grads = ft.attention_backward(*plain, out.detach(), lse, dout, **kw)
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert torch.equal(got, want)  # the same kernels, run from the caller's (out, lse)
    with pytest.raises(ValueError, match="expected out and dout"):
        ft.attention_backward(*plain, out.detach()[:, :, 1:], lse, dout, **kw)


def varlen_reference(q, k, v, cu_q, cu_k, causal, alibi, dout):
    """Each packed sequence attended on its own by the reference: out, lse and grads."""
    out, lse = np.zeros(q.shape[:-1] + v.shape[-1:]), np.full(q.shape[:-1], -np.inf)
    grads = [np.zeros_like(a) for a in (q, k, v)]
    for s in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if qs.stop == qs.start or ks.stop == ks.start:
            continue  # no queries, or queries that see no key: zeros and -inf
        kw = {"alibi_slopes": alibi}
        o, o_lse = flashtile.tiled_attention(
            q[:, qs], k[:, ks], v[:, ks], 16, causal, return_lse=True, **kw
        )
        out[:, qs], lse[:, qs] = o, o_lse
        g = flashtile.tiled_attention_backward(
            q=q[:, qs], k=k[:, ks], v=v[:, ks], out=o, dout=dout[:, qs], lse=o_lse, block_size=16,
            causal=causal, **kw,
        )  # fmt: skip
        for whole, part, rows in zip(grads, g, (qs, ks, ks), strict=True):
            whole[:, rows] = part
    return out, lse, grads


def test_varlen_matches_each_sequence_alone():
    lens_q, lens_k = [5, 0, 23, 9], [7, 4, 0, 30]
    cu_q, cu_k = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_k])
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, cu_q[-1], 16, generator=gen).to(DEVICE).requires_grad_(True)
    k = torch.randn(2, cu_k[-1], 16, generator=gen).to(DEVICE).requires_grad_(True)
    v = torch.randn(2, cu_k[-1], 24, generator=gen).to(DEVICE).requires_grad_(True)
    alibi = slopes(4)
    out, lse = ft.varlen_attention(
        q, k, v, torch.as_tensor(cu_q), cu_k.tolist(), causal=True, alibi_slopes=alibi,
        return_lse=True,
    )  # fmt: skip
    dout = torch.randn(out.shape, generator=gen).to(out)
    out.backward(dout)
    ref, ref_lse, ref_grads = varlen_reference(
        *(f64(t) for t in (q, k, v)), cu_q, cu_k, True, alibi.double().numpy(), f64(dout)
    )
    assert rel_err(f64(out), ref) < 1e-6
    assert np.array_equal(np.isneginf(f64(lse)), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(f64(lse)[finite], ref_lse[finite], rtol=2e-6, atol=2e-5)
    for t, g in zip((q, k, v), ref_grads, strict=True):
        assert rel_err(f64(t.grad), g) < 1e-6


@triton.jit
def _round_to_bf16(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, round_bf16(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_bf16_rounding_helper_rounds_to_nearest_even():
    """The interpreter's float32 -> bfloat16 cast truncates (and flushes subnormals);
    the kernels' integer rounding must agree with torch's round-to-nearest-even."""
    special = [0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.0e38, -3.4e38, 1e-40, float("inf")]
    x = torch.cat([torch.tensor(special), torch.randn(500) * 100, torch.randn(500) * 1e-3])
    x = x.to(DEVICE)
    y = torch.empty_like(x)
    _round_to_bf16[(1,)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y, x.to(torch.bfloat16).float())


def test_fake_tensors_give_the_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashtile.triton import ops  # noqa: F401  (registers the ops; the package is lazy)

    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 9, 16), torch.empty(2, 2, 11, 16), torch.empty(2, 2, 11, 8))
        out, lse = torch.ops.flashtile.triton_attention_fwd(
            q, k, v, None, None, None, None, 0, 0, 0.25, -1, 0, None, 0.0, None, None
        )
        dq, dk, dv = torch.ops.flashtile.triton_attention_bwd(
            out, q, k, v, out, lse, None, None, None, None, None, 0, 0, 0.25, -1, 0, None, 0.0,
            None,
        )  # fmt: skip
    assert out.shape == (2, 4, 9, 8) and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_torch_compile_fullgraph_traces_the_ops():
    q, k, v = make((1, 2, 1, 20, 20, 16, 16), F32, 4, True)
    kw = {"causal": True, "softcap": 3.0, "window": (5, None), "enable_gqa": True}
    compiled = torch.compile(lambda *t: ft.attention(*t, **kw), fullgraph=True, backend="aot_eager")
    compiled(q, k, v).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ft.attention(q, k, v, **kw).sum().backward()
    for before, t in zip(grads, (q, k, v), strict=True):
        assert torch.equal(before, t.grad)


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    ("args", "kw", "error", "match"),
    [
        ((_t(1, 2, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4, 8)), {"mask": _t(4, 4)}, ValueError, "mask"),
        ((_t(1, 2, 4, 8), _t(1, 2, 0, 8), _t(1, 2, 0, 8)), {}, ValueError, "empty sequences"),
        ((_t(1, 2, 4, 8, dtype=torch.float64),) * 3, {}, TypeError, "float64"),
        ((_t(1, 2, 4, 300), _t(1, 2, 4, 300), _t(1, 2, 4, 8)), {}, ValueError, "256"),
        ((_t(1, 4, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4, 8)), {}, ValueError, "enable_gqa"),
        ((_t(1, 3, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4, 8)), {"enable_gqa": True}, ValueError,
         "divisible"),
        ((_t(2, 2, 4, 8), _t(2, 2, 4, 8), _t(2, 2, 4, 8)), {"kv_lengths": [1, 5]}, ValueError,
         r"\[0, 4\]"),
        ((_t(2, 2, 4, 8), _t(2, 2, 4, 8), _t(2, 2, 4, 8)), {"alibi_slopes": [1.0]}, ValueError,
         "one slope per query head"),
        ((_t(2, 2, 4, 8), _t(2, 2, 4, 8), _t(2, 2, 4, 8)), {"softcap": -1.0}, ValueError, "> 0"),
        ((_t(2, 2, 4, 8), _t(2, 2, 4, 8), _t(2, 2, 4, 8)), {"window": (-3, 0)}, ValueError,
         "window left"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_with_the_fix(args, kw, error, match):
    with pytest.raises(error, match=match):
        ft.attention(*args, **kw)


def test_bad_varlen_offsets_and_wrong_device_are_refused():
    q = _t(2, 10, 8)
    with pytest.raises(ValueError, match="end at the packed length 10"):
        ft.varlen_attention(q, q, q, [0, 4, 9], [0, 4, 10])
    with pytest.raises(ValueError, match="sequences"):
        ft.varlen_attention(q, q, q, [0, 10], [0, 4, 10])
    other = "meta"
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ft.attention(*(torch.zeros(1, 1, 2, 8, device=other),) * 3)


@triton.jit
def _raw_dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tile = r[:, None] * N + r[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


@pytest.mark.skipif(not ft.INTERPRET, reason="a property of Triton's interpreter")
def test_interpreter_bfloat16_dot_is_still_wrong_so_the_kernels_emulate_it():
    """Triton 3.9's interpreter multiplies bfloat16 tiles as their uint16 bit patterns.
    If this starts to fail, Triton fixed it: EMULATE_BF16 (tiles.py) can go."""
    a, b = (torch.randn(16, 16, generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    c = torch.empty(16, 16)
    _raw_dot[(1,)](a.bfloat16(), b.bfloat16(), c, N=16)
    exact = a.bfloat16().float() @ b.bfloat16().float()
    assert (c - exact).abs().max() > 1.0


def test_under_torch_func():
    """vmap (one kernel call over the folded batch), grad and per-sample
    gradients, through the autograd formula shared with the CPU ops."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 1, 2, 9, 16, generator=gen).to(DEVICE) for _ in range(3))

    def fn(q, k, v):
        return ft.attention(q, k, v, causal=True)

    want = torch.stack([fn(q[i], k[i], v[i]) for i in range(3)])
    torch.testing.assert_close(torch.vmap(fn)(q, k, v), want, rtol=0, atol=0)

    def loss(q, k, v):
        return (fn(q, k, v) ** 2).sum()

    per_sample = torch.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for i in range(3):
        leaves = [t[i].clone().requires_grad_() for t in (q, k, v)]
        loss(*leaves).backward()
        for got, leaf in zip(per_sample, leaves, strict=True):
            torch.testing.assert_close(got[i], leaf.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed variable-length attention cannot run"):
        cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
        torch.vmap(lambda q: ft.varlen_attention(q, k[0, 0], v[0, 0], cu, cu))(q[:, 0])


def test_under_torch_func_with_lengths_and_packed_sequences():
    """A shared kv_lengths folds into a dense tensor (the kernels index it
    without strides); varlen takes grad; dual tensors are refused."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 1, 2, 6, 16, generator=gen).to(DEVICE) for _ in range(3))
    lengths = torch.tensor([4], dtype=torch.int32, device=DEVICE)

    def fn(q, k, v):
        return ft.attention(q, k, v, kv_lengths=lengths)

    want = torch.stack([fn(q[i], k[i], v[i]) for i in range(5)])
    torch.testing.assert_close(torch.vmap(fn)(q, k, v), want, rtol=0, atol=0)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    qv, kv, vv = (t[0, 0].clone() for t in (q, k, v))

    def varlen_loss(q):
        return ft.varlen_attention(q, kv, vv, cu, cu, causal=True).square().sum()

    leaf = qv.clone().requires_grad_()
    varlen_loss(leaf).backward()
    torch.testing.assert_close(torch.func.grad(varlen_loss)(qv), leaf.grad)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(qv, torch.ones_like(qv))
        with pytest.raises(NotImplementedError, match="no forward-mode AD"):
            ft.varlen_attention(dual, kv, vv, cu, cu)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_dropout_and_sinks_match_the_cpu_kernels_mask(dtype):
    """The Triton kernels draw the CPU kernels' dropout mask for the same seed
    (one rule, :mod:`flashtile.dropout`), and merge sinks with their gradient:
    against the float64 reference given that seed."""
    q, k, v = make((2, 4, 2, 21, 37, 16, 16), dtype, 3, True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.25], device=DEVICE, requires_grad=True)
    kw = dict(causal=True, window=(9, None))
    torch.manual_seed(5)
    out = ft.attention(q, k, v, enable_gqa=True, dropout_p=0.3, sinks=sinks, **kw)
    torch.manual_seed(5)  # the seed flashtile drew: torch's generator's first draw
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    ref_kw = dict(dropout_p=0.3, dropout_seed=seed, sinks=f64(sinks), **kw)
    qd, kd, vd = (f64(t) for t in (q, k, v))
    ref, ref_lse = flashtile.tiled_attention(qd, kd, vd, 16, return_lse=True, **ref_kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    want = flashtile.tiled_attention_backward(
        qd, kd, vd, ref, ref_lse, f64(dout), block_size=16, **ref_kw
    )
    tol = 1e-5 if dtype == F32 else 2e-2
    for what, got, w in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref, *want),
                            strict=True):  # fmt: skip
        assert rel_err(f64(got), w) < tol, what


def test_sinks_compile_fullgraph_and_refuse_vmapped_sinks():
    """The sinks' value check reads the host only in eager mode: a compiled
    graph traces through, and a vmapped sink gets the shape rule's error."""
    q, k, v = make((1, 2, 2, 9, 11, 8, 8), F32, 2, False)
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    fn = torch.compile(lambda a, b, c, s: ft.attention(a, b, c, sinks=s), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, sinks), ft.attention(q, k, v, sinks=sinks))
    with pytest.raises(ValueError, match="sinks is vmapped"):
        torch.func.vmap(lambda a, s: ft.attention(a, k[0], v[0], sinks=s))(q, sinks[None])


def test_the_backward_precision_rule_poisons_instead_of_answering_wrong():
    """An lse below its scores' (here by 1e-2) would put every P 1% high: the
    gradients of that batch entry come back NaN (decided on the device, no
    sync), as do those of an lse float32 cannot resolve; the other entry's
    stay. Rows left out of the loss (zero dout) with any lse add exact
    zeros: P is capped, never inf * 0."""
    q, k, v = (t.detach() for t in make((2, 2, 2, 9, 11, 16, 16), F16, 6, False))
    out, lse = ft.attention(q, k, v, return_lse=True)
    dout = torch.randn_like(out)
    right = ft.attention_backward(q, k, v, out, lse, dout)
    assert all(torch.isfinite(g).all() for g in right)
    for shift in (-1e-2, 4e4):  # below the scores; too large for float32 scores
        bad = lse.clone()
        bad[1] += shift
        got = ft.attention_backward(q, k, v, out, bad, dout)
        for g, r in zip(got, right, strict=True):
            assert torch.isnan(g[1]).all() and torch.equal(g[0], r[0])
    dout[:, :, -3:] = 0.0  # rows left out of the loss: any lse there
    lse_off = lse.clone()
    lse_off[:, :, -3:] -= 1e4
    kept = ft.attention_backward(q, k, v, out, lse_off, dout)
    for got, want in zip(kept, ft.attention_backward(q, k, v, out, lse, dout), strict=True):
        assert torch.equal(got, want)
