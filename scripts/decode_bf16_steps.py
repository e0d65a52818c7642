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
Each round times every case once, as a batch of calls, in the order of
``flashtile bench``'s timer (:func:`flashtile.bench.timing.interleaved_times`);
the script prints, per call, the median over rounds of each batch's mean,
their spread and the ratios SDPA time / flashtile time and float32 time /
bf16 time (above 1: the bf16 flashtile step is faster).
"""

import statistics
import sys

import torch
import torch.nn.functional as F

import flashtile.torch as ftt
from flashtile.bench.timing import interleaved_times

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


def batch(fn, calls: int):
    """``fn`` called ``calls`` times in a row: one timed unit of a round."""

    def run():
        for _ in range(calls):
            fn()

    return run


def main(rounds: int) -> None:
    fns = cases()
    for fn in fns.values():  # compile and warm up
        fn()
    counts = {key: max(3, 40_000 // key[1]) for key in fns}
    names = {key: " ".join(map(str, key)) for key in fns}
    units = {names[key]: batch(fn, counts[key]) for key, fn in fns.items()}
    times = interleaved_times(units, rounds)  # the bench's own timer
    per_call = {key: [t / counts[key] * 1e3 for t in times[names[key]]] for key in fns}
    med = {key: statistics.median(v) for key, v in per_call.items()}
    for key, ms in med.items():
        spread = f"{min(per_call[key]) / ms:.2f}..{max(per_call[key]) / ms:.2f}"
        print(f"{key[0]:14s} Tk={key[1]:6d} {key[2]:15s} {ms:9.3f} ms  ({spread})")
    for name in SHAPES:
        for tk in LENGTHS:
            own = med[(name, tk, "flashtile bf16")]
            sdpa, f32 = med[(name, tk, "sdpa bf16")], med[(name, tk, "flashtile f32")]
            ratios = f"vs SDPA bf16 {sdpa / own:.2f}x, vs flashtile float32 {f32 / own:.2f}x"
            print(f"{name} Tk={tk}: {ratios}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
