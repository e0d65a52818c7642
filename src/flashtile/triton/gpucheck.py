"""Benchmarks of the Triton kernels on a GPU, side by side with PyTorch SDPA.

Run by ``scripts/gpu_check.sh`` (``python -m flashtile.triton.gpucheck``). It
measures the machine first (a large bfloat16 matmul: the dense MMA rate; a
sum and a copy over 1 GiB: the HBM read and copy bandwidth), then times, each
after checking its output against an fp32 reference:

* the forward and forward+backward, bfloat16, B=4 H=16 T=4096 d=128 causal
  (and non-causal), against SDPA's flash and cuDNN backends;
* decoding, bfloat16, GQA 32/8, Tk=65536, d=128, contiguous and paged,
  against SDPA and the measured read bandwidth (K and V read once).

FLOPs: a forward is ``4 B H Tq Tk d`` (two products), halved when causal; a
backward is 2.5 forwards. Results go to JSON (``$OUT/gpu_check.json`` when
``OUT`` is set) after every section, so a run cut short keeps what it
measured, and a markdown table for docs/benchmarks-gpu.md is printed.

``--dry-run`` runs the same code on CPU tensors under the interpreter with
tiny sizes (``TRITON_INTERPRET=1`` is set before the kernels load): it checks
the script, not the speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F

SIZES = {
    "gpu": {"attn": (4, 16, 4096, 128), "decode": (4, 32, 8, 65536, 128), "matmul": 8192},
    "dry": {"attn": (1, 2, 64, 32), "decode": (2, 4, 2, 96, 32), "matmul": 256},
}


def timer(fn, device: str) -> float:
    """Median milliseconds of ``fn()`` (CUDA events via triton's do_bench on a GPU)."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def machine(device: str, n: int) -> dict:
    """The measured bfloat16 matmul rate (TFLOP/s), copy bandwidth (read + write) and
    read bandwidth (a sum over 1 GiB) in GB/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = timer(lambda: a @ b, device)
    size = 2**30 if device == "cuda" else 2**22
    src = torch.ones(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src), device)
    read_ms = timer(lambda: src.sum(), device)
    return {
        "matmul_tflops": 2 * n**3 / ms / 1e9,
        "copy_gbps": 2 * size / copy_ms / 1e6,
        "read_gbps": size / read_ms / 1e6,
    }


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def sdpa_providers(device: str) -> dict:
    """SDPA with one backend each (on CPU: the default choice)."""
    if device != "cuda":
        return {"sdpa": None}
    from torch.nn.attention import SDPBackend

    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}


def run_sdpa(backend, *args, **kw):
    if backend is None:
        return F.scaled_dot_product_attention(*args, **kw)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(*args, **kw)


def attention_rows(sizes, device: str, peak: float) -> list[dict]:
    """Forward and forward+backward rows, each provider checked before it is timed."""
    import flashtile.triton as ft

    b, h, t, d = sizes
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(b, h, t, d, device=device, dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    )
    rows = []
    math_backend = _math() if device == "cuda" else None
    for causal in (True, False):
        # the reference in float32, and the same math in bfloat16 (FlashAttention's rule)
        ref = run_sdpa(math_backend, q.float(), k.float(), v.float(), is_causal=causal)
        lowp = dense_lowp(q, k, v, causal)
        providers = {"flashtile-triton": lambda x, y, z, c=causal: ft.attention(x, y, z, causal=c)}
        for name, backend in sdpa_providers(device).items():
            providers[name] = lambda x, y, z, be=backend, c=causal: run_sdpa(
                be, x, y, z, is_causal=c
            )
        flops = 4 * b * h * t * t * d / (2 if causal else 1)
        for name, fn in providers.items():
            rows += _time_provider(name, fn, (q, k, v), ref, lowp, flops, causal, device, peak)
    return rows


def dense_lowp(q, k, v, causal: bool) -> torch.Tensor:
    """Attention done densely in the inputs' precision, every product and the softmax
    rounded to it (SDPA's math backend may compute half precision in float32)."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        t = s.shape[-1]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def _math():
    from torch.nn.attention import SDPBackend

    return SDPBackend.MATH


def _time_provider(name, fn, qkv, ref, lowp, flops, causal, device, peak) -> list[dict]:
    """Check ``fn`` against ``ref`` (FlashAttention's rule), then time fwd and fwd+bwd."""
    base = {"provider": name, "causal": causal}
    try:
        out = fn(*qkv)
    except Exception as exc:  # a backend that does not support the shape
        return [{**base, "pass": "forward", "error": f"{type(exc).__name__}: {exc}"[:200]}]
    err, base_err = rel(out, ref), rel(lowp, ref)
    ok = err <= 2 * base_err + 1e-6
    rows = []
    ms = timer(lambda: fn(*qkv), device)
    rows.append(
        {
            **base,
            "pass": "forward",
            "ms": ms,
            "tflops": flops / ms / 1e9,
            "of_matmul_peak": flops / ms / 1e9 / peak,
            "err": err,
            "sdpa_math_err": base_err,
            "accurate": ok,
        }
    )
    leaves = [t.detach().requires_grad_(True) for t in qkv]
    dout = torch.randn_like(out)

    def step():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dout)

    try:
        ms = timer(step, device)
    except Exception as exc:
        rows.append({**base, "pass": "fwd+bwd", "error": f"{type(exc).__name__}: {exc}"[:200]})
        return rows
    rows.append(
        {
            **base,
            "pass": "fwd+bwd",
            "ms": ms,
            "tflops": 3.5 * flops / ms / 1e9,
            "of_matmul_peak": 3.5 * flops / ms / 1e9 / peak,
        }
    )
    return rows


def decode_rows(sizes, device: str, bandwidth: float) -> list[dict]:
    """Decoding one query per sequence against a long contiguous and a paged cache."""
    import flashtile.triton as ft

    b, hq, hk, tk, d = sizes
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(b, hq, 1, d, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(b, hk, tk, d, device=device, dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    page = 256 if tk % 256 == 0 else tk
    table = torch.arange(b * tk // page, device=device, dtype=torch.int32).reshape(b, -1)
    kp, vp = (
        c.reshape(b, hk, -1, page, d).transpose(1, 2).reshape(-1, hk, page, d) for c in (k, v)
    )
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    nbytes = 2 * k.numel() * k.element_size()
    providers = {
        "flashtile-triton": lambda: ft.decode_attention(q, k, v, causal=False),
        "flashtile-triton-paged": lambda: ft.decode_attention(
            q, kp, vp, block_table=table, causal=False
        ),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    rows = []
    for name, fn in providers.items():
        try:
            err = rel(fn(), ref)
            ms = timer(fn, device)
        except Exception as exc:
            rows.append({"provider": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        gbps = nbytes / ms / 1e6
        rows.append(
            {
                "provider": name,
                "ms": ms,
                "gbps": gbps,
                "of_read_bandwidth": gbps / bandwidth,
                "err": err,
                "accurate": err < 2e-2,
            }
        )
    return rows


def markdown(report: dict) -> str:
    """The tables for docs/benchmarks-gpu.md."""
    m = report["machine"]
    lines = [
        f"Device: {report['device']}; torch {report['torch']}, triton {report['triton']}.",
        f"Measured bf16 matmul: {m['matmul_tflops']:.4g} TFLOP/s; read: "
        f"{m['read_gbps']:.4g} GB/s; copy (read + write): {m['copy_gbps']:.4g} GB/s.",
        "",
        "| provider | causal | pass | ms | TFLOP/s | of matmul peak | vs best SDPA |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    rows = report.get("attention", [])
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['provider']} | {r['causal']} | {r['pass']} | {r['error']} |||| ")
            continue
        sdpa = [
            x["ms"]
            for x in rows
            if x["provider"].startswith("sdpa")
            and "ms" in x
            and x["causal"] == r["causal"]
            and x["pass"] == r["pass"]
        ]
        speed = f"{min(sdpa) / r['ms']:.2f}x" if sdpa else "-"
        lines.append(
            f"| {r['provider']} | {r['causal']} | {r['pass']} | {r['ms']:.3f} | "
            f"{r['tflops']:.4g} | {r['of_matmul_peak']:.0%} | {speed} |"
        )
    lines += [
        "",
        "| decoding provider | ms | GB/s of K/V | of read bandwidth |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in report.get("decode", []):
        if "ms" in r:
            lines.append(
                f"| {r['provider']} | {r['ms']:.3f} | {r['gbps']:.4g} | "
                f"{r['of_read_bandwidth']:.0%} |"
            )
        else:
            lines.append(f"| {r['provider']} | {r['error']} |||")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU, interpreter")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for all sections")
    parser.add_argument("--json", help="output path (default: $OUT/gpu_check.json or ./)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    import triton

    from .tuning import chosen

    device = "cpu" if args.dry_run else "cuda"
    sizes = SIZES["dry" if args.dry_run else "gpu"]
    path = args.json or os.path.join(os.environ.get("OUT", "."), "gpu_check.json")
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    report = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dry_run": args.dry_run,
        "sizes": sizes,
    }
    start = time.perf_counter()
    sections = (
        ("machine", lambda: machine(device, sizes["matmul"])),
        (
            "attention",
            lambda: attention_rows(sizes["attn"], device, report["machine"]["matmul_tflops"]),
        ),
        ("decode", lambda: decode_rows(sizes["decode"], device, report["machine"]["read_gbps"])),
    )
    for key, section in sections:
        if time.perf_counter() - start > args.budget:
            report[key] = {"skipped": "time budget"}
            continue
        report[key] = section()
        report["tuned"] = chosen()
        report["seconds"] = round(time.perf_counter() - start, 1)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    print(markdown(report))
    print(f"\nwrote {path} in {report['seconds']} s")
    bad = [
        r
        for r in report.get("attention", []) + report.get("decode", [])
        if r.get("accurate") is False and r.get("provider", "").startswith("flashtile")
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
