"""CUDA calls reach the Triton kernels from the operator, the SDPA router and the hook.

One rule decides (``flashtile.torch._support.refusal``): a call whose q, k, v
are all CUDA tensors runs on ``flashtile.triton`` when the operator accepts
it, and the router passes it to SDPA with the operator's message otherwise.
Without a GPU the device test (``_support.is_cuda_call``) is forced to True
for CPU tensors and the kernels run in Triton's interpreter; with
``TRITON_INTERPRET=0`` on a GPU machine the same tests run on CUDA tensors
(tests/triton_device.py).
The Triton front door's run is wrapped to record which op its plan chose
(``attention``: the forward, ``decode_attention``: the split-KV decode); the
results are checked against the NumPy reference. Shapes are tiny: the interpreter is slow.
"""

import numpy as np
import pytest

# First: sets the device, skips this module without torch or triton.
from triton_device import DEVICE, ft, torch

# isort: split
import flashtile
import flashtile.torch as ftt
import flashtile.torch._support as support
import flashtile.triton.frontdoor as triton_frontdoor
from flashtile.torch.hf import tiled_attention_forward

F = torch.nn.functional


@pytest.fixture
def ran(monkeypatch):
    """The Triton ops the front door ran, in order ("attention" for the forward,
    "decode_attention" for the decode op); CPU tensors count as CUDA under the
    interpreter."""
    calls = []
    real = triton_frontdoor.run_plan

    def spy(call, plan, return_lse):
        calls.append("decode_attention" if plan.decode else "attention")
        return real(call, plan, return_lse)

    monkeypatch.setattr(triton_frontdoor, "run_plan", spy)
    if ft.INTERPRET:
        monkeypatch.setattr(support, "is_cuda_call", lambda q, k, v: True)
    return calls


def qkv(b, hq, hk, tq, tk, d, grad=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(tq * 100 + tk)
    shapes = ((b, hq, tq, d), (b, hk, tk, d), (b, hk, tk, d))
    return [torch.randn(s, generator=gen).to(DEVICE, dtype).requires_grad_(grad) for s in shapes]


def reference(q, k, v, causal=False, **kw):
    """flashtile's NumPy reference in float64: ``(out, lse)``."""
    arrays = (t.detach().cpu().double().numpy() for t in (q, k, v))
    return flashtile.tiled_attention(*arrays, 8, causal, return_lse=True, **kw)


def assert_matches(got, want):
    np.testing.assert_allclose(got.detach().cpu().double().numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("grad", "tq", "kernel"), [(True, 5, "attention"),
                                                    (False, 1, "decode_attention")])  # fmt: skip
def test_router_routes_cuda_calls_to_the_triton_kernels(ran, grad, tq, kernel):
    """Top-left is_causal with Tq < Tk and GQA; a decoding step without gradients takes
    the split-KV kernel."""
    q, k, v = qkv(1, 4, 2, tq, 9, 16, grad=grad)
    with ftt.route_sdpa(strict=True) as router:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert router.routed == 1 and ran == [kernel]
    want, _ = reference(q, k[..., :tq, :], v[..., :tq, :], causal=True)  # SDPA's j <= i
    assert_matches(out, want)
    if grad:
        out.sum().backward()
        assert q.grad.shape == q.shape and torch.isfinite(q.grad).all()


@pytest.mark.parametrize(
    ("case", "error", "words"),
    [
        ("bool_mask", ValueError, "take no mask"),
        ("float64", TypeError, "float64 runs on the CPU path"),
        ("head_dim_300", ValueError, "1 to 256"),
        ("no_triton", ImportError, "pip install 'flashtile[gpu]'"),
    ],
)
def test_cuda_calls_the_kernels_refuse_pass_through_with_the_operators_reason(
    ran, monkeypatch, case, error, words
):
    q, k, v = qkv(1, 2, 2, 3, 4, 300 if case == "head_dim_300" else 8)
    kw = {}
    if case == "bool_mask":
        kw["attn_mask"] = torch.ones(3, 4, dtype=torch.bool, device=DEVICE)
    if case == "float64":
        q, k, v = (t.double() for t in (q, k, v))
    if case == "no_triton":
        monkeypatch.setattr(support, "_triton_missing", lambda: "No module named 'triton'")
    with ftt.route_sdpa() as router:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    (reason,) = router.reasons
    assert router.passed == 1 and router.routed == 0 and ran == [] and words in reason
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, **kw))
    with pytest.raises(error) as refused:  # the operator raises that very message
        ftt.attention(q, k, v, mask=kw.get("attn_mask"))
    assert str(refused.value) == reason


def test_operator_hands_every_keyword_to_the_triton_forward(ran):
    q, k, v = qkv(2, 4, 2, 7, 11, 16, grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    kw = {"window": (3, 0), "softcap": 5.0, "alibi_slopes": slopes, "scale": 0.4}
    out, lse = ftt.attention(q, k, v, causal=True, enable_gqa=True, return_lse=True, **kw)
    assert ran == ["attention"]
    want, want_lse = reference(q, k, v, causal=True, **{**kw, "alibi_slopes": slopes.numpy()})
    assert_matches(out, want)
    assert_matches(lse, want_lse)


def test_hook_sends_a_cuda_prefill_and_a_decoding_step_to_triton(ran):
    """transformers' calling convention: out comes back as (B, Tq, H, d)."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = qkv(1, 4, 2, 6, 6, 16, grad=True)
    out, _ = tiled_attention_forward(module, q, k, v, None, softcap=3.0)
    assert_matches(out.transpose(1, 2), reference(q, k, v, causal=True, softcap=3.0)[0])
    step, _, _ = qkv(1, 4, 2, 1, 6, 16)  # one new token against the 6 cached keys
    with torch.no_grad():
        out, _ = tiled_attention_forward(module, step, k, v, None)
    assert_matches(out.transpose(1, 2), reference(step, k, v)[0])
    assert ran == ["attention", "decode_attention"]


def test_the_triton_entry_point_and_the_operator_share_one_routing(ran):
    """flashtile.triton.attention takes the front door's plan too: a 4-D decoding step
    without gradients runs the decode op; 3-D inputs (the forward: the decode op takes
    4-D) give 3-D results; the same step wanting gradients runs the forward."""
    q, k, v = qkv(2, 4, 2, 2, 12, 16)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    kw = {"window": (5, 0), "alibi_slopes": slopes}
    out, lse = ft.attention(q, k, v, causal=True, enable_gqa=True, return_lse=True, **kw)
    want, want_lse = reference(q, k, v, causal=True, window=(5, 0), alibi_slopes=slopes.numpy())
    assert_matches(out, want)
    assert_matches(lse, want_lse)
    out3 = ft.attention(q[0], k[0], v[0], causal=True, enable_gqa=True)
    assert out3.shape == q.shape[1:] and ran == ["decode_attention", "attention"]
    assert_matches(out3, reference(q[0], k[0], v[0], causal=True)[0])
    q.requires_grad_()
    ft.attention(q, k, v, causal=True, enable_gqa=True).sum().backward()
    assert ran[-1] == "attention" and torch.isfinite(q.grad).all()
    # Forward-mode dual tensors never take the decode op, which would drop their tangent.
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(k.detach(), torch.ones_like(k))
        with pytest.raises(NotImplementedError, match="no forward-mode AD"):
            ft.attention(q.detach(), dual, v, causal=True, enable_gqa=True)
