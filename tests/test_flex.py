"""flashtile.torch.flex: FlexAttention's API compiled into the CPU kernels.

Every mod of the catalogue, forward and gradients (also of captured tables),
against an independent dense float64 computation in eager torch (the mod
applied to the whole score matrix through broadcast index tensors), by the
accuracy rule: at most 2x the error of the same dense computation in
float32, plus a small floor. Block masks against the dense mask they
summarise; captured gradients against finite differences.
"""

from __future__ import annotations

import math

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

B, HQ, HKV, T, D = 2, 4, 2, 77, 16


def _indices(b, h, tq, tk):
    return (
        torch.arange(b).view(-1, 1, 1, 1),
        torch.arange(h).view(1, -1, 1, 1),
        torch.arange(tq).view(1, 1, -1, 1),
        torch.arange(tk).view(1, 1, 1, -1),
    )


def dense_flex(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """``(out, lse)`` with every score materialised: the oracle."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    idx = _indices(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx).expand(s.shape), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see no key: zeros
    return p.to(v.dtype) @ v, lse


def _inputs(seed=0, tq=T, tk=T, dtype=torch.float32, grad=True):
    g = torch.Generator().manual_seed(seed)

    def make(h, t):
        return torch.randn(B, h, t, D, generator=g, dtype=dtype).requires_grad_(grad)

    return make(HQ, tq), make(HKV, tk), make(HKV, tk)


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def _check(got, base, ref, what, floor=1e-6, scale=0.0):
    """The accuracy rule: within 2x the float32 dense error, plus a floor
    relative to ``ref`` (or to ``scale``, the size of the quantity that
    produced it, where ``ref`` is all zeros: a gradient that vanishes
    exactly in float64 comes out as rounding noise)."""
    got, base, ref = (t.detach().double() for t in (got, base, ref))
    err, base_err = float((got - ref).norm()), float((base - ref).norm())
    size = max(float(ref.norm()), scale)
    assert err <= 2 * base_err + floor * size, f"{what}: {err:.3g} vs float32 dense {base_err:.3g}"


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


# --- errors --------------------------------------------------------------------


def test_unsupported_operations_are_named():
    q, k, v = _inputs(grad=False)

    def sorts(score, b, h, q_idx, kv_idx):
        return score + torch.cumsum(SLOPES, 0)[h]

    with pytest.raises(TypeError, match="cumsum"):
        flex_attention(q, k, v, score_mod=sorts, enable_gqa=True)

    def branches(score, b, h, q_idx, kv_idx):
        return score if q_idx > kv_idx else -score

    with pytest.raises(TypeError, match=r"torch\.where"):
        flex_attention(q, k, v, score_mod=branches, enable_gqa=True)


def test_wrong_results_and_inputs_are_refused():
    q, k, v = _inputs(grad=False)
    with pytest.raises(TypeError, match="bool"):
        create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) * 1.0, None, None, T, T)
    with pytest.raises(TypeError, match="float score"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: qi - kv, enable_gqa=True)
    with pytest.raises(TypeError, match="whole captured tensor"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + BIAS[h], enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(q, k, v)
    mask = create_block_mask(causal, None, None, 60, 60)
    with pytest.raises(ValueError, match="Q_LEN, KV_LEN"):
        flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    short = torch.zeros(10)
    with pytest.raises(IndexError, match="q_idx"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + short[qi], enable_gqa=True)
    with pytest.raises(IndexError, match="out of its range"):
        flex_attention(
            q, k, v, score_mod=lambda s, b, h, qi, kv: s + short[qi - kv], enable_gqa=True
        )


def test_mods_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    q, k, v = _inputs(grad=False)
    flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s * 0.75 + 0.125, enable_gqa=True)
    sources = list((tmp_path / "mods").glob("mods_*.py"))
    assert len(sources) == 1 and "0.125" in sources[0].read_text()


# --- the NumPy API ----------------------------------------------------------------


def test_numpy_mods_forward():
    import flashtile

    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, HQ, 40, D)).astype(np.float32)
    k = rng.standard_normal((B, HKV, 300, D)).astype(np.float32)
    slopes = np.array([0.3, 0.2, 0.1, 0.05])

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * abs(q_idx - kv_idx) + 0.25 * math.tanh(score)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx + b) % 7 != 0 and kv_idx <= q_idx + 260

    out = flashtile.attention(q, k, k, score_mod=score_mod, mask_mod=mask_mod)
    qt, kt = torch.from_numpy(q), torch.from_numpy(k)

    def torch_score(s, b, h, qi, kv):
        return s - torch.from_numpy(slopes)[h] * (qi - kv).abs() + 0.25 * torch.tanh(s)

    def torch_mask(b, h, qi, kv):
        return ((kv + b) % 7 != 0) & (kv <= qi + 260)

    ref, _ = dense_flex(qt.double(), kt.double(), kt.double(), torch_score, torch_mask)
    base, _ = dense_flex(qt, kt, kt, torch_score, torch_mask)
    _check(torch.from_numpy(out), base, ref, "numpy mods")
    one = flashtile.attention(
        q[:, :, :1], k, k, score_mod=score_mod
    )  # decode-shaped: forward kernel
    ref1, _ = dense_flex(qt[:, :, :1].double(), kt.double(), kt.double(), torch_score)
    assert rel(torch.from_numpy(one).double(), ref1) < 1e-5
    with pytest.raises(ValueError, match="no derivative"):
        flashtile.attention_backward(q, k, k, out, out[..., 0], out, score_mod=score_mod)
    with pytest.raises(ValueError, match="softcap"):
        flashtile.attention(q, k, k, score_mod=score_mod, softcap=5.0)
    with pytest.raises(ValueError, match="one mask_mod"):
        flashtile.attention(q, k, k, mask_mod=mask_mod, mask=np.ones((40, 300), bool))


def test_a_replaced_captured_tensor_is_seen():
    q = torch.randn(1, 2, 10, 8)
    bias = torch.zeros(2, 19)

    def mod(s, b, h, q_idx, kv_idx):
        return s + bias[h, q_idx - kv_idx + 9]

    first = flex_attention(q, q, q, score_mod=mod)
    bias = torch.arange(38.0).reshape(2, 19) * 0.1  # the closure now holds another tensor
    second = flex_attention(q, q, q, score_mod=mod)
    ref, _ = dense_flex(q.double(), q.double(), q.double(), mod)
    assert rel(second.double(), ref) < 1e-5 and not torch.allclose(first, second)
    bias.requires_grad_()  # a gradient asked for later is given
    qq = q.clone().requires_grad_()
    flex_attention(qq, qq, qq, score_mod=mod).sum().backward()
    assert bias.grad is not None and bool(bias.grad.abs().sum() > 0)


TRANSLATED = {
    "bool times float": lambda s, b, h, qi, kv: s + (qi > kv) * 1.5,
    "bool as float": lambda s, b, h, qi, kv: s + (qi > kv).float(),
    "floor division": lambda s, b, h, qi, kv: s + ((qi - kv) // 3) * 0.1,
    "trunc division": lambda s, b, h, qi, kv: s + torch.div(qi - kv, 3, rounding_mode="trunc"),
    "fmod": lambda s, b, h, qi, kv: s + torch.fmod(qi - kv, 5) * 0.1,
    "maximum": lambda s, b, h, qi, kv: torch.maximum(s, torch.zeros_like(s)),
    "clamp": lambda s, b, h, qi, kv: s.clamp(-0.5, 0.5),
    "round decimals": lambda s, b, h, qi, kv: torch.round(s, decimals=1),
}


@pytest.mark.parametrize("name", list(TRANSLATED))
def test_translated_operations(name):
    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(5)) for _ in "qkv")
    out = flex_attention(q, k, v, score_mod=TRANSLATED[name])
    ref, _ = dense_flex(q.double(), k.double(), v.double(), TRANSLATED[name])
    assert rel(out.double(), ref) < 1e-5


def test_scalar_tables_scalars_and_per_head_blocks():
    q = torch.randn(1, 2, 40, 8, requires_grad=True)
    temp = torch.tensor(2.0, requires_grad=True)  # a 0-d table: a learned temperature
    flex_attention(q, q, q, score_mod=lambda s, b, h, qi, kv: s / temp).sum().backward()
    ref = dense_flex(*(q.double(),) * 3, lambda s, b, h, qi, kv: s / temp.double())[0]
    (want,) = torch.autograd.grad(ref.sum(), temp)
    assert torch.allclose(temp.grad.double(), want.double(), rtol=1e-4)
    width = 4

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width

    narrow = block_states(create_block_mask(window, None, None, 40, 40, BLOCK_SIZE=8))
    width = 10  # a Python value the mod reads: traced again
    assert not np.array_equal(
        narrow, block_states(create_block_mask(window, None, None, 40, 40, BLOCK_SIZE=8))
    )
    # A hand-built map whose heads keep different blocks, GQA (both heads on one kv head)
    from torch.nn.attention.flex_attention import BlockMask

    num = torch.tensor([[[1], [2]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1]], [[0, 1]]]], dtype=torch.int32)
    blocks = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(16, 16), seq_lengths=(16, 32))
    q2, k2 = torch.randn(1, 2, 16, 8), torch.randn(1, 1, 32, 8)
    got = flex_attention(q2, k2, k2, block_mask=blocks, enable_gqa=True)
    ref, _ = dense_flex(q2.double(), k2.double(), k2.double(), None,
                        lambda b, h, qi, kv: (kv < 16) | (h == 1))  # fmt: skip
    assert rel(got.double(), ref) < 1e-5
    # Full blocks keep every key, whatever mask_mod says (FlexAttention's rule)
    none = torch.zeros(1, 2, 1, dtype=torch.int32)
    full = BlockMask.from_kv_blocks(
        none, idx, num, idx, BLOCK_SIZE=(16, 16), seq_lengths=(16, 32),
        mask_mod=lambda b, h, qi, kv: qi < 0,
    )  # fmt: skip
    got = flex_attention(q2, k2, k2, block_mask=full, enable_gqa=True)
    assert rel(got.double(), ref) < 1e-5


def test_traced_mods_are_freed_and_threads_share_them():
    import gc
    import threading
    import weakref

    q = torch.randn(1, 2, 24, 8)

    def make(c):
        return lambda s, b, h, qi, kv: s * c + 0.25

    mod = make(0.5)
    flex_attention(q, q, q, score_mod=mod)
    ref = weakref.ref(mod)
    del mod
    gc.collect()
    assert ref() is None
    shared, errors = make(0.75), []

    def run():
        try:
            flex_attention(q, q, q, score_mod=shared)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_numpy_mods_see_new_values_and_report_bad_indices():
    import flashtile

    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 30, 8))
    table = {"bias": rng.standard_normal(30)}

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + bias[kv_idx]

    bias = table["bias"]
    first = flashtile.attention(q, q, q, score_mod=score_mod)
    bias = 5 * table["bias"]
    second = flashtile.attention(q, q, q, score_mod=score_mod)
    assert not np.allclose(first, second)
    bias = bias[:10]
    with pytest.raises(IndexError, match="out of its range"):
        flashtile.attention(q, q, q, score_mod=score_mod)
    with pytest.raises(ValueError, match="varlen_attention"):
        cu = np.array([0, 30])
        flashtile.varlen_attention(q, q, q, cu, cu, score_mod=score_mod)


def test_second_review_cases():
    q = torch.randn(1, 1, 6, 4, dtype=torch.float64)
    for mod in (
        lambda s, b, h, qi, kv: torch.floor(torch.where(kv > qi, -math.inf, s * 1e30)),
        lambda s, b, h, qi, kv: s + torch.where(qi == kv, 0.0, (qi - kv).double() ** -2),
    ):
        ref, _ = dense_flex(q, q, q, mod)
        assert rel(flex_attention(q, q, q, score_mod=mod), ref) < 1e-12

    def with_default(s, b, h, qi, kv, c=2.0):
        return s * c

    ref, _ = dense_flex(q, q, q, with_default)
    assert rel(flex_attention(q, q, q, score_mod=with_default), ref) < 1e-12
    scale = [2.0]  # read through a nested lambda: a change is seen
    factor = scale[0]

    def nested(s, b, h, qi, kv):
        return (lambda x: x * factor)(s)

    flex_attention(q, q, q, score_mod=nested)
    factor = 5.0
    ref, _ = dense_flex(q, q, q, nested)
    assert rel(flex_attention(q, q, q, score_mod=nested), ref) < 1e-12
