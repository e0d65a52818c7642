"""``flashtile bench --preset flex``: FlexAttention's mods on flashtile's CPU kernels.

Measured against issue 31's targets (B=1, H=8, d=64, float32 unless said):

- forward T=4096 of five variants written as mods (causal, sliding window
  1024 + causal, a document mask of 4 documents + causal, ALiBi, softcap), each
  against ``torch.compile(flex_attention)`` on the CPU and against flashtile's
  built-in flag for the same variant (what a mod costs);
- forward+backward T=2048 causal with a learned relative-bias table against
  eager SDPA with the bias materialised (what a CPU user trains with today);
- ``create_block_mask`` T=65536 document mask: time and peak memory;
- forward+backward T=16384 causal + document mask: peak memory beyond the
  outputs and gradients;
- a new mod's time to the first result, in a fresh process and in a second
  process that finds it cached on disk;
- bf16 forward T=4096 with a causal mask_mod against SDPA bf16 causal.

Each comparison is timed side by side in one process, interleaved rounds
(:mod:`.timing`), medians.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from statistics import median

import numpy as np

from .memory import measure_rss
from .targets import target_line
from .timing import interleaved_medians

H, D = 8, 64
MIB = 2.0**20

#: A fresh process's first flex call with a new mod (``sys.argv[1]`` makes
#: the mod's source new), printing the seconds it took.
_NEW_MOD = """
import sys, time
import torch
from flashtile.torch.flex import flex_attention
q = torch.randn(1, 2, 256, 64, requires_grad=True)
table = torch.randn(2, 511, requires_grad=True)
c = float(sys.argv[1])
def mod(score, b, h, q_idx, kv_idx):
    return score * c + table[h, q_idx - kv_idx + 255]
t = time.perf_counter()
flex_attention(q, q, q, score_mod=mod).sum().backward()
print(time.perf_counter() - t)
"""


def _variants(torch, T: int):
    """name -> (score_mod, mask_mod, flag keywords of flashtile.attention)."""
    docs = torch.arange(T) // (T // 4)
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)])

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 1024)

    def document(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    cu = np.arange(0, T + 1, T // 4, dtype=np.int64)
    return {
        "causal": (None, causal, {"causal": True}),
        "window 1024 + causal": (None, window, {"causal": True, "window": (1024, 0)}),
        "4 documents + causal": (None, document, {"varlen": cu}),
        "ALiBi + causal": (alibi, causal, {"causal": True, "alibi_slopes": slopes.numpy()}),
        "softcap 30 + causal": (softcap, causal, {"causal": True, "softcap": 30.0}),
    }


def _flag_call(flashtile, q, k, v, keywords):
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    cu = keywords.get("varlen")
    if cu is not None:  # the built-in for packed documents: varlen_attention
        pack = [a[0] for a in (qn, kn, vn)]  # (H, total, d)
        return lambda: flashtile.varlen_attention(*pack, cu, cu, causal=True)
    return lambda: flashtile.attention(qn, kn, vn, **keywords)


def forward_rows(torch, reps: int, T: int = 4096, compiled: bool = True):
    """``[(variant, {provider: seconds})]`` of the forward comparisons."""
    import flashtile
    from flashtile.torch.flex import create_block_mask, flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, D, generator=g) for _ in range(3))
    compiled_flex = None
    if compiled:
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        compiled_flex = torch.compile(torch_flex)
    rows = []
    for name, (score_mod, mask_mod, flags) in _variants(torch, T).items():
        mask = create_block_mask(mask_mod, None, None, T, T)
        calls = {
            "flex (flashtile)": lambda s=score_mod, m=mask: flex_attention(q, k, v, s, m),
            "built-in flag": _flag_call(flashtile, q, k, v, flags),
        }
        if compiled_flex is not None:
            from torch.nn.attention.flex_attention import create_block_mask as torch_mask

            tmask = torch_mask(mask_mod, None, None, T, T, device="cpu")
            calls["torch.compile(flex)"] = lambda s=score_mod, m=tmask: compiled_flex(q, k, v, s, m)
        for call in calls.values():
            call()  # compile and warm
        rows.append((name, interleaved_medians(calls, reps)))
    return rows


def training_row(torch, reps: int, T: int = 2048) -> dict:
    """fwd+bwd with a learned relative-bias table: flex vs SDPA with the bias materialised."""
    from flashtile.torch.flex import create_block_mask, flex_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, T, D, generator=g, requires_grad=True) for _ in range(3))
    bias = torch.zeros(H, 2 * T - 1, requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + T - 1]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = create_block_mask(causal, None, None, T, T)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    hidden = torch.where(j <= i, 0.0, -torch.inf)

    def flex():
        flex_attention(q, k, v, rel_bias, mask).sum().backward()

    def sdpa():
        attn_mask = bias[:, i - j + T - 1] + hidden  # (H, T, T), differentiable in bias
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask).sum().backward()

    calls = {"flex (flashtile)": flex, "SDPA, bias materialised": sdpa}
    for call in calls.values():
        call()
    return interleaved_medians(calls, reps)


def block_mask_row(torch, T: int = 65536) -> tuple[float, float]:
    """(seconds, peak extra bytes) of create_block_mask for a 4-document mask."""
    from flashtile.torch.flex import create_block_mask

    docs = torch.arange(T) // (T // 4)

    def document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    create_block_mask(document, None, None, 1024, 1024)  # compile
    times = []
    for _ in range(3):
        start = time.perf_counter()
        create_block_mask(document, None, None, T, T)
        times.append(time.perf_counter() - start)
    peak, _ = measure_rss(lambda: create_block_mask(document, None, None, T, T))
    return median(times), peak


def memory_row(torch, T: int = 16384) -> float:
    """Peak bytes of fwd+bwd causal + 4 documents beyond out and the gradients."""
    from flashtile.torch.flex import create_block_mask, flex_attention

    docs = torch.arange(T) // (T // 4)

    def document(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    q, k, v = (torch.randn(1, H, T, D, requires_grad=True) for _ in range(3))
    mask = create_block_mask(document, None, None, T, T)

    def run():
        flex_attention(q, k, v, block_mask=mask).sum().backward()
        for t in (q, k, v):
            t.grad = None

    run()  # compile
    peak, _ = measure_rss(run)
    return peak - 4 * q.numel() * 4  # out, dq, dk, dv


def new_mod_row() -> tuple[float, float]:
    """Seconds to the first result of a new mod: a fresh process (the mod's
    code compiled) and a second one (its code loaded from the disk cache)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FLASHTILE_CACHE_DIR": cache, "FLASHTILE_TUNE": "0"}
        value = str(1.0 + time.time() % 1)  # a mod source no cache has seen
        runs = []
        for _ in range(2):
            done = subprocess.run(
                [sys.executable, "-c", _NEW_MOD, value], env=env, capture_output=True, text=True,
                check=True,
            )  # fmt: skip
            runs.append(float(done.stdout.split()[-1]))
    return runs[0], runs[1]


