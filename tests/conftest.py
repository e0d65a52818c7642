"""Shared fixtures; puts tests/ on ``sys.path`` so tests can ``from dense import ...``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, seeded generator per test, so every test is reproducible."""
    return np.random.default_rng(20240526)
