"""flashtile.torch.attention under torch.func: vmap (the ops' batching rules),
grad / jacrev / per-sample gradients, forward-mode AD refused clearly.

Every vmapped result is compared with a Python loop over the vmapped
dimension (the definition of vmap), gradients with SDPA's in float64.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashtile.torch as ftt  # noqa: E402

F = torch.nn.functional


def _t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _loop(fn, in_dims, *args):
    """``fn`` over the vmapped dimension one entry at a time, stacked."""
    size = next(a.shape[d] for a, d in zip(args, in_dims, strict=True) if d is not None)
    outs = []
    for i in range(size):
        picked = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)]
        outs.append(fn(*picked))
    return torch.stack(outs)


VMAP_CASES = [
    # (q, k, v shapes with the vmapped dim, in_dims, keywords)
    (((3, 2, 4, 7, 5), (3, 2, 2, 9, 5), (3, 2, 2, 9, 6)), (0, 0, 0), {"enable_gqa": True}),
    (((2, 4, 3, 7, 5), (2, 4, 9, 5), (2, 4, 9, 5)), (2, None, None), {"causal": True}),
    (((4, 7, 5, 3), (4, 9, 5), (4, 9, 5)), (3, None, None), {"window": (2, 1)}),  # 3-D
    (((3, 4, 5), (4, 3, 6, 5), (4, 3, 6, 5)), (None, 0, 0), {"softcap": 3.0}),  # 3-D
]


@pytest.mark.parametrize("shapes, in_dims, kw", VMAP_CASES)
def test_vmap_equals_a_loop(shapes, in_dims, kw):
    args = [_t(*s, seed=i) for i, s in enumerate(shapes)]

    def fn(q, k, v):
        return ftt.attention(q, k, v, **kw)

    got = torch.vmap(fn, in_dims=in_dims)(*args)
    torch.testing.assert_close(got, _loop(fn, in_dims, *args), rtol=1e-12, atol=1e-12)


def test_vmap_folds_the_constants_batch_axes():
    """A 4-D mask, (B, Hq) slopes and (B,) lengths: vmapped or shared."""
    q, k, v = _t(3, 2, 4, 5, 8), _t(3, 2, 4, 9, 8, seed=1), _t(3, 2, 4, 9, 8, seed=2)
    mask = _t(3, 2, 1, 5, 9, seed=3) > -0.5  # vmapped, (B, 1, Tq, Tk) per entry
    slopes = torch.rand(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([7, 9])

    def fn(q, k, v, m):
        return ftt.attention(q, k, v, mask=m, alibi_slopes=slopes, kv_lengths=lengths)

    dims = (0, 0, 0, 0)
    torch.testing.assert_close(
        torch.vmap(fn, in_dims=dims)(q, k, v, mask), _loop(fn, dims, q, k, v, mask)
    )
    shared = (0, 0, 0, None)
    got = torch.vmap(fn, in_dims=shared)(q, k, v, mask[0])
    torch.testing.assert_close(got, _loop(fn, shared, q, k, v, mask[0]))


def test_grad_and_jacrev_match_sdpa():
    q, k, v = _t(1, 2, 5, 4), _t(1, 2, 7, 4, seed=1), _t(1, 2, 7, 3, seed=2)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) ** 2).sum()

    ours = torch.func.grad(loss(ftt.attention), argnums=(0, 1, 2))(q, k, v)
    want = torch.func.grad(loss(F.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    jac = torch.func.jacrev(lambda q: ftt.attention(q, k, v))(q)
    want = torch.func.jacrev(lambda q: F.scaled_dot_product_attention(q, k, v))(q)
    torch.testing.assert_close(jac, want, rtol=1e-10, atol=1e-10)


def test_per_sample_gradients():
    """vmap(grad(...)): one gradient per sample, as a loop of grads gives."""
    q, k, v = _t(4, 2, 6, 8), _t(4, 2, 6, 8, seed=1), _t(4, 2, 6, 8, seed=2)
    weight = _t(8, 8, seed=3)

    def loss(w, q, k, v):  # one sample: (H, T, d)
        return (ftt.attention(q @ w, k, v, causal=True) ** 2).sum()

    per_sample = torch.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0))(weight, q, k, v)
    want = torch.stack([torch.func.grad(loss)(weight, q[i], k[i], v[i]) for i in range(4)])
    torch.testing.assert_close(per_sample, want, rtol=1e-10, atol=1e-10)


def test_gradcheck_with_batched_gradients():
    """torch's own gradcheck with check_batched_grad (vmap over the backward)."""
    args = [
        t.requires_grad_() for t in (_t(1, 2, 4, 3), _t(1, 2, 5, 3, seed=1), _t(1, 2, 5, 3, seed=2))
    ]
    assert torch.autograd.gradcheck(
        lambda q, k, v: ftt.attention(q, k, v, causal=True), args, check_batched_grad=True
    )


def test_routed_sdpa_under_vmap():
    q, k, v = _t(3, 1, 2, 5, 4), _t(3, 1, 2, 5, 4, seed=1), _t(3, 1, 2, 5, 4, seed=2)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    want = torch.vmap(fn)(q, k, v)
    with ftt.route_sdpa() as router:
        got = torch.vmap(fn)(q, k, v)
    assert router.routed == 1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_forward_mode_is_refused_clearly():
    q, k, v = _t(1, 2, 5, 4), _t(1, 2, 7, 4, seed=1), _t(1, 2, 7, 4, seed=2)
    with pytest.raises(NotImplementedError, match="no forward-mode AD"):
        torch.func.jvp(lambda q: ftt.attention(q, k, v), (q,), (torch.ones_like(q),))
    for grad in (False, True):  # torch.autograd.forward_ad: no tangent dropped silently
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(q.clone().requires_grad_(grad), q)
            with pytest.raises(NotImplementedError, match="no forward-mode AD"):
                ftt.attention(dual, k, v)
    with pytest.raises(RuntimeError, match="no double backward"):
        inner = torch.func.grad(lambda q: ftt.attention(q, k, v).sum())
        torch.func.grad(lambda q: inner(q).sum())(q)


def test_vmap_refuses_what_the_call_refuses():
    """Per-batch slopes need 4-D inputs, vmapped or not."""
    q, k, v = _t(2, 4, 5, 8), _t(2, 4, 7, 8, seed=1), _t(2, 4, 7, 8, seed=2)
    slopes = torch.rand(2, 1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"shape \(1, 4\).*needs 4-D"):
        torch.vmap(lambda q, k, v, s: ftt.attention(q, k, v, alibi_slopes=s))(q, k, v, slopes)


def test_the_router_passes_dual_tensors_to_sdpa():
    q, k, v = _t(1, 2, 5, 4), _t(1, 2, 5, 4, seed=1), _t(1, 2, 5, 4, seed=2)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        math = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
        with ftt.route_sdpa() as router, math:  # SDPA's math path has forward AD
            out = F.scaled_dot_product_attention(dual, k, v)
        tangent = torch.autograd.forward_ad.unpack_dual(out).tangent
    assert router.passed == 1 and "forward-mode AD" in next(iter(router.reasons))
    assert tangent is not None
