"""The routes in force against each single forced route, on the core preset's cases.

    python examples/bench_routes.py [--dtype float32|bfloat16] [--reps 5]

For each case of ``flashtile bench --preset core`` (B=1, H=8), times
flashtile's NumPy API with the route as this machine resolves it ("chosen":
the measured cache entry, a variable, or the fixed rule) and with every
candidate forced in turn (``flashtile.routes.force``), in shuffled
interleaved rounds in one process, and prints a Markdown table of the
medians with ``chosen / best forced`` (speed: above 1 the chosen route is
the faster). The route is ``blas`` for float32 (which library runs the tile
products) and ``bf16`` for bfloat16 (bf16 products, or widened to float32).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import ml_dtypes
import numpy as np

import flashtile
from flashtile import route_cache, routes

#: ``(mode, T, d, causal)``: the core preset's cases.
CASES = (
    ("fwd", 4096, 64, False), ("fwd", 4096, 64, True), ("fwd", 1024, 64, True),
    ("fwd", 1024, 64, False), ("fwd+bwd", 2048, 64, True), ("fwd+bwd", 2048, 64, False),
    ("fwd", 2048, 128, True),
)  # fmt: skip


def case_call(mode: str, t: int, d: int, causal: bool, dtype, rng):
    """A callable running one case through the NumPy API."""
    q, k, v, dout = (rng.standard_normal((1, 8, t, d)).astype(np.float32) for _ in range(4))
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    if mode == "fwd":
        return lambda: flashtile.attention(q, k, v, causal=causal)

    def forward_backward():
        out, lse = flashtile.attention(q, k, v, causal=causal, return_lse=True)
        flashtile.attention_backward(q, k, v, out, lse, dout, causal=causal)

    return forward_backward


def timed(route: str, value: str | None, fn) -> float:
    """One call's seconds with ``route`` forced to ``value`` (None: as resolved),
    after an untimed call (a route that moves plans its calls again)."""
    with routes.force(route, value):
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    route = "blas" if args.dtype == "float32" else "bf16"
    dtype = np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16
    forced = list(routes.candidates(route))
    choice, why = routes.explain(route)
    model, features = route_cache.cpu_model()
    print(f"CPU {model} ({' '.join(features)}); {args.dtype}, B=1, H=8")
    print(f"route {route} = {choice} ({why})\n")
    print("| case | chosen ms | " + " | ".join(f"{c} ms" for c in forced) + " | speed |")
    print("| --- | ---: | " + " | ".join("---:" for _ in forced) + " | ---: |")
    rng = np.random.default_rng(0)
    for mode, t, d, causal in CASES:
        fn = case_call(mode, t, d, causal, dtype, rng)
        times: dict = {c: [] for c in [None, *forced]}
        for _ in range(args.reps):
            order = list(times)
            random.shuffle(order)
            for c in order:
                times[c].append(timed(route, c, fn))
        ms = {c: 1e3 * statistics.median(ts) for c, ts in times.items()}
        best = min(ms[c] for c in forced)
        cells = " | ".join(f"{ms[c]:.1f}" for c in forced)
        name = f"{mode} T={t} d={d} {'causal' if causal else 'full'}"
        print(f"| {name} | {ms[None]:.1f} | {cells} | {best / ms[None]:.2f}x |")


if __name__ == "__main__":
    main()
