"""Decode walks forced one by one: flashtile's own cache layout and flash-attn's.

usage: python scripts/decode_walks.py [keys] [Hq,Hkv,d] [batch] [rounds]
(default: 65536 32,8,128 1 5)

One query per sequence against a float32 cache of ``keys`` keys, timed in
shuffled interleaved rounds (medians, :mod:`flashtile.bench.timing`):

- ``decode_attention`` on a contiguous ``(B, Hkv, T, d)`` cache with each
  walk its route offers (``tiles``, ``rows``);
- ``flash_attn_with_kvcache`` on the same data as ``(B, T, Hkv, d)``, read
  in place as one-token pages, with each of that layout's walks
  (``head-rows``, ``head-tiles``, ``rows``, ``tiles``).

Prints each median, its ratio to the fastest own-layout walk and the GB/s
of K and V read, with the CPU model (/proc/cpuinfo). The routes
(:mod:`flashtile.routes`) pick among these by a shorter measurement of the
same kind; this shows the whole ranking at one size.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np
import torch

import flashtile
from flashtile import route_cache, routes
from flashtile.bench.timing import interleaved_times
from flashtile.flash_attn import flash_attn_with_kvcache


def main(keys: int, hq: int, hkv: int, d: int, batch: int, rounds: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(batch, 1, hq, d)
    k_fa, v_fa = torch.randn(batch, keys, hkv, d), torch.randn(batch, keys, hkv, d)
    q_own, k_own, v_own = (x.transpose(1, 2).contiguous().numpy() for x in (q, k_fa, v_fa))
    table, lengths = np.arange(batch)[:, None], np.full(batch, keys)

    def own(walk):
        name = routes.decode_route_name("contiguous", hq // hkv, d, keys)
        with routes.force(name, walk):
            flashtile.decode_attention(
                q_own, k_own, v_own, block_table=table, cache_seqlens=lengths
            )  # fmt: skip

    def flash_attn_layout(walk):
        with routes.force(routes.decode_route_name("tokens", hq // hkv, d, keys), walk):
            flash_attn_with_kvcache(q, k_fa, v_fa)

    calls = {f"own {w}": (lambda w=w: own(w)) for w in ("tiles", "rows")}
    walks = ("head-rows", "head-tiles", "rows", "tiles")
    calls.update({f"flash-attn {w}": (lambda w=w: flash_attn_layout(w)) for w in walks})
    for call in calls.values():  # warm up: compile, plans
        call()
    medians = {n: statistics.median(t) for n, t in interleaved_times(calls, rounds).items()}
    best_own = min(medians["own tiles"], medians["own rows"])
    gbytes = 2 * batch * keys * hkv * d * 4 / 1e9
    print(f"{route_cache.cpu_model()[0]}; B={batch} Hq={hq} Hkv={hkv} d={d} keys={keys}, float32")
    for name, t in medians.items():
        print(f"  {name:22s} {t * 1e3:8.2f} ms  best own / this {best_own / t:.3f}  "
              f"{gbytes / t:5.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    args = sys.argv[1:]
    keys = int(args[0]) if args else 65536
    hq, hkv, d = (int(x) for x in (args[1] if len(args) > 1 else "32,8,128").split(","))
    batch = int(args[2]) if len(args) > 2 else 1
    main(keys, hq, hkv, d, batch, int(args[3]) if len(args) > 3 else 5)
