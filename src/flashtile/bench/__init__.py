"""``flashtile bench``: verify attention providers, then time them side by side.

Modules, from the bottom up: :mod:`.cases` (a case and its FLOP formula),
:mod:`.providers` (the implementations compared), :mod:`.timing` (the one
timer: interleaved, shuffled rounds, medians), :mod:`.targets` (the one
target-line format), :mod:`.memory` (peak extra memory), :mod:`.machine`
(header and sgemm ceiling), :mod:`.variant_cases` and
:mod:`.variant_providers` (windows, block-sparse masks, GQA, varlen),
:mod:`.torch_op` (the torch layer's cost), :mod:`.runner` (verify, measure,
time), :mod:`.report` (table, JSON, plot), :mod:`.decode` (KV-cache decoding
in GB/s against a read of the same bytes), :mod:`.generate` (greedy decoding
of transformers models in tokens/s), :mod:`.startup` (time to a first call),
:mod:`.presets` (the named benchmarks) and :mod:`.cli` (the subcommand). No
module imports one listed after it. Nothing here imports torch until a torch
provider (or the decode or generate preset) is used.
"""

from .cases import Case, attention_flops
from .providers import PROVIDERS, Provider, make_providers

__all__ = ["PROVIDERS", "Case", "Provider", "attention_flops", "make_providers"]
