"""``flashtile bench --preset generate``: greedy decoding of transformers models, tokens/s.

What a model served on CPUs spends its time on: one decoding step after
another, each a few small matmuls per layer plus attention of one query
against the whole KV cache. Each case builds a causal LM from a config (no
download; random weights, seeded), twice with the same weights: once with
flashtile's transformers hook (:func:`flashtile.torch.register_transformers`)
and once with ``attn_implementation="sdpa"``. Per model:

1. **prefill, untimed**: the prompt (seeded random token ids) runs once
   through each model into its own cache; the logits of its last position
   give the first new token (``logits_to_keep=1``: the prompt's other logits
   are never formed).
2. **decode, timed**: ``new_tokens`` greedy steps, one token each, from that
   cache; before each call the cache is cropped back to the prompt, so every
   call decodes the same tokens at the same cache lengths. The two models
   are timed in interleaved rounds (:mod:`.timing`), after one untimed call
   each (Numba's first dispatch, torch's first allocations).
3. **tokens identical**: the first token and every call's tokens must equal
   SDPA's; otherwise the run stops with an error that shows where they part.

Each model's attention function is clocked inside the timed calls too
(:func:`clocked_attention`), so the table shows how much of a step is
attention at all: the rest of a step (weights, the cache update) is the
same for both models and bounds what faster attention can gain.

tokens/s = ``new_tokens / median seconds per call``, batch 1, float32, with
torch's own thread count (the kernels use Numba's). The header shows
``OMP_WAIT_POLICY``: torch and Numba each run an OpenMP pool whose idle
threads spin by default, and on shared cores that spinning, not attention,
can set the pace of a step (docs/decoding.md). torch and transformers are
imported only when the preset runs.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from statistics import median

from .targets import target_line
from .timing import interleaved_times

#: New tokens decoded per timed call (``--new-tokens``).
DEFAULT_NEW_TOKENS = 32
#: The KV cache the models decode into (``--cache``): transformers' default
#: ``DynamicCache`` (grows by concatenation) or a preallocated ``StaticCache``.
CACHE_KINDS = ("dynamic", "static")
SEED = 0


@dataclass(frozen=True)
class ModelCase:
    """One model to generate with.

    Attributes:
        label: the model, in words (the table's first column).
        family: ``"gpt2"`` or ``"llama"``: the transformers config class.
        config: keyword arguments of that config class (attention dropout is
            set to 0 on top of them).
        prompt: prompt tokens prefilled before the timed decoding.
        floor, stretch: the targets for ``tokens/s(flashtile) / tokens/s(sdpa)``.
    """

    label: str
    family: str
    config: dict = field(hash=False)
    prompt: int
    floor: float | None = None
    stretch: float | None = None


#: GPT-2 small (GPT2Config's defaults are GPT-2 small; positions widened past
#: 1024 so the prompt plus the new tokens fit) and a narrow Llama with GQA
#: 16/4, d 64 at a long prompt, where attention is most of a decoding step.
CASES: tuple[ModelCase, ...] = (
    ModelCase(
        "GPT-2 small shape (12 layers, 12 heads, d 64)",
        "gpt2",
        {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 2048},
        prompt=1024,
        floor=1.0,  # (issue 29: with attention at zero cost this shape gains 1.04x)
        stretch=1.04,
    ),
    ModelCase(
        "Llama shape (4 layers, GQA 16/4, d 64)",
        "llama",
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "vocab_size": 32000,
            "max_position_embeddings": 16384,
        },
        prompt=8192,
        floor=1.15,  # (issue 29: the bound with attention at zero cost is 1.25x)
        stretch=1.25,
    ),
)


@dataclass
class GenerateRow:
    """One model's result: median seconds per timed call of ``new_tokens`` steps,
    and median seconds of each call spent inside the attention function."""

    case: ModelCase
    new_tokens: int
    cache: str
    flashtile: float
    sdpa: float
    flashtile_attention: float = 0.0
    sdpa_attention: float = 0.0

    def tokens_per_s(self, seconds: float) -> float:
        return self.new_tokens / seconds


class TokensDiffer(AssertionError):
    """flashtile's greedy tokens are not SDPA's."""


def check_tokens(got, want, what: str) -> None:
    """Raise :class:`TokensDiffer` naming the first position where ``got != want``."""
    got, want = [int(t) for t in got], [int(t) for t in want]
    if got == want:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    first = min(len(got), len(want)) if first is None else first
    raise TokensDiffer(
        f"{what}: flashtile's greedy tokens differ from sdpa's at new token {first} "
        f"(flashtile {got[first : first + 4]}, sdpa {want[first : first + 4]}; "
        f"{len(got)} vs {len(want)} tokens)"
    )


def build_models(case: ModelCase, implementation: str) -> dict:
    """``{"flashtile": model, "sdpa": model}``: the same seeded weights, eval mode."""
    import torch
    import transformers

    config_class = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig}
    if case.family not in config_class:
        raise ValueError(f"family must be one of {list(config_class)}, got {case.family!r}")
    dropout = {"gpt2": {"attn_pdrop": 0.0}, "llama": {"attention_dropout": 0.0}}[case.family]
    models = {}
    for name, impl in (("sdpa", "sdpa"), ("flashtile", implementation)):
        torch.manual_seed(SEED)
        # One config each: from_config keeps the config object and records the
        # implementation on it, so a shared one would switch the first model too.
        config = config_class[case.family](**case.config, **dropout)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
        if model.config._attn_implementation != impl:
            raise RuntimeError(
                f"the {name} model runs attention {model.config._attn_implementation!r}, "
                f"not {impl!r}: the comparison would not be one"
            )
        models[name] = model.eval()
    models["flashtile"].load_state_dict(models["sdpa"].state_dict())
    return models


def _new_cache(model, kind: str, length: int):
    import transformers

    if kind == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=length)
    return transformers.DynamicCache(config=model.config)


def prefill(model, prompt, cache):
    """The first new token ``(1, 1)`` after running ``prompt (1, T)`` into ``cache``."""
    import torch

    with torch.no_grad():
        out = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True)


def decode(model, cache, first, prompt_len: int, steps: int):
    """``steps`` greedy tokens from ``first``, the cache cropped back to ``prompt_len``."""
    import torch

    extra = cache.get_seq_length() - prompt_len
    if extra > 0:
        cache.crop(-extra)
    tokens, token = [], first
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
    return tokens


@contextmanager
def clocked_attention(names):
    """Wrap transformers' attention functions ``names`` with a clock meanwhile.

    Yields ``{name: [seconds]}``, a one-element list per implementation that
    accumulates the wall time spent inside its function (every layer, every
    step); the originals are registered again on exit.
    """
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    spent = {name: [0.0] for name in names}
    inner = {name: ALL_ATTENTION_FUNCTIONS[name] for name in names}

    def clocked(name):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner[name](*args, **kwargs)
            finally:
                spent[name][0] += time.perf_counter() - start

        return call

    for name in names:
        AttentionInterface.register(name, clocked(name))
    try:
        yield spent
    finally:
        for name in names:
            AttentionInterface.register(name, inner[name])


def run_generate_case(
    case: ModelCase, implementation: str, new_tokens: int, rounds: int, cache_kind: str
) -> GenerateRow:
    """Prefill both models, check their tokens agree, time their decoding interleaved."""
    import torch

    models = build_models(case, implementation)
    vocab = models["sdpa"].config.vocab_size
    prompt = torch.randint(vocab, (1, case.prompt), generator=torch.Generator().manual_seed(SEED))
    state, want = {}, None
    for name, model in models.items():
        cache = _new_cache(model, cache_kind, case.prompt + new_tokens)
        first = prefill(model, prompt, cache)
        state[name] = (model, cache, first)
    check_tokens(state["flashtile"][2][0], state["sdpa"][2][0], f"{case.label}, first token")
    want = decode(*state["sdpa"], case.prompt, new_tokens)
    check_tokens(decode(*state["flashtile"], case.prompt, new_tokens), want, case.label)

    got, inside = {}, {name: [] for name in state}
    implementations = {"flashtile": implementation, "sdpa": "sdpa"}

    def timed(name, clock):
        def call():
            before = clock[0]
            got[name] = decode(*state[name], case.prompt, new_tokens)
            inside[name].append(clock[0] - before)

        return call

    with clocked_attention(list(implementations.values())) as spent:
        calls = {name: timed(name, spent[implementations[name]]) for name in state}
        times = interleaved_times(calls, rounds)
    for name in state:  # the last timed call of each, against the reference tokens
        check_tokens(got[name], want, f"{case.label}, timed {name} call")
    return GenerateRow(
        case, new_tokens, cache_kind, median(times["flashtile"]), median(times["sdpa"]),
        median(inside["flashtile"]), median(inside["sdpa"]),
    )  # fmt: skip


def generate_table(rows: list[GenerateRow]) -> list[str]:
    """Markdown table lines."""
    lines = [
        "| model | prompt | new tokens | cache | flashtile tokens/s | sdpa tokens/s "
        "| flashtile / sdpa | attention ms/token: flashtile, sdpa (of a step) | tokens |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        ours, theirs = r.tokens_per_s(r.flashtile), r.tokens_per_s(r.sdpa)
        inside = ", ".join(
            f"{1e3 * part / r.new_tokens:.2f} ({part / whole:.0%})"
            for part, whole in ((r.flashtile_attention, r.flashtile), (r.sdpa_attention, r.sdpa))
        )
        lines.append(
            f"| {r.case.label} | {r.case.prompt} | {r.new_tokens} | {r.cache} | {ours:.1f} "
            f"| {theirs:.1f} | {ours / theirs:.2f}x | {inside} | identical |"
        )
    return lines


def target_lines(rows: list[GenerateRow]) -> list[str]:
    """One speedup line per model, judged by its floor and stretch."""
    return [
        target_line(
            f"{r.case.label}, prompt {r.case.prompt}: tokens/s(flashtile) / tokens/s(sdpa)",
            r.sdpa / r.flashtile,
            r.case.floor,
            at_least=True,
            unit="x",
            stretch=r.case.stretch,
        )
        for r in rows
    ]


def run_generate_bench(out, reps: int = 7, new_tokens=None, cache=None) -> int:
    """Print the header, the table and the targets to ``out``.

    Returns 1 (after printing what was measured) when a model's tokens differ
    between flashtile and SDPA, else 0.
    """
    import torch
    import transformers

    from ..torch import register_transformers
    from .machine import header_lines, machine_info

    new_tokens = new_tokens or DEFAULT_NEW_TOKENS
    cache = cache or CACHE_KINDS[0]
    for line in header_lines(machine_info(torch.get_num_threads()), None):
        print(line, file=out)
    print(
        f"generate: transformers {transformers.__version__}, batch 1, float32, greedy; "
        f"prefill untimed, {new_tokens} new tokens per timed call, {cache} cache, medians "
        f"of {reps} interleaved rounds; load {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
        file=out,
    )
    implementation = register_transformers()
    rows, failed = [], []
    for case in CASES:
        try:
            rows.append(run_generate_case(case, implementation, new_tokens, reps, cache))
        except TokensDiffer as exc:
            failed.append(str(exc))
    print("", file=out)
    for line in generate_table(rows):
        print(line, file=out)
    print("", file=out)
    for line in target_lines(rows):
        print(f"* target: {line}", file=out)
    for message in failed:
        print(f"* FAILED: {message}", file=out)
        print(f"flashtile bench: FAILED: {message}", file=sys.stderr)
    return 1 if failed else 0
