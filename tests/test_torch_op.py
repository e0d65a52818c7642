"""flashtile.torch.attention and the flashtile::attention_fwd/bwd custom ops.

Gradients are checked numerically in float64 (gradcheck) for every variant
the op exposes, forward and backward are compared with torch SDPA (float32)
and with flashtile's NumPy reference (float64), and the ops pass
``torch.library.opcheck`` and compile with ``torch.compile(fullgraph=True)``.
Shapes are tiny and odd so that every tile edge is exercised.
"""

from __future__ import annotations

import os
import shutil
import sysconfig

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashtile  # noqa: E402
import flashtile.torch as ftt  # noqa: E402

F = torch.nn.functional


def _qkv(b, hq, hkv, tq, tk, d, dv=None, dtype=torch.float64, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, dv or d))
    return tuple(torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes)


def _bottom_right(tq, tk):
    """SDPA's equivalent of flashtile's causal mask: key j visible iff j <= i + Tk - Tq."""
    return torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)


def _mask_with_empty_row(tq, tk, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(tq, tk, generator=g) > 0.4
    mask[:, 0] = True  # every row sees a key ...
    mask[1] = False  # ... except row 1, which sees none
    return mask


# (name, (B, Hq, Hkv, Tq, Tk, d, dv), keywords); every variant the op exposes.
GRADCHECK_CASES = [
    ("plain", (1, 2, 2, 5, 7, 3, None), {}),
    ("causal Tq<Tk", (2, 2, 2, 5, 13, 3, 4), {"causal": True}),
    ("causal Tq>Tk", (1, 3, 3, 13, 7, 3, None), {"causal": True}),  # rows 0..5 see no key
    ("window", (1, 2, 2, 7, 7, 3, None), {"window": (2, 1)}),
    ("causal window scale", (1, 2, 2, 7, 13, 3, None), {"causal": True, "window": (3, None)}),
    ("alibi", (2, 4, 4, 5, 7, 3, None), {"alibi_slopes": torch.tensor([0.5, 0.25, 0.1, 0.0])}),
    ("softcap", (1, 2, 2, 7, 5, 3, None), {"softcap": 2.0, "scale": 3.0}),
    ("bool mask", (1, 2, 2, 7, 13, 3, None), {"mask": _mask_with_empty_row(7, 13)}),
    ("float mask", (1, 2, 2, 5, 7, 3, None), {"mask": -torch.rand(2, 5, 7, dtype=torch.float64)}),
    ("gqa causal", (2, 4, 2, 7, 7, 3, None), {"causal": True, "enable_gqa": True}),
]


@pytest.fixture
def one_kernel_thread():
    """Run the kernels on one thread: gradcheck makes hundreds of tiny calls, and on a
    busy 2-core machine each parallel launch can wait milliseconds for the second
    thread. The multi-threaded paths are covered by the SDPA comparisons."""
    numba = pytest.importorskip("numba")
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


@pytest.mark.usefixtures("one_kernel_thread")
@pytest.mark.parametrize(
    ("name", "dims", "kw"), GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES]
)
def test_gradcheck_float64(name, dims, kw):
    b, hq, hkv, tq, tk, d, dv = dims
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, dv)
    assert torch.autograd.gradcheck(lambda q, k, v: ftt.attention(q, k, v, **kw), (q, k, v))


# (B, Hq, Hkv, Tq, Tk, d, causal, mask kind)
SDPA_GRID = [
    (1, 2, 2, 13, 13, 8, False, None),
    (2, 3, 3, 13, 13, 8, True, None),
    (1, 2, 2, 5, 13, 8, True, None),  # decoding against a cache: bottom-right
    (1, 2, 2, 13, 7, 3, True, None),  # more queries than keys: empty rows
    (2, 4, 2, 7, 13, 8, True, None),  # GQA
    (2, 2, 2, 7, 13, 8, False, "bool"),
    (1, 4, 1, 7, 5, 3, False, "float"),  # MQA + float mask
]