def bf16_row(torch, reps: int, T: int = 4096) -> dict:
    """bf16 forward, causal mask_mod vs SDPA bf16 causal."""
    from flashtile.torch.flex import create_block_mask, flex_attention

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, T, D, generator=g).bfloat16() for _ in range(3))
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, T, T)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {
        "flex (flashtile)": lambda: flex_attention(q, k, v, block_mask=mask),
        "SDPA bf16": lambda: sdpa(q, k, v, is_causal=True),
    }
    for call in calls.values():
        call()
    return interleaved_medians(calls, reps)


def run_flex_bench(out, reps: int = 5) -> int:
    """Print the flex preset's tables and target lines to ``out``."""
    import torch

    from .machine import header_lines, machine_info

    for line in header_lines(machine_info(torch.get_num_threads()), None):
        print(line, file=out)
    print(f"flex    : B=1, H={H}, d={D}, fp32 unless said; medians of {reps}", file=out)
    lines = []
    print("\nforward T=4096 (ms)            flex   built-in  torch.compile(flex)", file=out)
    for name, t in forward_rows(torch, reps):
        flex, flag = t["flex (flashtile)"], t["built-in flag"]
        comp = t.get("torch.compile(flex)")
        comp_text = f"{comp * 1e3:9.1f}" if comp else "        -"
        print(f"  {name:26s} {flex * 1e3:8.1f} {flag * 1e3:9.1f} {comp_text}", file=out)
        if comp:
            lines.append(target_line(f"{name}: vs torch.compile(flex)", comp / flex, 1.0,
                                     at_least=True, unit="x", stretch=1.5))  # fmt: skip
        lines.append(target_line(f"{name}: mod vs built-in flag", flag / flex, 0.85,
                                 at_least=True, unit="x", stretch=1.0))  # fmt: skip
    t = training_row(torch, reps)
    ratio = t["SDPA, bias materialised"] / t["flex (flashtile)"]
    print(f"\nfwd+bwd T=2048 causal + learned bias: flex {t['flex (flashtile)'] * 1e3:.1f} ms, "
          f"SDPA with the bias materialised {t['SDPA, bias materialised'] * 1e3:.1f} ms",
          file=out)  # fmt: skip
    lines.append(target_line("learned bias fwd+bwd vs SDPA", ratio, 3.0, at_least=True,
                             unit="x", stretch=6.0))  # fmt: skip
    seconds, peak = block_mask_row(torch)
    print(f"create_block_mask T=65536: {seconds:.3f} s, peak {peak / MIB:.1f} MiB", file=out)
    lines.append(target_line("create_block_mask T=65536 seconds", seconds, 1.0, at_least=False))
    lines.append(target_line("create_block_mask T=65536 MiB", peak / MIB, 64, at_least=False))
    extra = memory_row(torch)
    print(f"fwd+bwd T=16384 causal + documents: {extra / MIB:.1f} MiB beyond outputs", file=out)
    lines.append(target_line("T=16384 extra MiB", extra / MIB, 256, at_least=False, stretch=64))
    first, second = new_mod_row()
    print(f"a new mod: first result {first:.2f} s, second process {second:.2f} s", file=out)
    lines.append(target_line("new mod seconds", first, 10, at_least=False, stretch=2))
    lines.append(target_line("cached mod seconds", second, 2, at_least=False, stretch=1))
    t = bf16_row(torch, reps)
    lines.append(target_line("bf16 causal mod vs SDPA bf16", t["SDPA bf16"] / t["flex (flashtile)"],
                             1.0, at_least=True, unit="x", stretch=1.5))  # fmt: skip
    print("", file=out)
    for line in lines:
        print(f"* target: {line}", file=out)
    return 0
