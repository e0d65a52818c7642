"""Time to first result in a new process: JIT cost is part of the product.

``cold`` runs with an empty Numba cache directory (the first call ever
compiles every kernel it needs); ``warm`` runs again with the cache the cold
run left behind, as every later process does. Each run is a fresh Python that
imports flashtile and calls the forward and the backward once on a small
float32 problem; the time includes the import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_PROBE = """
import json, time
t0 = time.perf_counter()
import numpy as np
import flashtile as ft
q = np.random.default_rng(0).standard_normal((1, 2, 128, 64), dtype=np.float32)
out, lse = ft.attention(q, q, q, causal=True, return_lse=True)
t1 = time.perf_counter()
ft.attention_backward(q, q, q, out, lse, out, causal=True)
t2 = time.perf_counter()
print(json.dumps({"forward": t1 - t0, "forward+backward": t2 - t0}))
"""


def _run(cache_dir: str, probe: str) -> dict[str, float]:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_startup(probe: str = _PROBE) -> dict[str, dict[str, float]]:
    """``{"cold": {...}, "warm": {...}}``: seconds from interpreter start of
    the probe to the first forward and to the first forward+backward.

    ``probe`` is the script each new process runs; it must print one JSON
    object with those two keys (tests pass a cheaper one)."""
    with tempfile.TemporaryDirectory(prefix="flashtile-numba-cache-") as cache_dir:
        cold = _run(cache_dir, probe)
        warm = _run(cache_dir, probe)
    return {"cold": cold, "warm": warm}


def startup_lines(times: dict[str, dict[str, float]]) -> list[str]:
    return [
        f"startup : {kind} (import + first call, new process): forward "
        f"{t['forward']:.2f} s, forward+backward {t['forward+backward']:.2f} s"
        for kind, t in times.items()
    ]
