"""bf16 decoding steps side by side in one process: the torch op against
SDPA on the same bf16 tensors, and against flashtile's own float32 step on
the same values (2 threads, wall time).

usage: python scripts/decode_bf16_steps.py [rounds]

One query per sequence (B=1) against a whole cache of Tk keys, for a GQA
model shape (32 query heads, 8 kv heads, d 128) and an MHA one (12 heads,
d 64), Tk = 2048, 8192 and 65536. ``flashtile.torch.attention`` routes
these decode-shaped calls to the split-KV decode kernel; with bf16 queries
and cache its tile products are bf16 (oneMKL's ``gemm_bf16bf16f32`` where
the CPU has bf16 instructions: ``flashtile.decode_planning.decode_operands``).
Each round times every case in a shuffled order (the median of its calls);
the script prints the medians over rounds, the spread of the rounds and the
ratios SDPA time / flashtile time and float32 time / bf16 time (above 1:
the bf16 flashtile step is faster).
"""

import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashtile.torch as ftt

SHAPES = {"GQA 32/8 d128": (32, 8, 128), "MHA 12 d64": (12, 12, 64)}
LENGTHS = (2048, 8192, 65536)


def cases() -> dict:
    """(shape, Tk, provider) -> zero-argument callable."""
    torch.manual_seed(0)
    out = {}
    for name, (hq, hkv, d) in SHAPES.items():
        for tk in LENGTHS:
            q = torch.randn(1, hq, 1, d).bfloat16()
            k, v = (torch.randn(1, hkv, tk, d).bfloat16() for _ in "kv")
            f32 = [t.float() for t in (q, k, v)]
            gqa = hq != hkv
            out[(name, tk, "flashtile bf16")] = lambda b=(q, k, v), g=gqa: ftt.attention(
                *b, enable_gqa=g
            )
            out[(name, tk, "flashtile f32")] = lambda b=f32, g=gqa: ftt.attention(*b, enable_gqa=g)
            out[(name, tk, "sdpa bf16")] = lambda b=(q, k, v), g=gqa: (
                F.scaled_dot_product_attention(*b, enable_gqa=g)
            )
    return out


def per_call(fn, calls: int) -> float:
    """Median milliseconds of ``calls`` calls of ``fn``."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(rounds: int) -> None:
    fns = cases()
    for fn in fns.values():  # compile and warm up
        fn()
    times = {key: [] for key in fns}
    for _ in range(rounds):
        order = list(fns)
        random.shuffle(order)
        for key in order:
            times[key].append(per_call(fns[key], max(3, 40_000 // key[1])))
    med = {key: statistics.median(v) for key, v in times.items()}
    for key, ms in med.items():
        spread = f"{min(times[key]) / ms:.2f}..{max(times[key]) / ms:.2f}"
        print(f"{key[0]:14s} Tk={key[1]:6d} {key[2]:15s} {ms:9.3f} ms  ({spread})")
    for name in SHAPES:
        for tk in LENGTHS:
            own = med[(name, tk, "flashtile bf16")]
            sdpa, f32 = med[(name, tk, "sdpa bf16")], med[(name, tk, "flashtile f32")]
            ratios = f"vs SDPA bf16 {sdpa / own:.2f}x, vs flashtile float32 {f32 / own:.2f}x"
            print(f"{name} Tk={tk}: {ratios}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
