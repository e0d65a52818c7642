"""The machine a benchmark ran on, and its matmul ceiling.

Absolute times mean little without the machine: the header names the CPU,
its cores and vector ISA, the library versions and thread count, and a
measured float32 matmul rate. Attention is two matmuls plus an ``exp``, so
NumPy's sgemm rate on this machine is the practical ceiling for GFLOP/s.
"""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata

import numpy as np

from .. import route_cache, routes

CEILING_N = 2048


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _usable_cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count()


def machine_info(torch_threads: int | None = None) -> dict:
    """A JSON-ready description of this machine and the software stack.

    ``torch_threads`` is passed in (rather than read here) so that describing
    the machine never imports torch when no torch provider runs.
    """
    from ..cpu import blas

    model, flags = route_cache.cpu_model()
    kernel_blas = blas.backend()
    if kernel_blas == "mkl":
        kernel_blas += f" {_version('mkl')}"
    else:
        kernel_blas += f" (SciPy {_version('scipy')}'s)"
    return {
        "cpu": model,
        "logical_cores": os.cpu_count(),
        "usable_cores": _usable_cores(),
        "isa": flags,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": _version("numba"),
        "kernel_blas": kernel_blas,
        "bf16_path": blas.half_path(),
        # The CPU-dependent routes in force, and why (flashtile.routes).
        "routes": {name: f"{choice} ({why})" for name, choice, why, _ in routes.report()},
        "torch": _version("torch"),
        "torch_threads": torch_threads,
        "flashtile": _version("flashtile"),
    }


def sgemm_gflops(n: int = CEILING_N, reps: int = 3) -> float:
    """Best-of-``reps`` GFLOP/s of one ``(n, n) @ (n, n)`` float32 matmul in NumPy.

    Best, not median: it is a ceiling, and the fastest run is the one least
    disturbed by the rest of the machine.
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)  # warm-up: BLAS threads start, pages fault in
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e9


def header_lines(info: dict, ceiling: float | None) -> list[str]:
    """The machine header as printable lines."""
    isa = " ".join(info["isa"]) or "none of " + "/".join(route_cache.CPU_FEATURES)
    cores = f"{info['logical_cores']} logical"
    if info["usable_cores"] not in (None, info["logical_cores"]):
        cores += f", {info['usable_cores']} usable"
    versions = f"numpy {info['numpy']}, numba {info['numba'] or '-'}, "
    versions += f"kernel BLAS {info['kernel_blas']}, "
    if info["torch"]:
        versions += f"torch {info['torch']}"
        if info["torch_threads"] is not None:
            versions += f" ({info['torch_threads']} threads)"
    else:
        versions += "torch not installed"
    lines = [
        f"machine : {info['cpu']} ({cores}; ISA: {isa})",
        f"software: python {info['python']}, {versions}",
    ]
    if info.get("bf16_path"):  # absent in reports written before it was recorded
        lines.append(f"bfloat16: {info['bf16_path']}")
    lines += _route_lines(info.get("routes", {}))  # absent in older reports
    if ceiling is not None:
        lines.append(
            f"ceiling : NumPy sgemm {CEILING_N}^3 float32 = {ceiling:.0f} GFLOP/s (best of 3)"
        )
    return lines


def _route_lines(chosen: dict[str, str]) -> list[str]:
    """The routes in force: each non-decode route on a line, its family's
    choices appended (``blas.one`` after ``blas``), and the decode walks
    counted by choice (``flashtile tune`` lists each of them)."""
    lines: dict[str, str] = {}
    walks: dict[str, int] = {}
    for name, text in chosen.items():
        family, choice = name.split(".", 1)[0], text.split(" ", 1)[0]
        if family == "decode":
            walks[choice] = walks.get(choice, 0) + 1
        elif family != name and family in lines:  # after its family (ROUTES order)
            why = text[len(choice) :].strip()
            measured = why.startswith("(measured")  # the family's line gives the times
            lines[family] += f"; {name} = {choice}" + ("" if measured else f" {why}")
        else:
            lines[name] = f"route   : {name} = {text}"
    if walks:
        counts = ", ".join(f"{w} {n}" for w, n in sorted(walks.items(), key=lambda i: -i[1]))
        lines["decode"] = (f"route   : decode walks of {sum(walks.values())} classes: {counts} "
                           "(flashtile tune lists them)")  # fmt: skip
    return list(lines.values())
