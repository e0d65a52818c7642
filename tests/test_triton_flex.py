"""FlexAttention's mods in the Triton kernels (flashtile.triton.flex).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tiny
shapes); the same mods, forward and gradients (also of captured tables),
against the dense float64 oracle of the CPU tests (tests/flex_oracle.py) by
its accuracy rule. Lengths no tile divides, Tq != Tk, GQA, a block mask's
lists (per head, broadcast), the band walk without one.
"""

from __future__ import annotations

import pytest

# First: sets the device, skips this module without torch or triton.
from triton_device import DEVICE, torch

# isort: split
from flashtile.torch.flex import create_block_mask
from flashtile.triton.flex import flex_attention
from flex_oracle import _check, dense_flex, rel

B, HQ, HKV, D = 1, 4, 2, 16
T = 50
BIAS = torch.randn(HQ, 2 * T - 1, generator=torch.Generator().manual_seed(11))
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
DOCS = torch.tensor([0] * 17 + [1] * 21 + [2] * 12)


def _tables(device):
    """The captured tensors on ``device`` (the float ones take gradients)."""
    return {
        "bias": BIAS.to(device).requires_grad_(),
        "slopes": SLOPES.to(device).requires_grad_(),
        "docs": DOCS.to(device),
    }


def _mods(t):
    """The catalogue's mods, reading the tables ``t`` (the kernels' on the
    test device, the oracle's on the CPU)."""

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document(b, h, q_idx, kv_idx):
        return (t["docs"][q_idx] == t["docs"][kv_idx]) & (q_idx >= kv_idx)

    def dilated_prefix(b, h, q_idx, kv_idx):
        return (kv_idx < 9) | ((q_idx >= kv_idx) & ((q_idx - kv_idx) % 3 == 0))

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + t["bias"][h, q_idx - kv_idx + T - 1]

    def alibi(score, b, h, q_idx, kv_idx):
        return score - t["slopes"][h] * (q_idx - kv_idx).abs()

    def softcap(score, b, h, q_idx, kv_idx):
        return 3.0 * torch.tanh(score / 3.0)

    return {f.__name__: f for f in (causal, document, dilated_prefix, rel_bias, alibi, softcap)}


CASES = [  # (name, score_mod, mask_mod, Tq, tables that take a gradient)
    ("relative bias, causal", "rel_bias", "causal", T, ["bias"]),
    ("ALiBi, documents", "alibi", "document", T, ["slopes"]),
    ("softcap, no block mask", "softcap", None, 45, []),
    ("dilated prefix, Tq < Tk", None, "dilated_prefix", 33, []),
]


def _qkv(tq, tk=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, h, t, D, generator=g).to(DEVICE).requires_grad_()
        for h, t in ((HQ, tq), (HKV, tk), (HKV, tk))
    )


