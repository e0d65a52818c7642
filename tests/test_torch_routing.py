"""flashtile.torch.route_sdpa: supported SDPA calls go to flashtile, the rest pass through.

Every routed call is compared with the original SDPA on the same arguments
(outputs and gradients), including ``is_causal`` with ``Tq != Tk``, where SDPA
aligns the mask top-left and the router has to translate.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashtile.torch as ftt  # noqa: E402

F = torch.nn.functional
SDPA = F.scaled_dot_product_attention


def _qkv(b, hq, hkv, tq, tk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, d))
    return tuple(torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes)


def _fwd_bwd(fn, q, k, v, **kw):
    out = fn(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out) / out.numel() ** 0.5)
    return out, *grads


# (B, Hq, Hkv, Tq, Tk, d, SDPA keywords)
ROUTED = [
    (1, 2, 2, 13, 13, 8, {}),
    (2, 2, 2, 13, 13, 8, {"is_causal": True}),
    (1, 2, 2, 5, 13, 8, {"is_causal": True}),  # top-left, Tq < Tk: keys >= Tq unseen
    (1, 2, 2, 13, 5, 8, {"is_causal": True}),  # top-left, Tq > Tk
    (2, 4, 2, 7, 13, 8, {"is_causal": True, "enable_gqa": True, "scale": 0.3}),
    (2, 2, 2, 7, 13, 3, {"attn_mask": "bool"}),
    (1, 2, 2, 7, 13, 8, {"attn_mask": "float"}),
    (0, 2, 2, 7, 13, 8, {"is_causal": True}),  # an empty batch
]


@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "kw"), ROUTED)
def test_supported_calls_are_routed_and_equal_sdpa(b, hq, hkv, tq, tk, d, kw):
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, seed=tq + tk)
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(b, 1, tq, tk) > 0.3
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(tq, tk)
    expected = _fwd_bwd(SDPA, q, k, v, **kw)
    with ftt.route_sdpa(strict=True) as router:
        got = _fwd_bwd(F.scaled_dot_product_attention, q, k, v, **kw)
    assert (router.routed, router.passed) == (1, 0)
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    assert F.scaled_dot_product_attention is SDPA  # restored


def test_unsupported_calls_pass_through_with_reasons():
    q, k, v = _qkv(1, 4, 2, 7, 7, 8)
    q2 = q[:, :2]
    with ftt.route_sdpa() as router:
        sdpa = F.scaled_dot_product_attention  # looked up inside: the router
        sdpa(q2, k, v, attn_mask=torch.zeros(7, 7, requires_grad=True))  # a learned bias
        sdpa(q2[None], k[None], v[None])  # 5-D
        sdpa(q2, k[:, :1], v[:, :1])  # SDPA broadcasts a single kv head
        on_meta = sdpa(*(t.detach().to("meta") for t in (q2, k, v)))
        with pytest.raises(RuntimeError, match="attn_mask dtype"):  # SDPA's own error
            sdpa(q2.double(), k.double(), v.double(), attn_mask=torch.zeros(7, 7).half())
        with pytest.raises(RuntimeError):  # GQA without enable_gqa: SDPA refuses
            sdpa(q, k, v)
        # Calls SDPA itself rejects reach SDPA and its error (not a routed result).
        for bad in (torch.rand(7) > 0.5, torch.tensor(True)):
            with pytest.raises((IndexError, RuntimeError)):
                sdpa(q2, k, v, attn_mask=bad, is_causal=bad.ndim == 0)
        sdpa(q2, k, v, dropout_p=torch.tensor(0.0))  # zero, but not a Python number
    assert router.routed == 0 and router.passed == 9
    assert on_meta.device.type == "meta"
    text = " | ".join(router.reasons)
    for part in ("mask requires grad", "takes (B, H, T, d)", "device meta"):
        assert part in text, (part, router.reasons)
    for part in ("q has 2 heads but k and v have 1", "attn_mask dtype torch.float16"):
        assert part in text, (part, router.reasons)
    for part in ("attn_mask of rank 1", "with is_causal=True", "dropout_p of type Tensor"):
        assert part in text, (part, router.reasons)


def test_dropout_is_routed_to_flashtiles_dropout():
    """dropout_p > 0 runs flashtile's dropout: reproducible from torch's seed,
    the same draw as flashtile.torch.attention, gradients included."""
    q, k, v = _qkv(1, 2, 2, 9, 9, 8)
    results = []
    for routed in (True, False):
        torch.manual_seed(4)
        with ftt.route_sdpa(strict=True) as router:
            call = F.scaled_dot_product_attention if routed else ftt.attention  # looked up inside
            out = call(q, k, v, dropout_p=0.3)
        assert router.routed == routed
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_original_is_restored_on_exceptions_and_strict_mode_raises():
    q, k, v = _qkv(1, 2, 2, 5, 5, 8)
    with pytest.raises(RuntimeError, match=r"not routed: attn_mask"), ftt.route_sdpa(strict=True):
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, dtype=torch.bool))
    assert F.scaled_dot_product_attention is SDPA
    with pytest.raises(KeyError), ftt.route_sdpa():
        raise KeyError("boom")
    assert F.scaled_dot_product_attention is SDPA


def test_a_learned_bias_is_routed_when_no_gradient_is_computed():
    q, k, v = _qkv(1, 2, 2, 5, 5, 8)
    bias = torch.zeros(5, 5, requires_grad=True)
    with torch.no_grad(), ftt.route_sdpa() as router:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert router.routed == 1 and router.passed == 0
    with torch.no_grad():
        torch.testing.assert_close(out, SDPA(q, k, v, attn_mask=bias))


def test_nested_routers_must_exit_in_reverse_order():
    outer, inner = ftt.route_sdpa(), ftt.route_sdpa()
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert F.scaled_dot_product_attention is SDPA


def test_fully_masked_row_matches_sdpa_zero_row():
    q, k, v = _qkv(1, 2, 2, 5, 7, 8)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2] = False
    with ftt.route_sdpa(strict=True):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out[:, :, 2] == 0).all() and not out.isnan().any()
    ref = SDPA(q, k, v, attn_mask=mask)
    # torch >= 2.5 also gives zeros on CPU; older versions gave NaN for such rows.
    assert (ref[:, :, 2] == 0).all() or ref[:, :, 2].isnan().all()
    torch.testing.assert_close(out[:, :, [0, 1, 3, 4]], ref[:, :, [0, 1, 3, 4]])


def test_multihead_attention_module_is_routed():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).train()  # no fast path
    x = torch.randn(2, 9, 16)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(9)
    expected = mha(x, x, x, attn_mask=causal, need_weights=False)[0]
    with ftt.route_sdpa(strict=True) as router:
        got = mha(x, x, x, attn_mask=causal, need_weights=False)[0]
    assert router.routed == 1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_routing_inside_torch_compile_fullgraph():
    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).cos()

    q, k, v = _qkv(1, 4, 2, 7, 7, 8)
    expected = _fwd_bwd(Attend(), q, k, v)
    torch._dynamo.reset()
    with ftt.route_sdpa(strict=True) as router:
        got = _fwd_bwd(torch.compile(Attend(), fullgraph=True, backend="aot_eager"), q, k, v)
    assert router.routed == 1  # counted once, while tracing
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()  # the graph was traced with the router installed


def _tensors(*shapes, dtype=torch.float32, device="cpu"):
    return tuple(torch.randn(s, dtype=dtype, device=device) for s in shapes)


Q, KV, MASK = (1, 2, 5, 8), (1, 2, 7, 8), (5, 7)

# (label, q k v, flashtile.torch.attention keywords): calls the operator refuses.
# The router gets the same call in SDPA's words (mask -> attn_mask).
REFUSED = [
    ("not a tensor", (Q, KV, KV), {}, lambda q, k, v: (q.numpy(), k, v)),
    ("on meta", (Q, KV, KV), {}, lambda q, k, v: (q.to("meta"), k.to("meta"), v.to("meta"))),
    ("mask on meta", (Q, KV, KV), {"mask": torch.ones(MASK, device="meta")}, None),
    ("mixed dtypes", (Q, KV, KV), {}, lambda q, k, v: (q, k.double(), v)),
    ("integer dtype", (Q, KV, KV), {}, lambda q, k, v: (q.int(), k.int(), v.int())),
    ("rank 5", ((1, *Q), (1, *KV), (1, *KV)), {}, None),
    ("rank 2", (Q[2:], KV[2:], KV[2:]), {}, None),
    ("no heads", ((1, 0, 5, 8), (1, 0, 7, 8), (1, 0, 7, 8)), {}, None),
    ("k and v heads differ", (Q, KV, (1, 1, 7, 8)), {}, None),
    ("GQA without enable_gqa", ((1, 4, 5, 8), KV, KV), {}, None),
    ("one kv head without enable_gqa", (Q, (1, 1, 7, 8), (1, 1, 7, 8)), {}, None),
    ("heads not divisible", ((1, 3, 5, 8), KV, KV), {"enable_gqa": True}, None),
    ("enable_gqa not a bool", ((1, 4, 5, 8), KV, KV), {"enable_gqa": 1}, None),
    ("batch dims differ", ((2, 2, 5, 8), KV, KV), {}, None),
    ("no keys", (Q, (1, 2, 0, 8), (1, 2, 0, 8)), {}, None),
    ("head dims differ", (Q, (1, 2, 7, 4), KV), {}, None),
    ("value rows differ", (Q, KV, (1, 2, 6, 8)), {}, None),
    ("non-finite scale", (Q, KV, KV), {"scale": float("inf")}, None),
    ("scale a tensor", (Q, KV, KV), {"scale": torch.tensor(0.5)}, None),
    ("learned bias", (Q, KV, KV), {"mask": torch.zeros(MASK, requires_grad=True)}, None),
    ("mask does not broadcast", (Q, KV, KV), {"mask": torch.ones(3, *MASK).bool()}, None),
    ("mask enlarges the batch", (Q, KV, KV), {"mask": torch.ones(4, 2, *MASK).bool()}, None),
]


def _outcome(fn, *args, **kw):
    """``fn``'s output, or the type of what it raised."""
    try:
        return fn(*args, **kw)
    except Exception as exc:
        return type(exc)


