"""``flashtile demo`` and ``flashtile trace``: the algorithm walked through in text.

:func:`demo_text` and :func:`trace_table` return strings, so the commands only
print and tests can read; :func:`add_parsers` registers both commands.
"""

from __future__ import annotations

import sys

import numpy as np

from ..argtypes import VECTOR_HELP, number_vector, positive_int
from ..reference import (
    attention_memory_elements,
    naive_attention,
    online_softmax,
    online_softmax_steps,
    softmax,
    tiled_attention,
)


def _fmt(x: float) -> str:
    return f"{x:.4g}" if np.isfinite(x) else ("-inf" if x < 0 else str(x))


def trace_table(x, block_size: int) -> str:
    """The online normaliser of one row, one line per block."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"trace needs a non-empty 1-D vector, got shape {x.shape}")
    blocks = [x[i : i + block_size] for i in range(0, x.size, block_size)]
    rows = [("block", "values", "block max", "m_old", "m_new", "rescale", "running sum")]
    for step in online_softmax_steps(blocks):
        rows.append(
            (
                str(step.index),
                " ".join(_fmt(v) for v in step.block),
                _fmt(step.block_max),
                _fmt(step.m_old),
                _fmt(step.m_new),
                _fmt(step.rescale),
                _fmt(step.ell),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    probs = online_softmax(x, block_size)
    lines += [
        "",
        "rescale = exp(m_old - m_new): the factor that moves the old sum to the new max",
        "softmax = exp(x - m) / running sum = " + " ".join(f"{p:.4f}" for p in probs),
        f"check:   dense softmax max |diff| = {np.max(np.abs(probs - softmax(x))):.1e}",
    ]
    return "\n".join(lines)


def demo_text(seed: int = 0) -> str:
    """The newcomer's tour: agreement, memory accounting, one row walked through."""
    rng = np.random.default_rng(seed)
    out = ["flashtile demo: exact attention, one key/value tile at a time", ""]

    out.append("1. Tiled attention equals dense attention (float64, B=2, H=4, d=64)")
    out.append(f"   {'Tq':>5} {'Tk':>5} {'causal':>6} {'block':>5} {'max |tiled - naive|':>20}")
    for tq, tk, causal, block in [(128, 128, False, 32), (128, 128, True, 48), (33, 200, True, 64)]:
        q = rng.standard_normal((2, 4, tq, 64))
        k = rng.standard_normal((2, 4, tk, 64))
        v = rng.standard_normal((2, 4, tk, 64))
        dense, _ = naive_attention(q, k, v, causal)
        tiled = tiled_attention(q, k, v, block, causal)
        err = np.max(np.abs(tiled - dense))
        out.append(f"   {tq:>5} {tk:>5} {causal!s:>6} {block:>5} {err:>20.2e}")
    out.append("")

    out.append("2. Memory: the dense score matrix vs. the running state per head")
    out.append(f"   {'T':>6} {'naive scores':>14} {'online state':>13} {'fp32 scores':>12}")
    for tokens in (1024, 4096, 16384):
        mem = attention_memory_elements(tokens)
        mib = mem["naive_scores"] * 4 / 2**20
        out.append(
            f"   {tokens:>6} {mem['naive_scores']:>14,} {mem['online_state']:>13,} {mib:>8.0f} MiB"
        )
    out.append("   (per statistic: m, ell and the output numerator each keep one row per query)")
    out.append("")

    row = np.array([0.0, 1.0, 5.0, 2.0, 9.0, 3.0])
    out.append(f"3. One score row {row.tolist()} in blocks of 2: watch the max move")
    out.append("")
    out.extend("   " + line for line in trace_table(row, 2).splitlines())
    out.append("")
    out.append("Try: flashtile trace --x '1000 1001 1002' --block-size 2")
    return "\n".join(out)


def run_demo(args, out=None) -> int:
    """``flashtile demo``: print :func:`demo_text`."""
    print(demo_text(), file=out or sys.stdout)
    return 0


def run_trace(args, out=None) -> int:
    """``flashtile trace``: print :func:`trace_table` for ``--x`` and ``--block-size``."""
    print(trace_table(args.x, args.block_size), file=out or sys.stdout)
    return 0


def add_parsers(subparsers) -> None:
    """Register ``demo`` and ``trace`` on an ``add_subparsers()`` object."""
    demo = subparsers.add_parser(
        "demo", help="tiled vs naive attention, memory table, a row walked through"
    )
    demo.set_defaults(func=run_demo)
    trace = subparsers.add_parser("trace", help="the online softmax of a vector, block by block")
    trace.add_argument("--x", type=number_vector, required=True, help=VECTOR_HELP)
    trace.add_argument("--block-size", type=positive_int, default=2)
    trace.set_defaults(func=run_trace)