@pytest.mark.parametrize(("name", "score_mod", "mask_mod", "tq", "tables"), CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_mods_forward_and_gradients(name, score_mod, mask_mod, tq, tables):
    mine, theirs = _tables(DEVICE), _tables("cpu")
    mods, oracle = _mods(mine), _mods(theirs)
    q, k, v = _qkv(tq)
    block = None
    if mask_mod is not None:
        block = create_block_mask(mods[mask_mod], None, None, tq, T, device=DEVICE, BLOCK_SIZE=32)
    out, lse = flex_attention(
        q, k, v, score_mod=mods.get(score_mod), block_mask=block, enable_gqa=True, return_lse=True
    )
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    score_ref, mask_ref = oracle.get(score_mod), oracle.get(mask_mod)
    ref, ref_lse = dense_flex(*(t.double() for t in cpu), score_ref, mask_ref)
    base, base_lse = dense_flex(*cpu, score_ref, mask_ref)
    _check(out.cpu(), base, ref, f"{name} out")
    finite = torch.isfinite(ref_lse)
    _check(lse.cpu()[finite], base_lse[finite], ref_lse[finite], f"{name} lse")
    assert torch.equal(torch.isneginf(lse.cpu()), ~finite)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    wrt = [theirs[n] for n in tables]
    got = torch.autograd.grad(out, (q, k, v, *(mine[n] for n in tables)), dout.to(DEVICE))
    want = torch.autograd.grad(ref, (*cpu, *wrt), dout.double(), allow_unused=True)
    plain = torch.autograd.grad(base, (*cpu, *wrt), dout, allow_unused=True)
    for g, w, p, what in zip(got, want, plain, ("dq", "dk", "dv", "dtable"), strict=False):
        _check(g.cpu(), p, w, f"{name} {what}", scale=float(dout.norm()))


def test_translated_operations_on_tiles():
    """The Triton dialect's spelling of torch's semantics (integer division
    and remainder toward minus infinity, C's fmod, round half to even, float
    powers of negative bases), one mod whose every term moves the scores."""
    terms = [
        lambda s, qi, kv: ((qi - kv) // 3) * 0.1,
        lambda s, qi, kv: torch.remainder(qi - kv, 5) * 0.1,
        lambda s, qi, kv: torch.fmod(qi - kv, 5) * 0.1,
        lambda s, qi, kv: torch.div(qi - kv, 4, rounding_mode="trunc") * 0.1,
        lambda s, qi, kv: torch.round(s * 2.0) - s * 2.0,
        lambda s, qi, kv: torch.sign(s) * torch.sigmoid(s) + torch.log1p(s.abs()),
        lambda s, qi, kv: torch.clamp(s, -0.5, 0.5) + torch.where(qi > kv, 1.0, -1.0),
        lambda s, qi, kv: (s - 0.3) ** 3 * 0.1 + (s.abs() + 0.5) ** 0.5,
        lambda s, qi, kv: torch.floor(s) + torch.ceil(s) + torch.exp(-s.abs()),
        # floats: from the exact remainder, not a rounded quotient (1.0 // 0.1 is 9)
        lambda s, qi, kv: torch.floor_divide(s, 0.1) * 0.01 + torch.remainder(s, 0.1),
        lambda s, qi, kv: torch.fmod(s, 0.3) + torch.fmod(s, float("inf")) * 0.1,
        lambda s, qi, kv: torch.round(s * 1e7) * 1e-7 + torch.expm1(s * 1e-3) * 1e3,
        lambda s, qi, kv: (
            torch.log1p(s.abs() * 1e-4) * 1e4 + torch.maximum(s, s.sqrt()).nan_to_num()
        ),
    ]

    def every(s, b, h, qi, kv):
        return s + sum(0.3 * term(s, qi, kv) for term in terms)

    q, k, v = _qkv(37, 37, seed=4)
    out = flex_attention(q, k, v, score_mod=every, enable_gqa=True)
    ref, _ = dense_flex(*(t.detach().cpu().double() for t in (q, k, v)), every)
    assert rel(out.cpu().double(), ref) < 1e-5


def test_score_mods_that_hide_whole_tiles_or_vary_along_one_axis():
    """Without a block mask every key tile runs the score mod, unmasked ones
    too: one it hides entirely (-inf) must not make NaN, and a result that
    does not vary along the keys still fills the tile."""
    q, k, v = _qkv(40, 64, seed=6)
    cpu = [t.detach().cpu() for t in (q, k, v)]
    hide_first_tile = lambda s, b, h, qi, kv: torch.where(kv < 32, -float("inf"), s)  # noqa: E731
    hide_rows = lambda s, b, h, qi, kv: torch.where(qi < 5, -float("inf"), s)  # noqa: E731
    per_row = lambda s, b, h, qi, kv: s * 0 + qi * 0.01  # noqa: E731
    for mod in (hide_first_tile, hide_rows, per_row):
        out, lse = flex_attention(q, k, v, score_mod=mod, enable_gqa=True, return_lse=True)
        ref, ref_lse = dense_flex(*(t.double() for t in cpu), mod)
        _check(out.cpu(), dense_flex(*cpu, mod)[0], ref, "out")
        assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(bool(torch.isfinite(g).all()) for g in grads)


def test_tuning_launches_do_not_add_into_captured_gradients(monkeypatch):
    """On a GPU the first call of a shape class times every candidate by
    launching it; the dq kernel's atomic adds into the captured tables'
    gradients must count once."""
    import flashtile.triton.launch as launch

    def timing_pick(kernel, element_bytes, block_d, key, run, fits=None):
        config = real_pick(kernel, element_bytes, block_d, key, run, fits)
        if kernel == "attn_bwd_dq":  # the kernel that adds atomically
            for _ in range(2):  # the tuner's timing launches
                run(config)
        return config

    real_pick = launch.pick
    monkeypatch.setattr(launch, "pick", timing_pick)
    mine, theirs = _tables(DEVICE), _tables("cpu")
    q, k, v = _qkv(T, seed=7)
    out = flex_attention(q, k, v, score_mod=_mods(mine)["rel_bias"], enable_gqa=True)
    (got,) = torch.autograd.grad(out.sum(), mine["bias"])
    cpu = [t.detach().cpu().double() for t in (q, k, v)]
    (want,) = torch.autograd.grad(dense_flex(*cpu, _mods(theirs)["rel_bias"])[0].sum(),
                                  theirs["bias"])  # fmt: skip
    assert rel(got.cpu().double(), want.double()) < 1e-5


def test_per_head_block_masks_from_pytorch_and_broadcast():
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    def by_head(b, h, q_idx, kv_idx):  # each head its own pattern: lists differ per head
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) < 20 + 15 * h)

    q, k, v = _qkv(T, seed=5)
    block = torch_block_mask(by_head, None, HQ, T, T, device="cpu", BLOCK_SIZE=64)
    out = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
    cpu = [t.detach().cpu() for t in (q, k, v)]
    ref, _ = dense_flex(*(t.double() for t in cpu), None, by_head)
    _check(out.cpu(), dense_flex(*cpu, None, by_head)[0], ref, "per-head block mask")


