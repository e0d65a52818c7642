"""Shared fixtures; puts tests/ on ``sys.path`` so tests can ``from dense import ...``.

Also runs flashtile's Triton kernels in Triton's interpreter unless
``TRITON_INTERPRET`` is set (``triton.jit`` reads it when the kernels are
defined, so before any test module loads; see tests/triton_device.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture
def fixed_walks():
    """Decode walks by the fixed rules (:mod:`flashtile.routes`), whatever was
    measured on this machine: for tests about one walk's behaviour (each
    walk against the oracle on every layout is tests/test_routes.py's)."""
    import contextlib

    from flashtile import routes

    with contextlib.ExitStack() as stack:
        for name, route in routes.ROUTES.items():
            if name.startswith("decode."):
                stack.enter_context(routes.force(name, route.fixed))
        yield
