"""The Triton kernels compiled ahead of time for sm_80 and sm_90 (no GPU needed).

``flashtile.triton.compile_report`` runs Triton's whole pipeline, down to a
cubin with the ptxas in Triton's wheel. Each compile takes seconds, so the
suite compiles each kernel's worst case per architecture and dtype (every
variant on, head dim 200 padded to 256, the largest tiles; and a user's mods
with a block mask); the complete
report (about 200 compiles) is ``flashtile gpu compile``.
"""

import argparse
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

import flashtile.triton as ft
from flashtile.triton.cli import add_parser
from flashtile.triton.compile import KERNELS, MOD_KERNELS, SHARED_LIMIT, summary


def test_every_kernel_compiles_for_sm80_and_sm90_within_shared_memory():
    # bfloat16, the dtype of the GPU targets; float16 shares its tile sizes and
    # float32's (smaller, IEEE products) are in the complete report.
    jobs = min(2, os.cpu_count() or 1)
    rows = ft.compile_report((80, 90), dtypes=("bf16",), worst_only=True, jobs=jobs)
    assert len(rows) == 2 * (len(KERNELS) + len(MOD_KERNELS))
    assert all(r["ok"] for r in rows), summary(rows)
    for r in rows:
        assert 0 <= r["shared_bytes"] <= SHARED_LIMIT[r["arch"]]
        assert r["head_dim"] == 200
    # every kernel with every variant on, and those that take mods with a
    # learned bias and a document mask (a block mask's walk)
    assert sorted((r["kernel"], r["variants"]) for r in rows if r["arch"] == 90) == sorted(
        [(k, "all") for k in KERNELS] + [(k, "mods") for k in MOD_KERNELS]
    )


def test_a_kernel_over_the_shared_memory_limit_is_reported_not_ok():
    rows = ft.compile_report(
        (90,), dtypes=("fp32",), head_dims=(64,), kernels=("attn_bwd_delta",), limits={90: 16}
    )
    assert rows and not any(r["ok"] for r in rows)
    assert all("shared memory" in r["error"] and r["shared_bytes"] > 16 for r in rows)


def test_gpu_compile_command(capsys):
    parser = argparse.ArgumentParser(prog="flashtile")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["gpu", "compile", "--arch", "90", "--dtype", "fp32", "--head-dim", "64",
         "--kernel", "attn_bwd_delta", "--jobs", "1"]
    )  # fmt: skip
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "attn_bwd_delta" in out and "sm_90" in out
    with pytest.raises(SystemExit):
        parser.parse_args(["gpu", "compile", "--kernel", "nonsense"])


def test_report_arguments_are_checked():
    with pytest.raises(ValueError, match="compute capabilities"):
        ft.compile_report(("sm_90",))
    with pytest.raises(ValueError, match="unknown"):
        ft.compile_report((90,), dtypes=("fp8",))


def test_the_gpu_parser_imports_neither_torch_nor_triton():
    """flashtile's CLI builds every command's parser on each call."""
    code = (
        "import argparse, sys; from flashtile.triton.cli import add_parser; "
        "add_parser(argparse.ArgumentParser().add_subparsers()); "
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sys.modules.keys()"
    )
    src = os.path.dirname(os.path.dirname(os.path.dirname(ft.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
