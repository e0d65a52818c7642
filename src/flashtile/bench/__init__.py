"""``flashtile bench``: verify attention providers, then time them side by side.

Modules: :mod:`.cases` (cases, FLOP formula, presets), :mod:`.providers`
(the implementations compared), :mod:`.runner` (verify, measure, time),
:mod:`.memory` (peak extra memory), :mod:`.machine` (header and sgemm
ceiling), :mod:`.report` (table, JSON, plot), :mod:`.cli` (the subcommand),
:mod:`.variant_cases` and :mod:`.variant_providers` (the ``variants`` preset:
windows, block-sparse masks, GQA, varlen).
Nothing here imports torch until a torch provider is used.
"""

from .cases import Case, attention_flops
from .providers import PROVIDERS, Provider, make_providers

__all__ = ["PROVIDERS", "Case", "Provider", "attention_flops", "make_providers"]
