"""The half-precision targets side by side in one process (2 threads, wall
time, medians of shuffled interleaved rounds), B=1, H=8, d=64:

- forward T=4096, full and causal: flashtile on bfloat16 inputs against
  flashtile on the same values in float32 and against torch SDPA in bf16;
- forward+backward T=2048 causal: flashtile (NumPy), ``flashtile.torch``
  and SDPA, all bf16.

usage: python scripts/bf16_rows.py [rounds]

``flashtile bench --dtype bfloat16`` times flashtile against SDPA; this
script adds the comparison with flashtile's own float32 path, which the
bench's providers (one dtype per run) cannot make in one process.
"""

import random
import statistics
import sys
import time

import ml_dtypes
import numpy as np
import torch.nn.functional as F

import flashtile
import flashtile.torch as ftt
from flashtile.torch.arrays import as_tensor

B, H, D = 1, 8, 64


def cases() -> dict:
    """(T, mode, causal, provider) -> zero-argument callable."""
    rng = np.random.default_rng(0)
    out = {}
    for t, mode in ((4096, "fwd"), (2048, "fwd+bwd")):
        bf = [rng.standard_normal((B, H, t, D), dtype=np.float32) for _ in range(4)]
        bf = [a.astype(ml_dtypes.bfloat16) for a in bf]
        f32 = [a.astype(np.float32) for a in bf]
        tb = [as_tensor(a) for a in bf]
        for causal in (False, True) if mode == "fwd" else (True,):
            key = (t, mode, causal)
            if mode == "fwd":
                out[(*key, "flashtile bf16")] = lambda b=bf, c=causal: flashtile.attention(
                    *b[:3], causal=c
                )
                out[(*key, "flashtile f32")] = lambda b=f32, c=causal: flashtile.attention(
                    *b[:3], causal=c
                )
                out[(*key, "sdpa bf16")] = lambda b=tb, c=causal: F.scaled_dot_product_attention(
                    *b[:3], is_causal=c
                )
                continue
            out[(*key, "flashtile bf16")] = lambda b=bf, c=causal: _numpy_step(b, c)
            out[(*key, "flashtile.torch bf16")] = lambda b=tb, c=causal: _torch_step(
                ftt.attention, b, causal=c
            )
            out[(*key, "sdpa bf16")] = lambda b=tb, c=causal: _torch_step(
                F.scaled_dot_product_attention, b, is_causal=c
            )
    return out


def _numpy_step(b, causal):
    out, lse = flashtile.attention(*b[:3], causal=causal, return_lse=True)
    flashtile.attention_backward(*b[:3], out, lse, b[3], causal=causal)


def _torch_step(fn, b, **flags):
    q, k, v = (x.clone().requires_grad_() for x in b[:3])
    fn(q, k, v, **flags).backward(b[3])


def main(rounds: int) -> None:
    fns = cases()
    for fn in fns.values():  # compile and warm up
        fn()
    times = {key: [] for key in fns}
    for _ in range(rounds):
        order = list(fns)
        random.shuffle(order)
        for key in order:
            t0 = time.perf_counter()
            fns[key]()
            times[key].append(time.perf_counter() - t0)
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    for key, ms in med.items():
        print(f"{key}: {ms:.1f} ms")
    for t, mode, causal in sorted({key[:3] for key in med}):
        own, sdpa = med[(t, mode, causal, "flashtile bf16")], med[(t, mode, causal, "sdpa bf16")]
        line = f"{mode} T={t} {'causal' if causal else 'full'}: vs SDPA bf16 {sdpa / own:.2f}x"
        f32 = med.get((t, mode, causal, "flashtile f32"))
        if f32 is not None:
            line += f", vs flashtile float32 {f32 / own:.2f}x"
        op = med.get((t, mode, causal, "flashtile.torch bf16"))
        if op is not None:
            line += f", flashtile.torch vs SDPA {sdpa / op:.2f}x"
        print(line)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
