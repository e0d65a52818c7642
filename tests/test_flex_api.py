"""flashtile.torch.flex and the NumPy API's mods: errors, the translator's
operations, what a cached trace or compile re-checks, threads, the disk
cache (the catalogue and gradients are tests/test_flex.py's)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashtile.torch.flex import block_states, create_block_mask, flex_attention  # noqa: E402
from flex_oracle import HKV, HQ, B, D, T, _check, _inputs, dense_flex, rel  # noqa: E402

BIAS = torch.randn(HQ, 2 * T - 1, generator=torch.Generator().manual_seed(7)).requires_grad_()
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625]).requires_grad_()


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


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


def _documents(docs):
    def document(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    return document


def _counting_traces(monkeypatch) -> list:
    from flashtile.torch import flex_trace

    traced, real = [], flex_trace._trace_all
    monkeypatch.setattr(flex_trace, "_trace_all", lambda *a: traced.append(a) or real(*a))
    return traced


def test_a_mod_made_again_finds_its_trace(tmp_path, monkeypatch):
    """A mask_mod made anew for each batch (a closure over its documents), or
    the same mod in another process, is not traced again: the trace is found
    by the mods' code and numbers and their tensors' layouts, and reads the
    new closure's own tensors. Another layout is traced again."""
    from flashtile.torch import trace_cache

    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    q, k, v = _inputs(grad=False)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 4, (T,), generator=g).sort().values for _ in range(3)]
    mask = create_block_mask(_documents(batches[0]), None, None, T, T)
    flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    traced = _counting_traces(monkeypatch)
    for n, docs in enumerate(batches):
        if n == 2:
            trace_cache._MEMORY.clear()  # as a new process: from the disk
        mask = create_block_mask(_documents(docs), None, None, T, T)
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        ref, _ = dense_flex(*(t.double() for t in (q, k, v)), None, _documents(docs))
        _check(out, dense_flex(q, k, v, None, _documents(docs))[0], ref, f"batch {n}")
    assert traced == []
    create_block_mask(_documents(batches[0].int()), None, None, T, T)  # another dtype
    assert len(traced) == 1
    for path in (tmp_path / "traces").glob("*.json"):
        path.write_text("{not json")  # a corrupt entry is traced again, not an error
    trace_cache._MEMORY.clear()
    mask = create_block_mask(_documents(batches[1]), None, None, T, T)
    assert len(traced) == 2 and mask.to_dense().any()


def test_stored_traces_keep_numbers_aliases_and_constants(monkeypatch):
    """What tells two mods apart: their code, the numbers they read,
    whether two places hold the same tensor (one table or two), and the
    constants a mod makes itself (stored with the trace)."""
    from flashtile.torch import trace_cache
    from flashtile.torch.flex_trace import trace_mods

    q, k, v = _inputs(grad=False)

    def make(a, c, w):
        def mod(s, b, h, q_idx, kv_idx):
            return s + a[q_idx] * w - c[kv_idx] + torch.tensor(-0.75)

        return mod

    g = torch.Generator().manual_seed(5)
    t, u = torch.randn(T, generator=g), torch.randn(T, generator=g)

    def half(s, b, h, q_idx, kv_idx):
        return s * 0.5

    def quarter(s, b, h, q_idx, kv_idx):  # (the same but for a constant of its code)
        return s * 0.25

    mods = [make(t, t, 0.5), make(t, u, 0.5), make(u, t, 0.25), make(u, u, 0.25), half, quarter]
    for n, mod in enumerate(mods + mods):
        if n == len(mods):
            trace_cache._MEMORY.clear()
        out = flex_attention(q, k, v, score_mod=mod, enable_gqa=True)
        ref, _ = dense_flex(*(x.double() for x in (q, k, v)), mod)
        _check(out, dense_flex(q, k, v, mod)[0], ref, f"mod {n}")
    # Only a constant of the mod's own code is stored by its values.
    made = {id(tb.tensor): tb.made for tb in trace_mods(mods[1], None).tables}
    assert made.pop(id(t)) is False and made.pop(id(u)) is False and list(made.values()) == [True]


