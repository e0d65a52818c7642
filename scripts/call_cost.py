"""The fixed cost of one call, and small calls against torch SDPA, in one process.

usage: python scripts/call_cost.py [rounds] [calls per round]

Times, per call (medians over shuffled interleaved rounds, each round the
median of its calls), float32:

- the fixed cost: a T=1 call (q, k, v of (1, 12, 1, 64)) through
  ``flashtile.attention`` (NumPy), ``flashtile.decode_attention`` and
  ``flashtile.torch.attention``;
- a decoding step, q (1, 12, 1, 64) against 2048 keys, and the tiny causal
  call (1, 4, 16, 32), forward and forward+backward, through the torch op
  and through ``torch.nn.functional.scaled_dot_product_attention``.

Prints each median with the spread of its rounds, SDPA / flashtile ratios
(above 1: flashtile is faster) and the load average before and after: on a
shared machine the spread says how far to trust a ratio. On a busy small
machine torch's and Numba's OpenMP workers spin against each other and the
parallel cases measure the scheduler (docs/decoding.md):
``OMP_WAIT_POLICY=passive`` removes that, at about twice the small-call cost
on a quiet machine.

Measured on the 2-core machine, quiet (load average 0.5-0.8), default wait
policy, 11 rounds of 100 calls, the tree before plans were cached ("before")
and after, each in its own process a minute apart:

| case | before | after | SDPA (after's run) | SDPA / flashtile |
| --- | --- | --- | --- | --- |
| T=1, flashtile.attention (NumPy) | 162.6 us | 54.8 us | | |
| T=1, decode_attention | 267.3 us | 85.7 us | | |
| T=1, torch op | 339.0 us | 82.6 us | 11.2 us | 0.04x -> 0.14x |
| step (1, 12, 1, 64) vs 2048 keys, torch op | 986 us | 590 us | 366 us | 0.45x -> 0.62x |
| tiny (1, 4, 16, 32) causal, torch op | 274.1 us | 89.8 us | 13.9 us | 0.06x -> 0.15x |
| tiny, forward+backward, torch op | 1237 us | 530 us | 88 us | 0.12x -> 0.17x |
"""

import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashtile
import flashtile.torch as ftt
from flashtile.api import check_call
from flashtile.cpu.launch import run_forward
from flashtile.planning import plan_forward


def per_call(fn, calls: int) -> float:
    """Median microseconds of ``calls`` calls of ``fn``."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def cases() -> dict:
    """name -> zero-argument callable."""
    torch.manual_seed(0)
    one = [torch.randn(1, 12, 1, 64) for _ in range(3)]
    step = [torch.randn(1, 12, 1, 64)] + [torch.randn(1, 12, 2048, 64) for _ in range(2)]
    tiny = [torch.randn(1, 4, 16, 32) for _ in range(3)]
    tiny_g = [t.clone().requires_grad_() for t in tiny]
    n1 = [t.numpy() for t in one]
    n_tiny = [t.numpy() for t in tiny]
    tiny_plan = plan_forward(check_call(*n_tiny, True, None, {}))

    def backward(fn):
        def run():
            fn(*tiny_g, causal=True).sum().backward()

        return run

    def sdpa(q, k, v, causal=False):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return {
        "T=1 flashtile.attention": lambda: flashtile.attention(*n1),
        "T=1 decode_attention": lambda: flashtile.decode_attention(*n1),
        "tiny flashtile.attention": lambda: flashtile.attention(*n_tiny, causal=True),
        "tiny kernel alone": lambda: run_forward(tiny_plan),
        "T=1 torch op": lambda: ftt.attention(*one),
        "T=1 SDPA": lambda: sdpa(*one),
        "step torch op": lambda: ftt.attention(*step),
        "step SDPA": lambda: sdpa(*step),
        "tiny torch op": lambda: ftt.attention(*tiny, causal=True),
        "tiny SDPA": lambda: sdpa(*tiny, causal=True),
        "tiny fwd+bwd torch op": backward(ftt.attention),
        "tiny fwd+bwd SDPA": backward(sdpa),
    }


def main(rounds: int = 15, calls: int = 200) -> None:
    fns = cases()
    for fn in fns.values():  # compile and warm up
        for _ in range(20):
            fn()
    print(f"load average before: {os.getloadavg()}")
    results = {name: [] for name in fns}
    for _ in range(rounds):
        names = list(fns)
        random.shuffle(names)
        for name in names:
            results[name].append(per_call(fns[name], calls))
    med = {name: statistics.median(r) for name, r in results.items()}
    for name, r in results.items():
        print(f"{name:26s} {med[name]:9.1f} us  (rounds {min(r):.1f} .. {max(r):.1f})")
    print(f"load average after:  {os.getloadavg()}")
    for case in ("T=1", "step", "tiny", "tiny fwd+bwd"):
        ratio = med[f"{case} SDPA"] / med[f"{case} torch op"]
        print(f"{case:14s} SDPA time / flashtile time: {ratio:.2f}x")
    print(
        f"fixed cost (T=1): NumPy {med['T=1 flashtile.attention']:.1f} us, torch op "
        f"{med['T=1 torch op']:.1f} us, decode_attention {med['T=1 decode_attention']:.1f} us"
    )
    above = med["tiny flashtile.attention"] - med["tiny kernel alone"]
    print(f"tiny (1, 4, 16, 32) causal, flashtile.attention: {above:.1f} us above the kernel")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
