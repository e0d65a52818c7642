"""Shared fixtures; puts tests/ on ``sys.path`` so tests can ``from dense import ...``.

Runs the CPU-dependent routes by their fixed rules (below).

Also runs flashtile's Triton kernels in Triton's interpreter unless
``TRITON_INTERPRET`` is set (``triton.jit`` reads it when the kernels are
defined, so before any test module loads; see tests/triton_device.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# The CPU-dependent routes (flashtile.routes) by their fixed rules, whatever
# this machine measured: the same walks on every machine, nothing measured
# inside a test, the user's cache untouched (tests/test_routes.py forces
# every candidate in turn, and plants measurements).
os.environ["FLASHTILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashtile-routes-")
os.environ["FLASHTILE_TUNE"] = "0"
os.environ.pop("FLASHTILE_DECODE_WALK", None)
os.environ.pop("FLASHTILE_BF16", None)
os.environ.pop("FLASHTILE_BLAS_SMALL", None)

import numpy as np
import pytest

# pytest-xdist's workers compile what `flashtile precompile` left out side by
# side: their saves into Numba's cache take its lock (numba/numba#10128).
if os.environ.get("PYTEST_XDIST_WORKER"):
    from flashtile.precompile import lock_cache_saves

    lock_cache_saves()

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, seeded generator per test, so every test is reproducible."""
    return np.random.default_rng(20240526)
