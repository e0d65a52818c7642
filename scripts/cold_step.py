"""A one-query decoding step with K/V cached and with K/V evicted, against SDPA.

usage: python scripts/cold_step.py [rounds]

In a model loop each layer's K/V have left the caches by the time its next
step reads them (the other layers ran in between); repeated calls on the
same arrays keep them cached. This times q (1, 12, 1, 64) against 1024 and
2048 keys (a GPT-2-small step), float32, 2 threads, through
``flashtile.attention``, ``flashtile.torch.attention`` and torch SDPA, and
``torch.sum`` of the same K/V bytes as a read reference: first warm
(repeated calls), then cold (a 64 MiB array updated before each call,
untimed). Medians of shuffled interleaved rounds, microseconds.
"""

import random
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import flashtile
import flashtile.torch as ftt


def cases(keys: int) -> dict:
    """name -> zero-argument callable, for one cache length."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 12, 1, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 12, keys, 64), dtype=np.float32) for _ in range(2))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    return {
        "flashtile.attention": lambda: flashtile.attention(q, k, v),
        "flashtile.torch": lambda: ftt.attention(tq, tk, tv),
        "sdpa": lambda: F.scaled_dot_product_attention(tq, tk, tv),
        "torch.sum of K/V": lambda: (tk.sum(), tv.sum()),
    }


def main(rounds: int) -> None:
    evict = np.ones((64 << 20) // 4, dtype=np.float32)
    for keys in (1024, 2048):
        fns = cases(keys)
        for fn in fns.values():  # compile and warm up
            fn()
            fn()
        for cold in (False, True):
            times = {name: [] for name in fns}
            for _ in range(rounds):
                order = list(fns)
                random.shuffle(order)
                for name in order:
                    for _ in range(5):
                        if cold:
                            evict += 1.0  # push K/V out of the caches (untimed)
                        t0 = time.perf_counter()
                        fns[name]()
                        times[name].append(time.perf_counter() - t0)
            line = "  ".join(f"{n} {statistics.median(t) * 1e6:6.0f}" for n, t in times.items())
            print(f"{keys} keys, {'cold' if cold else 'warm'}: {line}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