def test_what_a_mod_reads_elsewhere_is_part_of_its_trace():
    """Values a mod reads through keyword-only defaults, its own attributes, a
    class, a helper in the user's module, or a captured tensor's ``.item()``
    change the trace: a second value is seen (review of the trace cache)."""
    import types

    helpers = types.ModuleType("user_helpers")  # a user's module with a helper function
    exec("def scaled(s):\n    return s * SCALE\n", helpers.__dict__)

    class Config:
        scale = 0.0

    def keyword(sc):
        def mod(s, b, h, q_idx, kv_idx, *, scale=sc):
            return s * scale

        return mod

    def attribute(sc):
        def mod(s, b, h, q_idx, kv_idx):
            return s * mod.scale

        mod.scale = sc
        return mod

    def in_class(sc):
        Config.scale = sc
        return lambda s, b, h, q_idx, kv_idx: s * Config.scale

    def in_module(sc):
        helpers.SCALE = sc
        return lambda s, b, h, q_idx, kv_idx: helpers.scaled(s)

    def item(sc):
        w = torch.tensor(sc)
        return lambda s, b, h, q_idx, kv_idx: s * w.item()

    def tolist(sc):  # (a value read that tracing does not see: the tensor is no table)
        w = torch.tensor(sc)
        return lambda s, b, h, q_idx, kv_idx: s * w.tolist()

    q, k, v = (
        torch.randn(1, 2, 24, 8, generator=torch.Generator().manual_seed(n)) for n in (1, 2, 3)
    )
    for make in (keyword, attribute, in_class, in_module, item, tolist):
        for sc in (2.0, 3.0):
            out = flex_attention(q, k, v, score_mod=make(sc))
            ref = torch.softmax((q @ k.transpose(-1, -2)).double() * sc / 8**0.5, -1) @ v.double()
            assert rel(out.double(), ref) < 1e-5, (make.__name__, sc)


def test_masks_combined_by_library_functions_keep_their_numbers():
    """and_masks/or_masks are library closures: the user's masks inside them,
    and the window each captures, are part of the trace (review of the
    trace cache: the second window reused the first's trace)."""
    from flashtile.torch.flex import and_masks, or_masks

    def sliding(w):
        return lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= w

    def sink(b, h, q_idx, kv_idx):
        return kv_idx == 0

    q, k, v = _inputs(grad=False, tq=40, tk=40)
    for w in (4, 8):
        mask = or_masks(and_masks(causal, sliding(w)), sink)
        block = create_block_mask(mask, None, None, 40, 40, BLOCK_SIZE=16)
        out = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
        ref, _ = dense_flex(*(x.double() for x in (q, k, v)), None, mask)
        _check(out, dense_flex(q, k, v, None, mask)[0], ref, f"window {w}")


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
    with pytest.raises(ValueError, match="no derivative") as refused:
        flashtile.attention_backward(q, k, k, out, out[..., 0], out, score_mod=score_mod)
    assert str(refused.value).endswith("call flashtile.torch.flex.flex_attention")  # (it exists)
    assert flex_attention.__module__ == "flashtile.torch.flex"
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
    # 1 - t*t of a tanh is written as tanh's own derivative; with alpha it is not
    "one minus tanh squared": lambda s, b, h, qi, kv: (lambda t: 1 - t * t)(torch.tanh(s)),
    "sub alpha of tanh squared": lambda s, b, h, qi, kv: (lambda t: torch.sub(1, t * t, alpha=2))(
        torch.tanh(s)
    ),
}


def test_translated_operations():
    """Every operation of TRANSLATED in one mod (one compilation): each term
    moves the scores, so a mistranslated one shows."""

    def every(s, b, h, qi, kv):
        total = s
        for fn in TRANSLATED.values():
            total = total + 0.3 * (fn(s, b, h, qi, kv) - s)
        return total

    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(5)) for _ in "qkv")
    out = flex_attention(q, k, v, score_mod=every)
    ref, _ = dense_flex(q.double(), k.double(), v.double(), every)
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