@pytest.mark.parametrize(("label", "shapes", "kw", "edit"), REFUSED, ids=[c[0] for c in REFUSED])
def test_the_router_passes_what_the_operator_refuses_with_its_message(label, shapes, kw, edit):
    q, k, v = _tensors(*shapes)
    if edit is not None:
        q, k, v = edit(q, k, v)
    with pytest.raises((ValueError, TypeError)) as refused:
        ftt.attention(q, k, v, **kw)
    sdpa_kw = {"attn_mask" if key == "mask" else key: val for key, val in kw.items()}
    with ftt.route_sdpa() as router:
        got = _outcome(F.scaled_dot_product_attention, q, k, v, **sdpa_kw)
    assert (router.routed, router.passed) == (0, 1)
    assert router.reasons == {str(refused.value): 1}
    expected = _outcome(SDPA, q, k, v, **sdpa_kw)  # passed untouched: SDPA's own result
    if not isinstance(expected, torch.Tensor):
        assert got is expected
    elif all(t.device.type == "cpu" for t in (q, k, v, *kw.values()) if torch.is_tensor(t)):
        torch.testing.assert_close(got, expected, equal_nan=True)
    else:  # SDPA computes nothing comparable from meta tensors
        assert (got.shape, got.device) == (expected.shape, expected.device)


