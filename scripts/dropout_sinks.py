"""What attention dropout and sinks cost: the issue's benchmark rows, one process.

    .venv/bin/python scripts/dropout_sinks.py [ROUNDS] [T_MEMORY]

Forward+backward, B=1, H=8, d=64, float32, causal, T=2048, through
``flashtile.torch.attention``: without dropout, with ``dropout_p=0.1``, with
sinks; and SDPA without and with ``dropout_p=0.1``. Shuffled interleaved
rounds; medians and ratios. Then the peak extra memory (RSS high-water mark,
:mod:`flashtile.bench.memory`) of one forward+backward at ``T_MEMORY``
(default 8192) with and without dropout.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashtile.torch as ftt
from flashtile.bench.memory import MIB, peak_memory


def cpu_model() -> str:
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def inputs(t: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, t, 64, generator=g).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(1, 8, t, 64, generator=g), torch.zeros(8, requires_grad=True)


def cases(q, k, v, dout, sinks):
    def step(fn):
        def run():
            out = fn()
            torch.autograd.grad(out, (q, k, v), dout)

        return run

    return {
        "flashtile": step(lambda: ftt.attention(q, k, v, causal=True)),
        "flashtile dropout 0.1": step(lambda: ftt.attention(q, k, v, causal=True, dropout_p=0.1)),
        "flashtile sinks": step(lambda: ftt.attention(q, k, v, causal=True, sinks=sinks)),
        "SDPA": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "SDPA dropout 0.1": step(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        ),
    }


def main(rounds: int = 7, t_memory: int = 8192) -> None:
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    runs = cases(*inputs(2048))
    times = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm up (compilation, caches)
    for _ in range(rounds):
        order = list(runs)
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"fwd+bwd T=2048 causal, medians of {rounds} shuffled rounds:")
    for name, m in med.items():
        print(f"  {name:24s} {m * 1e3:8.1f} ms")
    ratio = med["SDPA dropout 0.1"] / med["flashtile dropout 0.1"]
    print(f"  dropout vs SDPA dropout:        {ratio:.2f}x (floor 2x)")
    ratio = med["flashtile"] / med["flashtile dropout 0.1"]
    print(f"  dropout vs flashtile without:   {ratio:.2f}x (floor 0.75x)")
    print(f"  sinks vs without:               {med['flashtile'] / med['flashtile sinks']:.2f}x")
    runs = cases(*inputs(t_memory))
    for name in ("flashtile", "flashtile dropout 0.1"):
        runs[name]()
        peak = peak_memory(runs[name]).rss
        print(f"  peak extra RSS fwd+bwd T={t_memory}, {name}: {peak / MIB:.1f} MiB")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
