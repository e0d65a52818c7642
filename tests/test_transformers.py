"""flashtile as a transformers attention implementation (``register_transformers``).

Tiny models built from configs (no download) run once with flashtile (``"tiled"``)
and once with transformers' own ``"sdpa"`` (``"eager"`` for Gemma 2, which has no
sdpa path) from the same weights; logits must agree to float32 rounding for a plain
forward, a left-padded batch, 10 greedy generated tokens with the KV cache (dynamic
and static), and gradients in training mode.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs PyTorch")
transformers = pytest.importorskip(
    "transformers", reason="register_transformers needs the transformers package"
)

from flashtile.torch.hf import register_transformers  # noqa: E402

# float32 logits of ~unit size through 2 layers: flashtile and sdpa round differently.
ATOL = 2e-4
RTOL = 1e-4
VOCAB = 128


@pytest.fixture(scope="module")
def name() -> str:
    return register_transformers()


def _llama_config(**extra):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads per kv head
        max_position_embeddings=128,
        # A wider init than the default 0.02 makes attention far from uniform, so a wrong
        # mask or alignment changes the logits visibly.
        initializer_range=0.2,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


def _gpt2_config(**extra):
    cfg = dict(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        initializer_range=0.2,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.update(extra)
    return transformers.GPT2Config(**cfg)


def _gemma2_config():
    return transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,  # layer 0 sliding, layer 1 full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.2,
        sliding_window=6,  # shorter than the prompts: the window hides keys
        attn_logit_softcapping=1.0,  # small enough that tanh bends the scores
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


CONFIGS = {"llama": (_llama_config, "sdpa"), "gpt2": (_gpt2_config, "sdpa")}


def _twins(name: str, make_config, reference: str):
    """The same randomly initialised model with flashtile and with the reference attention."""
    # One config each: from_config keeps the config object and records the attention
    # implementation on it, so a shared config would switch the first model too.
    torch.manual_seed(0)
    tiled = transformers.AutoModelForCausalLM.from_config(make_config(), attn_implementation=name)
    ref = transformers.AutoModelForCausalLM.from_config(
        make_config(), attn_implementation=reference
    )
    ref.load_state_dict(tiled.state_dict())
    assert tiled.config._attn_implementation == name
    assert ref.config._attn_implementation == reference
    return tiled.eval(), ref.eval()


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=gen)


def _left_padded(batch: int = 3, length: int = 20):
    """Token ids and attention mask where row ``r`` has ``3 r`` pad tokens on the left."""
    ids = _ids(batch, length)
    mask = torch.ones(batch, length, dtype=torch.long)
    for r in range(batch):
        ids[r, : 3 * r] = 0
        mask[r, : 3 * r] = 0
    return ids, mask


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def twins(request, name):
    make_config, reference = CONFIGS[request.param]
    return _twins(name, make_config, reference)


@pytest.fixture(scope="module")
def gemma2_twins(name):
    return _twins(name, _gemma2_config, "eager")


def test_name_must_not_contain_flash():
    with pytest.raises(ValueError, match="flash"):
        register_transformers("my_flash_tiles")
    with pytest.raises(ValueError, match="sdpa"):
        register_transformers("sdpa")


def test_registers_attention_and_mask(name):
    from transformers import AttentionInterface, AttentionMaskInterface

    assert name == "tiled"
    assert name in AttentionInterface()
    assert name in AttentionMaskInterface()
    assert register_transformers() == name  # idempotent


@torch.no_grad()
def test_forward_logits_match(twins):
    tiled, ref = twins
    ids = _ids(2, 24)
    got, want = tiled(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_left_padded_batch_matches_at_real_tokens(twins):
    tiled, ref = twins
    ids, mask = _left_padded()
    got = tiled(ids, attention_mask=mask).logits
    want = ref(ids, attention_mask=mask).logits
    real = mask.bool()
    # Padded query rows see no key: flashtile gives zeros there, sdpa something else,
    # and neither is used, so only real token positions are compared.
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=RTOL)


def _generate(model, ids, mask=None, **kw):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kw,
    )
    return out.sequences, torch.stack(out.scores, dim=1)


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
def test_greedy_generation_matches(twins, padded):
    tiled, ref = twins
    if padded:
        ids, mask = _left_padded(batch=2, length=12)
    else:
        ids, mask = _ids(1, 12), None
    seq_t, scores_t = _generate(tiled, ids, mask)
    seq_r, scores_r = _generate(ref, ids, mask)
    assert seq_t.shape[1] == ids.shape[1] + 10
    assert torch.equal(seq_t, seq_r)
    torch.testing.assert_close(scores_t, scores_r, atol=ATOL, rtol=RTOL)


def test_static_cache_generation_matches(name):
    # A static cache hands attention all max_cache_len key slots: prefill comes with no
    # mask and Tk > Tq (unfilled slots), decoding with an explicit mask over the slots.
    tiled, ref = _twins(name, _llama_config, "sdpa")
    ids = _ids(1, 10)
    seq_t, scores_t = _generate(tiled, ids, cache_implementation="static")
    seq_r, scores_r = _generate(ref, ids, cache_implementation="static")
    assert torch.equal(seq_t, seq_r)
    torch.testing.assert_close(scores_t, scores_r, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_gemma2_softcap_and_sliding_window_match_eager(gemma2_twins):
    tiled, ref = gemma2_twins
    ids, mask = _left_padded(batch=2, length=16)
    got = tiled(ids, attention_mask=mask).logits
    want = ref(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=RTOL)
    seq_t, scores_t = _generate(tiled, ids, mask)
    seq_r, scores_r = _generate(ref, ids, mask)
    assert torch.equal(seq_t, seq_r)
    torch.testing.assert_close(scores_t, scores_r, atol=ATOL, rtol=RTOL)


def test_training_gradients_match(name):
    tiled, ref = _twins(name, _llama_config, "sdpa")
    tiled.train()
    ref.train()
    ids, mask = _left_padded(batch=2, length=16)
    labels = ids.masked_fill(mask == 0, -100)
    tiled(ids, attention_mask=mask, labels=labels).loss.backward()
    ref(ids, attention_mask=mask, labels=labels).loss.backward()
    grads_r = dict(ref.named_parameters())
    for pname, p in tiled.named_parameters():
        torch.testing.assert_close(p.grad, grads_r[pname].grad, atol=ATOL, rtol=1e-3, msg=pname)


def test_attention_dropout_in_training(name):
    """A model in training mode with attention dropout runs flashtile's dropout:
    reproducible from torch's seed, different from eval mode, finite gradients."""
    cfg = _gpt2_config(attn_pdrop=0.3)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=name).train()
    ids = _ids(2, 12)
    losses = []
    for _ in range(2):
        torch.manual_seed(7)
        losses.append(model(ids, labels=ids).loss)
    assert torch.equal(losses[0], losses[1])
    losses[0].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        assert not torch.equal(model.eval()(ids, labels=ids).loss, losses[0])


