"""The generate preset's models: the same weights, each on its own attention."""

import pytest

from flashtile.bench import generate


def test_build_models_gives_each_model_its_own_attention_and_the_same_weights():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from flashtile.torch import register_transformers

    name = register_transformers()
    tiny = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 128}
    llama = {**tiny, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    models = generate.build_models(generate.ModelCase("tiny", "llama", llama, prompt=4), name)
    # A config shared by both models once switched the "sdpa" one to flashtile as well.
    assert models["sdpa"].config is not models["flashtile"].config
    assert models["sdpa"].config._attn_implementation == "sdpa"
    assert models["flashtile"].config._attn_implementation == name
    theirs, ours = models["sdpa"].state_dict(), models["flashtile"].state_dict()
    assert all(torch.equal(theirs[key], ours[key]) for key in theirs)
