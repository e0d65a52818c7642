"""Smoke test of ``examples/train_tiny_gpt.py``: a few steps at a short context."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the example trains a PyTorch model")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class is created.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_quick_run_matches_sdpa(example, capsys):
    status = example.main(
        ["--quick", "--steps", "6", "--context", "128", "--dtype", "float64", "--no-memory"]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "MATCH" in out
    assert "tokens/s" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(6))
    # float64: the two curves agree to rounding, step by step.
    assert all(abs(float(r[1]) - float(r[2])) < 1e-10 for r in rows)


def test_corpus_and_batches_are_deterministic(example):
    assert example.make_corpus(500, seed=3) == example.make_corpus(500, seed=3)
    args = example.parse_args(["--quick", "--context", "32", "--batch", "2"])
    _, data, _ = example.build(args)
    first = [x for x, _ in example.batches(data, args, 3)]
    again = [x for x, _ in example.batches(data, args, 3)]
    assert all(a.equal(b) for a, b in zip(first, again, strict=True))
    assert first[0].shape == (2, 32)


def test_memory_probe_reports_json():
    cmd = [sys.executable, str(EXAMPLE), "--memory-probe", "flashtile", "--context", "128"]
    # float64: the kernels test_quick_run compiled, so a cold cache costs no extra compile.
    cmd += ["--probe-steps", "1", "--dtype", "float64"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["variant"] == "flashtile"
    assert res["peak_kib"] > 0