def _sink_reference(q, k, v, sinks, scale):
    """Eager attention with per-head sink logits (gpt-oss), non-causal, GQA by repeat."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    sink = sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return (p @ v).transpose(1, 2)


def test_attention_sinks(name):
    from transformers import AttentionInterface

    fn = AttentionInterface()[name]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    module = torch.nn.Module()
    module.is_causal = False
    q, sinks = q.requires_grad_(), sinks.requires_grad_()
    out, weights = fn(module, q, k, v, None, scaling=0.3, s_aux=sinks)
    assert weights is None
    expected = _sink_reference(q, k, v, sinks, 0.3)
    torch.testing.assert_close(out, expected)
    for a, e in zip(
        torch.autograd.grad(out.sum(), (q, sinks)),
        torch.autograd.grad(expected.sum(), (q, sinks)),
        strict=True,
    ):
        torch.testing.assert_close(a, e)


def _gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,  # one sliding-window layer, one full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=6,
        max_position_embeddings=128,
        initializer_range=0.2,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def test_gpt_oss_trains_with_learned_sinks(name):
    """A tiny gpt-oss (learned sinks per head, sliding windows, GQA) trains three
    SGD steps with flashtile as with eager attention: the same losses and sinks."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    tiled, ref = (m.train() for m in _twins(name, _gpt_oss_config, "eager"))
    ids = _ids(2, 14)
    for model in (tiled, ref):
        model.losses = []
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(3):
            opt.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            model.losses.append(loss.detach())
    torch.testing.assert_close(
        torch.stack(tiled.losses), torch.stack(ref.losses), atol=ATOL, rtol=RTOL
    )
    sinks = {n: p for n, p in tiled.named_parameters() if n.endswith("sinks")}
    assert sinks, "gpt-oss attention has a sinks parameter"
    ref_params = dict(ref.named_parameters())
    for n, p in sinks.items():
        torch.testing.assert_close(p, ref_params[n], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "case",
    [
        "float-mask",
        "bias+bool-mask",
        "bias+causal",
        "bias-only",
        "causal-tq<tk",
        "bias+causal-tq<tk",
        "causal-tq>tk",
    ],
)
def test_direct_call_matches_transformers_sdpa(name, case):
    # The registered function against transformers' own sdpa_attention_forward on the
    # argument combinations no tiny model above produces (T5-style position_bias, float
    # masks, an explicit is_causal with an empty static-cache tail).
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fn = AttentionInterface()[name]
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, tq, tk, d = 2, 4, 2, 6, 6, 8
    if case.endswith("causal-tq<tk"):
        tk = 9  # keys past Tq: unfilled static-cache slots that top-left causal ignores
    elif case == "causal-tq>tk":
        tk = 4  # top-left: query i sees keys j <= i, so every query sees key 0
    q = torch.randn(b, hq, tq, d, generator=gen)
    k, v = (torch.randn(b, hkv, tk, d, generator=gen) for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups = hq // hkv
    module.is_causal = True
    keep = torch.rand(b, 1, tq, tk, generator=gen) > 0.3
    keep[..., 0] = True  # every row keeps a key: sdpa and flashtile differ on empty rows
    bias = torch.randn(1, hq, tq, tk, generator=gen)
    kw = {"scaling": 0.4}
    mask = None
    if case == "float-mask":
        mask = torch.randn(b, 1, tq, tk, generator=gen).masked_fill(~keep, float("-inf"))
    elif case == "bias+bool-mask":
        mask, kw["position_bias"] = keep, bias
    elif case in ("bias+causal", "bias-only", "bias+causal-tq<tk"):
        kw["position_bias"] = bias
        kw["is_causal"] = case != "bias-only"
    elif case == "causal-tq>tk":
        kw["is_causal"] = True
    with torch.no_grad():
        got, _ = fn(module, q, k, v, mask, **kw)
        want, _ = sdpa_attention_forward(module, q, k, v, mask, **kw)
    assert got.shape == (b, tq, hq, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decoding_step_matches_transformers_sdpa(name, dtype, monkeypatch):
    # A decoding step (one query, no mask) takes the plain path straight from the hook
    # (float16 falls through to the general path): GQA read in place, dv != d, the
    # (B, 1, Hq, dv) layout sdpa returns, and gradients when asked.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flashtile.torch import hf

    ran = []
    plain = hf._plain_eager
    monkeypatch.setattr(hf, "_plain_eager", lambda *a: ran.append(plain(*a)) or ran[-1])
    fn = AttentionInterface()[name]
    gen = torch.Generator().manual_seed(9)
    b, hq, hkv, tk, d, dv = 2, 6, 2, 37, 16, 24
    q = torch.randn(b, hq, 1, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, tk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, tk, dv, generator=gen).to(dtype)
    module = torch.nn.Module()
    module.num_key_value_groups = hq // hkv
    module.is_causal = True
    with torch.no_grad():
        got, _ = fn(module, q, k, v, None, scaling=0.3)
        want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    assert [r is None for r in ran] == [dtype == torch.float16]
    assert got.shape == (b, 1, hq, dv) and got.is_contiguous() and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)

    def grads(attend):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        attend(module, *leaves, None, scaling=0.3)[0].float().square().sum().backward()
        return [x.grad for x in leaves]

    for mine, theirs in zip(grads(fn), grads(sdpa_attention_forward), strict=True):
        torch.testing.assert_close(mine, theirs, atol=4 * tol, rtol=4 * tol)