def test_blocks_smaller_than_the_tiles_shrink_the_tiles():
    # 16-row blocks hold no whole tile of any kernel's configuration (the
    # interpreter's are 16 x 32 and 32 x 16, a GPU's larger): the launch
    # halves its tiles until they fit, forward and backward.
    causal = _mods({})["causal"]
    q, k, v = _qkv(T, seed=3)
    block = create_block_mask(causal, None, None, T, T, device=DEVICE, BLOCK_SIZE=16)
    out = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    wide = [t.detach().double().requires_grad_() for t in cpu]
    (ref, _), (base, _) = dense_flex(*wide, None, causal), dense_flex(*cpu, None, causal)
    _check(out.cpu(), base, ref, "16-row blocks")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad(out, (q, k, v), dout.to(DEVICE))
    base_grads = torch.autograd.grad(base, cpu, dout)
    ref_grads = torch.autograd.grad(ref, wide, dout.double())
    for name, *g in zip("qkv", grads, base_grads, ref_grads, strict=True):
        _check(g[0].cpu(), g[1], g[2], f"16-row blocks d{name}")


def test_errors_name_the_problem():
    q, k, v = _qkv(T)
    small = create_block_mask(_mods({})["causal"], None, None, T, T, BLOCK_SIZE=8)
    with pytest.raises(ValueError, match="BLOCK_SIZE a multiple of"):
        flex_attention(q, k, v, block_mask=small, enable_gqa=True)
    short = torch.zeros(HQ, 10, device=DEVICE)

    def past_the_end(score, b, h, q_idx, kv_idx):
        return score + short[h, q_idx]

    with pytest.raises(IndexError, match="out of its range"):
        flex_attention(q, k, v, score_mod=past_the_end, enable_gqa=True)
    with pytest.raises(TypeError, match="integer to an integer power"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + (qi - kv) ** 2,
                       enable_gqa=True)  # fmt: skip
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(q, k, v)
    elsewhere = torch.zeros(HQ, device="meta")
    with pytest.raises(ValueError, match="move the tensor"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + elsewhere[h],
                       enable_gqa=True)  # fmt: skip
