"""The named benchmarks of ``flashtile bench --preset NAME``, as one table.

A preset names what it measures, builds its cases from ``(B, H)``, and says
which target lines its results are judged by. Some presets build and time
their own cases instead: ``calls`` (:mod:`.calls`, small calls' fixed
cost), ``decode`` (:mod:`.decode`, KV-cache decoding in GB/s against a read
ceiling), ``flex`` (:mod:`.flex`, FlexAttention's mods) and ``generate``
(:mod:`.generate`, greedy decoding of transformers models in tokens/s).
Adding a benchmark is one entry in :data:`PRESETS`. Only the command line
(:mod:`.cli`) reads this module; nothing in the bench imports it back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from . import calls, decode, flex, generate, torch_op, variant_cases, variant_providers
from .cases import Case, sweep


@dataclass(frozen=True)
class Preset:
    """One named benchmark.

    Attributes:
        measures: what it measures, in one line (``--help`` shows it).
        cases: ``(B, H) -> cases``; None for a preset with its own ``run``.
        H: heads when ``--H`` is not given.
        reps: timed calls per provider when ``--reps`` is not given.
        targets: ``results -> target lines``, or None when it has no targets.
        run: a bench that builds, times and prints its own cases:
            ``run(out, reps=..., **options) -> exit status``, called instead
            of the attention runner.
        options: the command-line options (argparse names) that ``run``
            reads; every other case or output option is refused with it.
    """

    measures: str
    cases: Callable[[int, int], list[Case]] | None = None
    H: int = 8
    reps: int = 5
    targets: Callable[[list], list[str]] | None = None
    run: Callable[..., int] | None = None
    options: tuple[str, ...] = ()


#: The two providers every row of the core preset compares.
FAST = ("flashtile", "torch-sdpa")


def core_cases(B: int = 1, H: int = 8) -> list[Case]:
    """flashtile against torch SDPA at the sizes that matter (fp32, d=64 unless said).

    numpy-naive joins only the fwd T=4096 non-causal row, which gives the
    "vs numpy-naive" figure.
    """
    return [
        Case(4096, 64, False, "fwd", B, H, (*FAST, "numpy-naive")),
        Case(4096, 64, True, "fwd", B, H, FAST),
        Case(1024, 64, True, "fwd", B, H, FAST),
        Case(1024, 64, False, "fwd", B, H, FAST),
        Case(2048, 64, True, "fwd+bwd", B, H, FAST),
        Case(2048, 64, False, "fwd+bwd", B, H, FAST),
        Case(2048, 128, True, "fwd", B, H, FAST),
    ]


def quick_cases(B: int = 1, H: int = 2) -> list[Case]:
    """A smoke run of a few seconds: tiny T, every provider, both modes."""
    return sweep((64, 256), (32,), "both", "both", B, H)


#: preset name -> Preset, in ``--help`` order; :data:`DEFAULT` runs when no
#: case option is given.
PRESETS: dict[str, Preset] = {
    "core": Preset(
        "flashtile vs torch SDPA, fwd and fwd+bwd, T=1024..4096 (the default)", core_cases
    ),
    "quick": Preset("a smoke run of seconds: T=64 and 256, d=32, every provider", quick_cases, 2),
    "variants": Preset(
        "sliding window, block-sparse mask, GQA and varlen vs torch SDPA and the dense "
        "and per-sequence baselines",
        variant_cases.variant_cases,
        targets=variant_providers.target_lines,
    ),
    "torch-op": Preset(
        "flashtile.torch.attention fwd+bwd vs torch SDPA and vs the bare kernels "
        "(the torch layer's cost)",
        torch_op.torch_op_cases,
        targets=torch_op.target_lines,
    ),
    "calls": Preset(
        "the fixed cost of small calls (T=1, a decoding step, a tiny causal call) vs "
        "torch SDPA, the front door's cost above the kernel, and the decoding step "
        "with a second process busy on one core",
        reps=15,
        run=calls.run_calls_bench,
    ),
    "decode": Preset(
        "KV-cache decoding in GB/s vs torch SDPA and a measured memory-read ceiling",
        reps=9,
        run=partial(decode.run_decode_bench, lengths=(8192, 65536)),
    ),
    "flex": Preset(
        "FlexAttention mods (score_mod/mask_mod) vs torch.compile(flex_attention), the "
        "built-in flags and SDPA; block masks, memory, a new mod's compile time",
        run=flex.run_flex_bench,
    ),
    "generate": Preset(
        "greedy decoding of transformers models (GPT-2 small shape, a GQA Llama shape at a "
        "long prompt) in tokens/s, flashtile's hook vs sdpa, tokens checked identical",
        reps=7,
        run=generate.run_generate_bench,
        options=("new_tokens", "cache"),
    ),
}
DEFAULT = "core"