def test_attn_mask_with_is_causal_is_left_to_sdpa():
    # SDPA raises on its math path (3-D inputs here) and combines the two on its
    # CPU flash path (4-D): the router must do whichever SDPA does.
    q, k, v = _qkv(1, 2, 2, 5, 7, 8)
    keep = torch.rand(5, 7) > 0.3
    with ftt.route_sdpa() as router:
        with pytest.raises(RuntimeError, match="is_causal"):
            F.scaled_dot_product_attention(q[0], k[0], v[0], attn_mask=keep, is_causal=True)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=True)
    assert (router.routed, router.passed) == (0, 2)
    assert list(router.reasons) == [
        "attn_mask with is_causal=True (SDPA's own handling: some of its paths raise)"
    ]
    torch.testing.assert_close(got, SDPA(q, k, v, attn_mask=keep, is_causal=True))


def test_causal_bias_masks_keep_their_meaning():
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v = _qkv(1, 2, 2, 8, 12, 16)
    for make in (causal_upper_left, causal_lower_right):
        expected = _fwd_bwd(SDPA, q, k, v, attn_mask=make(8, 12))
        with ftt.route_sdpa(strict=True) as router:
            got = _fwd_bwd(F.scaled_dot_product_attention, q, k, v, attn_mask=make(8, 12))
            with pytest.raises(ValueError, match="causal=True"):  # SDPA's own error
                F.scaled_dot_product_attention(q, k, v, attn_mask=make(8, 12), is_causal=True)
        assert router.routed == 1  # the plain call the bias makes
        for a, e in zip(got, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="CausalBias"):  # the operator reads mask values
        ftt.attention(q, k, v, mask=causal_lower_right(8, 12))

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, bias):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    torch._dynamo.reset()
    with torch.no_grad(), ftt.route_sdpa(strict=True) as router:
        compiled = torch.compile(Attend(), fullgraph=True, backend="aot_eager")
        got = compiled(q, k, v, causal_lower_right(8, 12))
    assert router.routed == 1
    with torch.no_grad():
        torch.testing.assert_close(got, SDPA(q, k, v, attn_mask=causal_lower_right(8, 12)))
    torch._dynamo.reset()


def test_torch_jit_script_works_inside_the_router():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2).eval()
    x = torch.randn(5, 1, 8)
    with ftt.route_sdpa() as router:
        scripted = torch.jit.script(mha)  # compiles F.scaled_dot_product_attention's call
        got = scripted(x, x, x, need_weights=False)[0]
    assert router.routed == router.passed == 0  # scripted code calls SDPA itself
    torch.testing.assert_close(got, mha(x, x, x, need_weights=False)[0])
