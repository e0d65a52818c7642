"""The one format of a benchmark target line: what was measured, its value, the verdict.

Every bench (attention cases and decoding) prints its goals as ``* target:``
lines of the same shape::

    GQA 32q/8kv T=2048 d=128: time(torch-sdpa) / time(flashtile) = 1.07x (target >= 1x: met)
    Tk=65536, paged 16: time(paged) / time(contiguous) = 1.04 (target <= 1.3: met)
    fwd+bwd T=256 d=64 causal: overhead ... = +4.1% (no target at this size)
"""

from __future__ import annotations

#: How a value and its limit are written, per unit.
_FORMATS = {
    "": (".2f", "g"),  # a ratio of times
    "x": (".2f", "g"),  # a speedup
    "%": ("+.1%", ".0%"),  # an overhead
}


def _number(x: float, spec: str, unit: str) -> str:
    return format(x, spec) + ("" if unit == "%" else unit)


def target_line(
    what: str,
    value: float,
    limit: float | None,
    *,
    at_least: bool,
    unit: str = "",
    stretch: float | None = None,
) -> str:
    """``"{what} = {value} (target {>=|<=} {limit}: met|missed)"``.

    Args:
        what: the case and the quantity, e.g. ``"T=4096: time(a) / time(b)"``.
        value: the measured quantity.
        limit: the goal; None for a measurement shown without one
            (``no target at this size``).
        at_least: the goal is ``value >= limit`` (a speedup) rather than
            ``value <= limit`` (a time ratio, an overhead).
        unit: ``""`` (a ratio), ``"x"`` (a speedup) or ``"%"`` (a fraction
            written as a signed percentage).
        stretch: a second, harder goal named after the verdict.
    """
    if unit not in _FORMATS:
        raise ValueError(f"unit must be one of {list(_FORMATS)}, got {unit!r}")
    value_spec, limit_spec = _FORMATS[unit]
    measured = f"{what} = {_number(value, value_spec, unit)}"
    if limit is None:
        return f"{measured} (no target at this size)"
    met = value >= limit if at_least else value <= limit
    goal = f"target {'>=' if at_least else '<='} {_number(limit, limit_spec, unit)}"
    goal += f": {'met' if met else 'missed'}"
    if stretch is not None:
        goal += f"; stretch {_number(stretch, limit_spec, unit)}"
    return f"{measured} ({goal})"
