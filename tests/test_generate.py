"""The generate preset's models: the same weights, each on its own attention."""

import pytest

from flashtile.bench import generate

TINY = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 128}
LLAMA = {**TINY, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def models():
    pytest.importorskip("transformers")
    from flashtile.torch import register_transformers

    name = register_transformers()
    return name, generate.build_models(generate.ModelCase("tiny", "llama", LLAMA, prompt=4), name)


def test_build_models_gives_each_model_its_own_attention_and_the_same_weights(models):
    import torch

    name, models = models
    # A config shared by both models once switched the "sdpa" one to flashtile as well.
    assert models["sdpa"].config is not models["flashtile"].config
    assert models["sdpa"].config._attn_implementation == "sdpa"
    assert models["flashtile"].config._attn_implementation == name
    theirs, ours = models["sdpa"].state_dict(), models["flashtile"].state_dict()
    assert all(torch.equal(theirs[key], ours[key]) for key in theirs)


def test_clocked_attention_times_only_the_model_that_ran_and_restores_the_functions(models):
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name, models = models
    before = {n: ALL_ATTENTION_FUNCTIONS[n] for n in ("sdpa", name)}
    with torch.no_grad(), generate.clocked_attention(["sdpa", name]) as spent:
        models["sdpa"](torch.tensor([[1, 2, 3]]))
        assert spent["sdpa"][0] > 0 and spent[name][0] == 0
        models["flashtile"](torch.tensor([[1, 2, 3]]))
        assert spent[name][0] > 0
    assert {n: ALL_ATTENTION_FUNCTIONS[n] for n in before} == before


def test_table_shows_the_attention_share_of_a_step():
    case = generate.ModelCase("tiny", "llama", LLAMA, prompt=4)
    row = generate.GenerateRow(case, 4, "dynamic", 0.2, 0.4, 0.05, 0.3)
    line = generate.generate_table([row])[-1]
    assert "| 2.00x | 12.50 (25%), 75.00 (75%) | identical |" in line
