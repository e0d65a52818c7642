"""Dropout and sinks through ``flashtile.torch.attention``: reproducibility,
gradients, torch.compile, torch.func (the NumPy paths: test_dropout_sinks.py)."""

from __future__ import annotations

import numba
import pytest

torch = pytest.importorskip("torch")

import flashtile.torch as ftt  # noqa: E402


def _qkv(b=1, hq=4, hkv=2, tq=9, tk=13, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    shapes = ((b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, d))
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _run(q, k, v, sinks, seed, **kw):
    torch.manual_seed(seed)
    out = ftt.attention(q, k, v, causal=True, enable_gqa=True, sinks=sinks, **kw)
    return (out, *torch.autograd.grad(out.square().sum(), (q, k, v, sinks)))


def test_torch_seed_reproduces_outputs_and_gradients_across_threads():
    q, k, v = _qkv(dtype=torch.float32, tq=70, tk=90)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    first = _run(q, k, v, sinks, 3, dropout_p=0.2)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        serial = _run(q, k, v, sinks, 3, dropout_p=0.2)
    finally:
        numba.set_num_threads(threads)
    for a, b in zip(first, serial, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)  # sums in another order
    assert torch.equal(first[0], _run(q, k, v, sinks, 3, dropout_p=0.2)[0])  # bit for bit
    assert not torch.equal(first[0], _run(q, k, v, sinks, 4, dropout_p=0.2)[0])


def test_gradcheck_with_dropout_and_sinks():
    q, k, v = (t.detach()[..., :5, :].clone().requires_grad_() for t in _qkv())
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, sinks):
        torch.manual_seed(7)  # one mask for every evaluation
        return ftt.attention(q, k, v, causal=True, enable_gqa=True, dropout_p=0.3, sinks=sinks)

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_compiled_training_step_with_dropout_and_sinks():
    q, k, v = _qkv(dtype=torch.float32)
    sinks = torch.zeros(4, requires_grad=True)
    step = torch.compile(
        lambda q, k, v, s: ftt.attention(q, k, v, causal=True, enable_gqa=True, sinks=s,
                                         dropout_p=0.1).square().sum(),
        fullgraph=True,
    )  # fmt: skip
    results = []
    for _ in range(2):
        torch.manual_seed(1)
        loss = step(q, k, v, sinks)
        results.append((loss, *torch.autograd.grad(loss, (q, sinks))))
    for a, b in zip(*results, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_torch_func_refuses_dropout_and_vmapped_sinks():
    q, k, v = (t.detach() for t in _qkv(b=2))

    def dropped(a, b, c):
        return ftt.attention(a, b, c, enable_gqa=True, dropout_p=0.1)

    with pytest.raises(RuntimeError, match="random operation"):  # torch's own rule first
        torch.func.vmap(dropped)(q, k, v)
    with pytest.raises(ValueError, match=r"dropout cannot run under torch\.vmap"):
        torch.func.vmap(dropped, randomness="same")(q, k, v)
    sinks = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="sinks is vmapped"):
        torch.func.vmap(lambda a, b, c, s: ftt.attention(a, b, c, enable_gqa=True, sinks=s))(
            q, k, v, sinks
        )
    # Shared sinks under vmap, and per-sample gradients of them through torch.func.grad.
    shared = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)

    def loss(s, a, b, c):
        return ftt.attention(a[None], b[None], c[None], enable_gqa=True, sinks=s).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0))(shared, q, k, v)
    for i in range(2):
        s = shared.clone().requires_grad_()
        (want,) = torch.autograd.grad(loss(s, q[i], k[i], v[i]), s)
        torch.testing.assert_close(per_sample[i], want)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"dropout_p": 1.0}, ValueError, r"\[0, 1\)"),
        ({"dropout_p": "0.1"}, TypeError, "dropout_p"),
        ({"sinks": torch.zeros(3)}, ValueError, r"shape \(Hq,\) = \(4,\)"),
        ({"sinks": torch.zeros(4, dtype=torch.int64)}, ValueError, "non-float"),
    ],
)
def test_bad_dropout_and_sinks_are_refused(kw, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        ftt.attention(q, k, v, enable_gqa=True, **kw)
