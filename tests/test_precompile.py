"""``flashtile precompile``: its tasks reach the kernels they are named for."""

from __future__ import annotations

import numpy as np
import pytest

import flashtile.decode
from flashtile.cli import main
from flashtile.precompile import TASKS, precompile


def test_float32_tasks_run_each_float32_kernel(capsys, monkeypatch):
    plans = []
    run_decode = flashtile.decode.run_decode

    def spy(plan):  # which walk each decoding task's plan takes
        plans.append((plan.q.dtype, plan.layout.k.dtype, plan.row_walk))
        return run_decode(plan)

    monkeypatch.setattr(flashtile.decode, "run_decode", spy)
    assert main(["precompile", "--dtype", "float32", "--jobs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [name for name, dtype, *_ in TASKS if dtype == "float32"]
    assert [line.split(":")[0] for line in lines[:-1]] == names
    assert lines[-1].startswith(f"{len(names)} tasks in ")
    f32 = np.dtype(np.float32)
    assert sorted(plans, key=str) == [(f32, f32, False), (f32, f32, True)]  # both walks


def test_precompile_names_what_it_refuses():
    with pytest.raises(ValueError, match=r"unknown dtypes \['float8'\]"):
        precompile(("float32", "float8"))
    with pytest.raises(ValueError, match="jobs must be an integer >= 1, got 0"):
        precompile(("float32",), jobs=0)
