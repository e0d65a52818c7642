"""The ``torch-op`` preset: what the torch layer of :mod:`flashtile.torch` costs.

Three providers run forward+backward on the same inputs, timed interleaved in
one process (medians, see :mod:`.timing`):

* ``torch-sdpa``: ``torch.nn.functional.scaled_dot_product_attention``;
* ``flashtile-torch``: :func:`flashtile.torch.attention` (custom ops, autograd);
* ``flashtile``: :func:`flashtile.attention` + :func:`flashtile.attention_backward`
  called directly on the NumPy arrays.

Targets, at ``B=1, H=8, T=2048, d=64`` causal: ``time(torch-sdpa) /
time(flashtile-torch)`` at least 0.8 (stretch 1.0), and the torch layer's
overhead ``time(flashtile-torch) / time(flashtile) - 1`` at most 5%. A short
``T=256`` case shows the same fixed overhead where it weighs more.
"""

from __future__ import annotations

from .cases import Case
from .targets import target_line

PROVIDERS = ("torch-sdpa", "flashtile", "flashtile-torch")
#: (T, d, causal) per case; the targets apply to the first.
SHAPES = ((2048, 64, True), (256, 64, True))
RATIO_TARGET, RATIO_STRETCH = 0.8, 1.0
OVERHEAD_TARGET = 0.05


def torch_op_cases(B: int = 1, H: int = 8) -> list[Case]:
    """Forward+backward cases comparing the torch op, the kernels and SDPA."""
    return [Case(T, d, causal, "fwd+bwd", B, H, PROVIDERS) for T, d, causal in SHAPES]


def target_lines(results) -> list[str]:
    """The ratio to SDPA and the torch-layer overhead, per case where all were timed."""
    times: dict = {}
    for r in results:
        if r.case.providers == PROVIDERS and r.median_s:
            times.setdefault(r.case, {})[r.provider] = r.median_s
    lines = []
    for case, t in times.items():
        op = t.get("flashtile-torch")
        if op is None:
            continue
        sized = (case.T, case.d, case.causal) == SHAPES[0]
        if "torch-sdpa" in t:
            lines.append(
                target_line(
                    f"{case.label}: time(torch-sdpa) / time(flashtile-torch)",
                    t["torch-sdpa"] / op,
                    RATIO_TARGET if sized else None,
                    at_least=True,
                    unit="x",
                    stretch=RATIO_STRETCH,
                )
            )
        if "flashtile" in t:
            what = "torch-layer overhead time(flashtile-torch) / time(flashtile) - 1"
            lines.append(
                target_line(
                    f"{case.label}: {what}",
                    op / t["flashtile"] - 1.0,
                    OVERHEAD_TARGET if sized else None,
                    at_least=False,
                    unit="%",
                )
            )
    return lines