@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "causal", "mask_kind"), SDPA_GRID)
def test_forward_and_backward_equal_sdpa_float32(b, hq, hkv, tq, tk, d, causal, mask_kind):
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, dtype=torch.float32, seed=tq * tk)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, tq, tk) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(tq, tk)
    gqa = hq != hkv
    out = ftt.attention(q, k, v, causal=causal, mask=mask, enable_gqa=gqa)
    sdpa_mask = _bottom_right(tq, tk) if causal else mask
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, enable_gqa=gqa)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_variants_equal_the_numpy_reference_float64():
    q, k, v = _qkv(2, 4, 2, 7, 13, 8, dv=5)
    slopes = torch.tensor([[0.5, 0.3, 0.2, 0.1], [0.05, 0.4, 0.0, 0.25]], dtype=torch.float64)
    mask = torch.rand(2, 1, 7, 13) > 0.2
    kw = {"causal": True, "window": (6, None), "softcap": 3.0, "scale": 0.7}
    out, lse = ftt.attention(
        q, k, v, alibi_slopes=slopes, mask=mask, enable_gqa=True, return_lse=True, **kw
    )
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    qn, kn, vn = (t.detach().numpy() for t in (q, k, v))
    np_kw = {**kw, "alibi_slopes": slopes.numpy(), "mask": mask.numpy()}
    # The reference broadcasts leading dims, so GQA is spelled out as repeated heads.
    kr, vr = (np.repeat(a, 2, axis=1) for a in (kn, vn))
    ref_out, ref_lse = flashtile.tiled_attention(qn, kr, vr, 4, return_lse=True, **np_kw)
    ref_grads = flashtile.tiled_attention_backward(
        qn, kr, vr, ref_out, ref_lse, dout.numpy(), block_size=4, **np_kw
    )
    np.testing.assert_allclose(out.detach().numpy(), ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dq.numpy(), ref_grads[0], rtol=1e-9, atol=1e-12)
    for g, r in zip((dk, dv), ref_grads[1:], strict=True):  # GQA: summed over each group
        np.testing.assert_allclose(g.numpy(), r.reshape(2, 2, 2, *r.shape[2:]).sum(2), 1e-9, 1e-12)


def test_fully_masked_rows_give_zeros_and_zero_grads():
    keep = _mask_with_empty_row(7, 13)
    for tk, kw in (
        (13, {"mask": keep}),
        (13, {"mask": torch.where(keep, 0.0, float("-inf"))}),
        (5, {"causal": True}),  # Tq > Tk: the first two queries precede every key
    ):
        q, k, v = _qkv(1, 2, 2, 7, tk, 8, dtype=torch.float32)
        out, lse = ftt.attention(q, k, v, return_lse=True, **kw)
        out.sum().backward()
        empty = torch.isneginf(lse)
        assert empty.any() and not out.isnan().any()
        assert (out[empty] == 0).all()
        assert (q.grad[empty] == 0).all() and torch.isfinite(q.grad).all()
        assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_empty_batch_runs_forward_and_backward():
    q, k, v = (torch.randn(0, 2, 4, 8, requires_grad=True) for _ in range(3))
    ftt.attention(q, k, v, causal=True).sum().backward()
    assert q.grad.shape == (0, 2, 4, 8) and k.grad.shape == (0, 2, 4, 8)


def test_constants_given_as_lists_or_under_no_grad():
    q, k, v = _qkv(1, 2, 2, 5, 5, 4, dtype=torch.float64)
    exact = torch.tensor([0.1, 0.3], dtype=torch.float64)
    # A list of Python floats is not rounded to float32 on the way in.
    assert torch.equal(
        ftt.attention(q, k, v, alibi_slopes=[0.1, 0.3]), ftt.attention(q, k, v, alibi_slopes=exact)
    )
    bias = torch.zeros(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)  # a learned bias
    with torch.no_grad():  # no gradient can be dropped: accepted
        torch.testing.assert_close(ftt.attention(q, k, v, mask=bias), ftt.attention(q, k, v))
    with pytest.raises(ValueError, match="mask requires grad"):
        ftt.attention(q, k, v, mask=bias)
    keep = [[True, False, False, True, True]] * 5  # a list of bools stays a bool mask
    torch.testing.assert_close(
        ftt.attention(q, k, v, mask=keep), ftt.attention(q, k, v, mask=torch.tensor(keep))
    )


def test_lse_is_the_log_normaliser_and_carries_no_grad():
    q, k, v = _qkv(1, 2, 2, 5, 7, 3)
    out, lse = ftt.attention(q, k, v, causal=True, return_lse=True)
    scores = (q @ k.transpose(-1, -2)) / 3**0.5
    expected = scores.masked_fill(~_bottom_right(5, 7), float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, expected.detach())
    assert out.requires_grad and not lse.requires_grad


