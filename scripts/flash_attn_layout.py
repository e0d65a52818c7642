"""What flash-attn's (batch, seqlen, nheads, headdim) layout costs on flashtile's CPU kernels.

usage: python scripts/flash_attn_layout.py [rounds] [long_keys]

flashtile's kernels read ``(B, H, T, d)`` contiguous arrays; flash-attn's
tensors are ``(B, T, H, d)``. Two measurements, float32, medians over
interleaved rounds (each round calls every contender once, in a shuffled
order, the next round in the reverse order: flashtile.bench.timing):

1. Training: forward + backward, T=2048, causal, B=1, H=8, d=64.

   - ``flash_attn_func`` on ``(B, T, H, d)`` leaves (it copies q, k, v once
     into ``(B, H, T, d)`` and returns a contiguous ``(B, T, H, d)`` output);
   - ``flashtile.torch.attention`` on ``(B, H, T, d)`` leaves of the same
     data: the layout's cost is the difference;
   - ``attention`` on strided ``x.transpose(1, 2)`` views (what
     flash_attn_func would do without its own copy: the kernels then copy
     q, k, v in the forward and again in the backward).

2. Decoding: one query per sequence against a 4096-key cache, GQA 32/8,
   d=128, and MHA 8/8 d=64 (B=4, 2048 keys): ``flash_attn_with_kvcache`` on a
   ``(B, T, Hkv, d)`` cache (read in place as one-token pages), against
   ``flashtile.decode_attention`` on a ``(B, Hkv, T, d)`` cache (its own
   layout) and against copying the flash-attn cache into that layout on every
   call. With ``long_keys`` (issue 30's row: 65536) also GQA 32/8, d=128
   against that many keys (0.5 GiB per cache in float32).

Prints the CPU model (/proc/cpuinfo), the thread count, each median in ms
and the ratios (above 1: the flash-attn path is faster).
"""

from __future__ import annotations

import os
import statistics
import sys

import numpy as np
import torch

import flashtile
import flashtile.torch as ftt
from flashtile.bench.timing import interleaved_times
from flashtile.cpu.launch import numba_threads
from flashtile.flash_attn import flash_attn_func, flash_attn_with_kvcache
from flashtile.route_cache import cpu_model
from flashtile.torch.arrays import as_numpy


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def training(rounds: int) -> dict[str, float]:
    b, t, h, d = 1, 2048, 8, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, t, h, d, generator=g) for _ in range(4))
    fa = tuple(_leaf(x) for x in (q, k, v))
    native = tuple(_leaf(x.transpose(1, 2).contiguous()) for x in (q, k, v))
    views = tuple(_leaf(x) for x in (q, k, v))
    dout_native = dout.transpose(1, 2).contiguous()

    def run_fa():
        flash_attn_func(*fa, causal=True).backward(dout)

    def run_native():
        ftt.attention(*native, causal=True).backward(dout_native)

    def run_views():
        qv, kv, vv = (x.transpose(1, 2) for x in views)
        ftt.attention(qv, kv, vv, causal=True).transpose(1, 2).backward(dout)

    calls = {"flash_attn_func": run_fa, "attention (B,H,T,d)": run_native,
             "attention on views": run_views}  # fmt: skip
    for fn in calls.values():  # warm up: compile, plans
        fn()
    # The results agree (same data, same kernels).
    out_fa = flash_attn_func(*fa, causal=True).detach()
    out_native = ftt.attention(*native, causal=True).detach().transpose(1, 2)
    assert torch.allclose(out_fa, out_native, atol=1e-6)
    times = interleaved_times(calls, rounds)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def decoding(rounds: int, b: int, hq: int, hkv: int, t: int, d: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, 1, hq, d, generator=g)
    k_cache, v_cache = (torch.randn(b, t, hkv, d, generator=g) for _ in range(2))
    seqlens = torch.full((b,), t, dtype=torch.int32)
    qn = as_numpy(q.transpose(1, 2).contiguous())
    kn, vn = (as_numpy(c.transpose(1, 2).contiguous()) for c in (k_cache, v_cache))
    lengths = seqlens.numpy().astype(np.int64)

    def run_fa():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)

    def run_native():
        return flashtile.decode_attention(qn, kn, vn, cache_seqlens=lengths)

    def run_copy():
        kc, vc = (as_numpy(c.transpose(1, 2).contiguous()) for c in (k_cache, v_cache))
        return flashtile.decode_attention(qn, kc, vc, cache_seqlens=lengths)

    calls = {"flash_attn_with_kvcache": run_fa, "decode_attention (B,Hkv,T,d)": run_native,
             "copy + decode_attention": run_copy}  # fmt: skip
    for fn in calls.values():
        fn()
    want = torch.from_numpy(run_native()).transpose(1, 2)
    assert torch.allclose(run_fa(), want, atol=1e-6)
    times = interleaved_times(calls, rounds)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def _report(title: str, medians: dict[str, float], subject: str) -> None:
    print(f"\n{title}")
    for name, ms in medians.items():
        print(f"  {name:32s} {ms:9.3f} ms")
    for name, ms in medians.items():
        if name != subject:
            print(f"  {name} / {subject}: {ms / medians[subject]:.3f}x")


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    model, flags = cpu_model()
    print(f"CPU: {model} ({os.cpu_count()} logical cores; {' '.join(flags)})")
    print(f"Numba threads {numba_threads()}, torch threads {torch.get_num_threads()}, "
          f"{rounds} interleaved rounds, medians")  # fmt: skip
    if hasattr(os, "getloadavg"):
        print(f"load average before: {os.getloadavg()[0]:.2f}")
    _report(
        "fwd+bwd, T=2048 causal, B=1 H=8 d=64, float32",
        training(rounds),
        "flash_attn_func",
    )
    cases = [(1, 32, 8, 4096, 128), (4, 8, 8, 2048, 64)]
    if len(sys.argv) > 2:  # the long cache of issue 30's target
        cases.append((1, 32, 8, int(sys.argv[2]), 128))
    for b, hq, hkv, t, d in cases:
        _report(
            f"decode step, B={b} Hq={hq} Hkv={hkv} T={t} d={d}, float32",
            decoding(3 * rounds, b, hq, hkv, t, d),
            "flash_attn_with_kvcache",
        )
    if hasattr(os, "getloadavg"):
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
