"""flashtile.torch.flex: FlexAttention's API compiled into the CPU kernels.

Every mod of the catalogue, forward and gradients (also of captured tables),
against an independent dense float64 computation in eager torch (the mod
applied to the whole score matrix through broadcast index tensors), by the
accuracy rule: at most 2x the error of the same dense computation in
float32, plus a small floor. Block masks against the dense mask they
summarise; captured gradients against finite differences.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask  # noqa: E402

from flashtile.masks import tile_states  # noqa: E402
from flashtile.torch.flex import (  # noqa: E402
    and_masks,
    block_states,
    create_block_mask,
    flex_attention,
    noop_mask,
    or_masks,
)
from flex_oracle import HQ, T, _check, _indices, _inputs, dense_flex, rel  # noqa: E402

# --- the catalogue -----------------------------------------------------------

BIAS = torch.randn(HQ, 2 * T - 1, generator=torch.Generator().manual_seed(7)).requires_grad_()
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625]).requires_grad_()
DOCS = torch.tensor([0] * 20 + [1] * 31 + [2] * 26)  # packed sequences of 20, 31, 26


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 16)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 10) | (q_idx >= kv_idx)


def document(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def dilated(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 3 == 0)


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def softcap(score, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(score / 3.0)


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, q_idx - kv_idx + T - 1]


CATALOGUE = [
    ("causal", None, causal),
    ("sliding window", None, sliding_window),
    ("prefix LM", None, prefix_lm),
    ("document", None, document),
    ("dilated", None, dilated),
    ("ALiBi", alibi, causal),
    ("softcap", softcap, None),
    ("relative bias", rel_bias, causal),
]


@pytest.mark.parametrize(
    ("name", "score_mod", "mask_mod"), CATALOGUE, ids=[c[0] for c in CATALOGUE]
)
def test_catalogue_forward_and_gradients(name, score_mod, mask_mod):
    q, k, v = _inputs()
    block = (
        None if mask_mod is None else create_block_mask(mask_mod, None, None, T, T, BLOCK_SIZE=16)
    )
    out, lse = flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block, enable_gqa=True, return_lse=True
    )
    tables = {rel_bias: [BIAS], alibi: [SLOPES]}.get(score_mod, [])
    ref, ref_lse = dense_flex(*(t.double() for t in (q, k, v)), score_mod, mask_mod)
    base, _ = dense_flex(q, k, v, score_mod, mask_mod)
    _check(out, base, ref, f"{name} out")
    finite = torch.isfinite(ref_lse)
    _check(lse[finite], _[finite], ref_lse[finite], f"{name} lse")
    assert torch.equal(torch.isneginf(lse), ~finite)
    dout = torch.randn_like(out)
    wrt = (q, k, v, *tables)
    got = torch.autograd.grad(out, wrt, dout)
    want = torch.autograd.grad(ref, wrt, dout.double(), allow_unused=True)
    plain = torch.autograd.grad(base, wrt, dout, allow_unused=True)
    for g, w, p, what in zip(got, want, plain, ("dq", "dk", "dv", "dtable"), strict=False):
        _check(g, p, w, f"{name} {what}", scale=float(dout.norm()))


def test_captured_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.randn(2, 17, generator=g, dtype=torch.float64, requires_grad=True)
    scales = torch.rand(2, generator=g, dtype=torch.float64).requires_grad_()

    def mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score * scales[h]) + table[h, q_idx - kv_idx + 8]

    def run(table_, scales_):
        nonlocal table, scales
        table, scales = table_, scales_
        return flex_attention(q, k, v, score_mod=mod)

    saved = table, scales
    assert torch.autograd.gradcheck(run, saved, eps=1e-6, atol=1e-7)


def test_gradients_are_deterministic():
    q, k, v = _inputs(seed=3)
    mask = create_block_mask(causal, None, None, T, T, BLOCK_SIZE=16)
    grads = []
    for _ in range(2):
        out = flex_attention(q, k, v, score_mod=rel_bias, block_mask=mask, enable_gqa=True)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v, BIAS)))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


# --- block masks ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("b", "h", "tq", "tk", "block"),
    [(None, None, 70, 45, 16), (2, 3, 33, 100, (8, 32)), (1, None, 128, 128, 128)],
)
def test_block_mask_matches_the_dense_mask(b, h, tq, tk, block):
    def mask_mod(b_, h_, q_idx, kv_idx):
        return ((q_idx + 2 * h_ + b_) % 5 < 3) & (kv_idx <= q_idx + 20)

    got = create_block_mask(mask_mod, b, h, tq, tk, BLOCK_SIZE=block)
    dense = mask_mod(*_indices(b or 1, h or 1, tq, tk)).expand(b or 1, h or 1, tq, tk)
    bq, bk = (block, block) if isinstance(block, int) else block
    assert np.array_equal(block_states(got), tile_states(dense.numpy(), bq, bk))
    theirs = block_states(torch_block_mask(mask_mod, b, h, tq, tk, device="cpu", BLOCK_SIZE=block))
    ours = block_states(got)
    # PyTorch marks a ragged edge tile partial even when every entry is kept
    assert np.array_equal(
        (ours == theirs) | ((theirs == 1) & (ours == 2)), np.ones_like(ours, bool)
    )


def test_torch_block_mask_is_accepted_and_composes():
    q, k, v = _inputs(grad=False, tq=50, tk=70)
    mask = and_masks(or_masks(prefix_lm, causal), lambda b, h, q_idx, kv_idx: kv_idx != 3)
    theirs = torch_block_mask(mask, None, HQ, 50, 70, device="cpu", BLOCK_SIZE=32)
    out = flex_attention(q, k, v, block_mask=theirs, enable_gqa=True)
    ref, _ = dense_flex(*(t.double() for t in (q, k, v)), None, mask)
    base, _ = dense_flex(q, k, v, None, mask)
    _check(out, base, ref, "torch block mask")
    full = create_block_mask(noop_mask, None, None, 50, 70)
    _check(flex_attention(q, k, v, block_mask=full, enable_gqa=True), *dense_flex(q, k, v)[:1],
           dense_flex(*(t.double() for t in (q, k, v)))[0], "noop")  # fmt: skip


# --- random compositions -----------------------------------------------------------

SCORE_PARTS = [
    lambda s, b, h, qi, kv: s * 0.5,
    lambda s, b, h, qi, kv: s + SLOPES[h] * (kv - qi),
    lambda s, b, h, qi, kv: torch.where(qi > kv, s, s - 1.0),
    lambda s, b, h, qi, kv: 2.0 * torch.tanh(s / 2.0),
    lambda s, b, h, qi, kv: s + torch.sigmoid(BIAS[h, qi - kv + T - 1]),
]
MASK_PARTS = [causal, sliding_window, prefix_lm, document, dilated]


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    scores=st.lists(st.sampled_from(range(len(SCORE_PARTS))), min_size=1, max_size=3),
    masks=st.lists(st.sampled_from(range(len(MASK_PARTS))), max_size=2),
    combine=st.sampled_from([and_masks, or_masks]),
    tq=st.integers(1, T),
)
def test_random_compositions(scores, masks, combine, tq):
    def score_mod(s, b, h, qi, kv):
        for n in scores:
            s = SCORE_PARTS[n](s, b, h, qi, kv)
        return s

    mask_mod = combine(*(MASK_PARTS[n] for n in masks)) if masks else None
    q, k, v = _inputs(seed=tq, tq=tq)
    block = (
        None if mask_mod is None else create_block_mask(mask_mod, None, None, tq, T, BLOCK_SIZE=16)
    )
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block, enable_gqa=True)
    ref, _ = dense_flex(*(t.double() for t in (q, k, v)), score_mod, mask_mod)
    base, _ = dense_flex(q, k, v, score_mod, mask_mod)
    _check(out, base, ref, "composition")
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, BIAS), dout, allow_unused=True)
    want = torch.autograd.grad(ref, (q, k, v, BIAS), dout.double(), allow_unused=True)
    plain = torch.autograd.grad(base, (q, k, v, BIAS), dout, allow_unused=True)
    for g, w, p in zip(got, want, plain, strict=True):
        if w is not None:
            _check(g, p, w, "composition gradient", scale=float(dout.norm()))


def test_sixteen_bit_inputs():
    q, k, v = (t.detach().to(torch.bfloat16) for t in _inputs(seed=4))
    mask = create_block_mask(causal, None, None, T, T, BLOCK_SIZE=16)
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=mask, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    ref, _ = dense_flex(*(t.double() for t in (q, k, v)), alibi, causal)
    base, _ = dense_flex(q, k, v, alibi, causal)
    _check(out, base, ref, "bf16", floor=1e-3)


def test_softcap_mod_gradients_where_tanh_saturates():
    """Scores 7-9 times the cap, float32: torch's derivative of tanh,
    ``1 - t*t``, cancels there (0 once ``t`` rounds to 1, from |x| 9) and
    puts dq 0.25% off, in eager torch's float32 as it did in the translated
    mod; the translated mod takes tanh's own derivative (the softcap flag's:
    tests/test_backward_precision.py), 1e-6 off."""
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(4))
    q[..., 0], k[..., 0] = 3.0, 8.0 + 0.3 * torch.randn(1, 2, 12, generator=g)

    def cap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score)

    def grads(q, k, v, fn):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(fn(q, k, v), (q, k, v), dout.to(q.dtype))

    got = grads(q, k, v, lambda *a: flex_attention(*a, score_mod=cap, scale=1.0 / 3.0))
    ref = grads(q.double(), k.double(), v.double(), lambda *a: dense_flex(*a, cap, None, 1 / 3)[0])
    for got_g, ref_g in zip(got, ref, strict=True):
        assert rel(got_g, ref_g) < 1e-4