def test_opcheck_forward_and_backward_ops():
    q, k, v = _qkv(1, 4, 2, 7, 13, 8, dtype=torch.float32)
    mask = torch.where(torch.rand(7, 13) > 0.3, 0.0, float("-inf"))
    seed = torch.tensor(12345)
    variants = (mask, torch.tensor([0.5, 0.25, 0.1, 0.05]), True, 0.4, 4, -1, 30.0, None, 0.2, seed)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    torch.library.opcheck(
        torch.ops.flashtile.attention_fwd.default, (q, k, v, *variants, sinks)
    )  # fmt: skip
    plain = (None, None, False, None, -1, -1, None, None, 0.0, None)
    torch.library.opcheck(torch.ops.flashtile.attention_fwd.default, (q, k, v, *plain, None))
    # The backward op is called under no_grad by autograd (no double backward),
    # so it is checked with inputs that do not require grad.
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = torch.ops.flashtile.attention_fwd(q, k, v, *variants, sinks)
    dout = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.flashtile.attention_bwd.default, (dout, q, k, v, out, lse, sinks, *variants)
    )


class _Block(torch.nn.Module):
    """A toy attention block: projections around flashtile.torch.attention (GQA, causal)."""

    def __init__(self, d=8):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

    def forward(self, q, k, v):
        out = ftt.attention(self.proj(q), k, v, causal=True, window=(5, None), enable_gqa=True)
        return out.sin()


def _compiled_matches_eager(backend):
    torch.manual_seed(0)
    block = _Block()
    q, k, v = _qkv(1, 4, 2, 13, 13, 8, dtype=torch.float32)
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    results = []
    for fn in (block, compiled):
        out = fn(q, k, v)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, block.proj.weight))
        results.append((out, *grads))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1  # one graph, the op inside it
    assert "torch.ops.flashtile.attention_fwd" in counter.graphs[0].code


def test_torch_compile_fullgraph_aot_eager_matches_eager():
    torch._dynamo.reset()
    _compiled_matches_eager("aot_eager")


def _cxx_compiler():
    names = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    return next((shutil.which(n) for n in names if n and shutil.which(n)), None)


def _python_headers() -> bool:
    return os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


@pytest.mark.skipif(_cxx_compiler() is None, reason="inductor needs a C++ compiler (none found)")
@pytest.mark.skipif(not _python_headers(), reason="inductor needs Python.h (python3-dev)")
def test_torch_compile_fullgraph_inductor_matches_eager():
    torch._dynamo.reset()
    _compiled_matches_eager("inductor")


def test_non_contiguous_inputs():
    base = torch.randn(2, 13, 4, 8, dtype=torch.float64)  # (B, T, H, d): a transposed view
    q = base.transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 4, 8, 13, dtype=torch.float64).transpose(-1, -2) for _ in range(2))
    assert not (q.is_contiguous() or k.is_contiguous())
    out = ftt.attention(q, k, v, causal=True)
    ref = ftt.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert grad.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_come_back_in_their_dtype(dtype):
    q, k, v = _qkv(1, 2, 2, 7, 13, 8, dtype=dtype)
    out, lse = ftt.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    ref = ftt.attention(*(t.detach().float() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_three_dim_inputs():
    q, k, v = (t[0] for t in _qkv(1, 2, 2, 5, 7, 3))
    out = ftt.attention(q, k, v, causal=True)
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, attn_mask=_bottom_right(5, 7))
    )


def test_errors_are_clear():
    q, k, v = _qkv(1, 4, 2, 5, 7, 3, grad=False)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        ftt.attention(q, k, v)
    meta = q.to("meta")
    with pytest.raises(ValueError, match=r"device meta.*\.cpu\(\)"):
        ftt.attention(meta, k.to("meta"), v.to("meta"), enable_gqa=True)
    with pytest.raises(ValueError, match="mask is on device meta"):
        ftt.attention(q, k, v, enable_gqa=True, mask=torch.ones(5, 7, device="meta"))
    with pytest.raises(ValueError, match="mask requires grad"):
        ftt.attention(q, k, v, enable_gqa=True, mask=torch.zeros(5, 7, requires_grad=True))
    with pytest.raises(ValueError, match="alibi_slopes requires grad"):
        ftt.attention(q, k, v, enable_gqa=True, alibi_slopes=torch.ones(4, requires_grad=True))
    with pytest.raises(TypeError, match="one floating dtype"):
        ftt.attention(q.int(), k.int(), v.int(), enable_gqa=True)
    with pytest.raises(TypeError, match=r"flashtile\.attention for NumPy"):
        ftt.attention(q.numpy(), k, v, enable_gqa=True)
    with pytest.raises(ValueError, match=r"\(B, H, T, d\)"):
        ftt.attention(q[0, 0], k[0, 0], v[0, 0])
    with pytest.raises(TypeError, match="upcasts float16"):
        torch.ops.flashtile.attention_fwd(
            q.half(), k.half(), v.half(), None, None, False, None, -1, -1, None, None, 0.0, None,
            None,
        )  # fmt: skip
    q.requires_grad_()
    (grad,) = torch.autograd.grad(
        ftt.attention(q, k, v, enable_gqa=True).sum(), q, create_graph=True
    )
    with pytest.raises(RuntimeError, match="no double backward"):
        grad.sum().backward()
    with pytest.raises(ValueError, match="window"):
        ftt.attention(q, k, v, enable_gqa=True, window=(-3, 0))


def test_flags_are_bools_and_masks_plain_tensors():
    q, k, v = _qkv(1, 2, 2, 5, 7, 3, grad=False)
    wrong = (
        *(("causal", 1), ("causal", torch.tensor(True)), ("causal", None)),
        *(("enable_gqa", "no"), ("enable_gqa", 0), ("return_lse", 0), ("return_lse", "no")),
    )
    for flag, value in wrong:
        with pytest.raises(TypeError, match=f"{flag} must be True or False"):
            ftt.attention(q, k, v, **{flag: value})
    for flag in ("causal", "enable_gqa", "return_lse"):  # NumPy bools are bools
        assert ftt.attention(q, k, v, **{flag: np.bool_(True)}) is not None
    from torch.nn.attention.bias import causal_lower_right

    # Its values live in __torch_function__, not in the storage the kernels read.
    with pytest.raises(TypeError, match=r"CausalBias.*causal=True is causal_lower_right"):
        ftt.attention(q, k, v, mask=causal_lower_right(5, 7))
    bias = torch.nn.Parameter(torch.zeros(5, 7, dtype=torch.float64))  # a plain subclass
    with torch.no_grad():
        torch.testing.assert_close(ftt.attention(q, k, v, mask=bias), ftt.attention(q, k, v))


def test_vmap_over_the_operator_matches_a_loop():
    # Under vmap the tensors are batched wrappers: the op must go through the dispatcher.
    q, k, v = (torch.randn(3, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    got = torch.func.vmap(lambda a, b, c: ftt.attention(a, b, c, causal=True))(q, k, v)
    want = torch.stack(
        [ftt.attention(a, b, c, causal=True) for a, b, c in zip(q, k, v, strict=True)]
    )
    torch.testing.assert_close(got, want)


def test_eager_training_path_equals_the_dispatched_op():
    """Eager calls with gradients skip the dispatcher (an autograd.Function with
    the op's formula): the same outputs and gradients, bit for bit, as the op."""
    q, k, v = _qkv(2, 4, 2, 5, 9, 8, dtype=torch.float32)
    slopes = torch.tensor([0.5, 0.25, 0.1, 0.05])
    out, lse = ftt.attention(
        q, k, v, causal=True, enable_gqa=True, alibi_slopes=slopes, return_lse=True
    )
    assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_lse = torch.ops.flashtile.attention_fwd(
        q, k, v, None, slopes, True, None, -1, -1, None, None, 0.0, None, None
    )
    assert type(ref.grad_fn).__name__ != "EagerAttentionBackward"
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), dout), strict=True):
        assert torch.equal(got, want)
    # A dispatch mode active only around the backward still sees its op.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    seen = []
    out = ftt.attention(q, k, v, causal=True, enable_gqa=True)
    with Log():
        out.sum().backward()
    assert any("attention_bwd" in name for name in seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_plain_eager_calls_skip_the_op_layers_and_equal_the_op(dtype, monkeypatch):
    """A plain eager call without gradients runs straight on the kernels (not
    through the op's implementation), validated once per metadata while the
    key count changes (a decoding loop), with the op's results bit for bit;
    kv_lengths values are checked on every call."""
    from flashtile import frontdoor
    from flashtile.torch import _attention, _ops

    def torch_keys():
        return sum(key[0] == "torch" for key in frontdoor._PREPARED)

    frontdoor._PREPARED.clear()
    forward = op = _ops.forward  # the op's implementation, kept for the references
    monkeypatch.setattr(_ops, "forward", lambda *a: pytest.fail("the op's layers ran"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 1, 32, generator=g).to(dtype)
    for tk in (600, 601):  # decode-shaped, GQA: one validation for both
        k, v = (torch.randn(1, 2, tk, 32, generator=g).to(dtype) for _ in range(2))
        out, lse = ftt.attention(q, k, v, enable_gqa=True, return_lse=True, scale=0.3)
        want = op(q, k, v, None, None, False, 0.3, -1, -1, None, None, 0.0, None, None)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        for _ in range(2):  # its stored step, without lse: the kernel's own output
            again = ftt.attention(q, k, v, enable_gqa=True, scale=0.3)
            assert torch.equal(again, want[0]) and again.dtype == dtype
    assert torch_keys() == 1
    key = next(key for key in frontdoor._PREPARED if key[0] == "torch")
    assert key[_attention._KEY_DTYPES] == (dtype,) * 3  # (where the plain path reads them)
    for n in (3, 601):  # a static cache: its filled length, values checked on every call
        lengths = torch.tensor([n])
        out = ftt.attention(q, k, v, enable_gqa=True, kv_lengths=lengths)
        assert torch.equal(
            out, op(q, k, v, None, None, False, None, -1, -1, None, lengths, 0.0, None, None)[0]
        )
    assert torch_keys() == 2
    with pytest.raises(ValueError, match="kv_lengths must lie in"):
        ftt.attention(q, k, v, enable_gqa=True, kv_lengths=torch.tensor([602]))
    tiny = [torch.randn(2, 4, 16, 8, generator=g).to(dtype) for _ in range(3)]
    out = ftt.attention(*tiny, causal=True, softcap=5.0)
    assert torch.equal(
        out, op(*tiny, None, None, True, None, -1, -1, 5.0, None, 0.0, None, None)[0]
    )
    with pytest.raises(ValueError, match="enable_gqa=True"):  # another key: validated again
        ftt.attention(q, k, v)
    monkeypatch.setattr(_ops, "forward", forward)  # float16 and gradients: the op's path
    half = ftt.attention(*(t.half() for t in tiny), causal=True)
    assert half.dtype == torch.float16
    grad = ftt.attention(*(t.requires_grad_() for t in tiny), causal=True)
    assert type(grad.grad_fn).__name__ == "EagerAttentionBackward"


def test_plain_calls_wanting_gradients_are_validated_once(monkeypatch):
    """A plain call that wants gradients is refused or accepted by its first
    call of a metadata and skips the refusal afterwards; its outputs and
    gradients are the general path's (the op's arguments through the same
    autograd.Function), bit for bit; under no_grad, tensors that require
    grad take the plain path detached."""
    from flashtile import frontdoor
    from flashtile.torch import _attention

    frontdoor._PREPARED.clear()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g).requires_grad_() for _ in range(3))
    with pytest.raises(TypeError, match="dtype"):  # the first call of a key is checked
        ftt.attention(q, k.detach().double().requires_grad_(), v, causal=True)
    checked = []
    real = _attention.refusal
    monkeypatch.setattr(_attention, "refusal", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    for _ in range(3):
        out, lse = ftt.attention(q, k, v, causal=True, softcap=4.0, return_lse=True)
    assert len(checked) == 1 and type(out.grad_fn).__name__ == "EagerAttentionBackward"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # window=(None, None) is no window, but not a plain call: the general path
    ref, ref_lse = ftt.attention(q, k, v, causal=True, softcap=4.0, window=(None, None),
                                 return_lse=True)  # fmt: skip
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), dout), strict=True):
        assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(ftt.attention(q, k, v, causal=True, softcap=4.0), out)
    assert len(checked) == 2  # (the window call's)
    # a key first checked by a call without gradients; bfloat16, int32 lengths
    q, k, v = (t.detach().to(torch.bfloat16) for t in (q, k, v))
    lengths = torch.tensor([9], dtype=torch.int32)
    ftt.attention(q, k, v, kv_lengths=lengths)
    out = ftt.attention(*(t.requires_grad_() for t in (q, k, v)), kv_lengths=lengths)
    assert len(checked) == 3 and type(out.grad_fn).__name__ == "EagerAttentionBackward"
    ref = ftt.attention(q, k, v, kv_lengths=lengths, window=(None, None))
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(ref, (q, k, v), dout),
        strict=True,
    ):
        assert torch.equal(got, want)
