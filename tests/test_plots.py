"""``flashtile plot``: every figure becomes a real PNG; a missing matplotlib names the extra."""

from __future__ import annotations

import argparse
import io
import sys

import numpy as np
import pytest

from flashtile.learn.plots import PLOT_HINT, add_parser, example_mask, plot_memory, run_plot
from flashtile.masks import BlockMask, visible

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plot", *argv])


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5000  # a drawn figure, not an empty canvas


@pytest.mark.parametrize(
    "argv",
    [
        ["memory"],
        ["memory", "--max-T", "256"],
        ["io", "--N", "256", "1024", "--sram", "4096", "64KiB"],
        ["mask"],
        ["mask", "--T", "50", "--block", "16", "--window", "-1", "--pad", "0"],
        ["trace", "--x", "0 1 5 2 9", "--block-size", "2"],
        ["trace", "--x", "1000 1001 1002", "--block-size", "5"],
    ],
)
def test_each_command_writes_a_png(tmp_path, argv):
    pytest.importorskip("matplotlib")
    path = tmp_path / "figure.png"
    out = io.StringIO()
    assert run_plot(_parse(*argv, "--out", str(path)), out=out) == 0
    _assert_png(path)
    assert out.getvalue().strip() == f"wrote {path}"


def test_default_path_is_named_after_the_figure(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    assert run_plot(_parse("trace", "--x", "3 1 4 1 5"), out=out) == 0
    _assert_png(tmp_path / "flashtile-trace.png")
    assert "flashtile-trace.png" in out.getvalue()


def test_example_mask_is_causal_window_and_padding():
    bm, keep = example_mask(tokens=64, block=8, window=24, pad=10)
    idx = np.arange(64)
    assert np.array_equal(keep, visible(idx, idx, 64, 64, True, 24, 0, kv_len=54))
    counts = bm.counts()
    assert sum(counts.values()) == 8 * 8
    assert min(counts.values()) > 0  # the default picture shows all three tile kinds
    assert np.all(bm.states[0, 0][:, -1] == BlockMask.EMPTY)  # keys 56..63 are all padding


def test_bad_options_exit_2(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "x.png"
    assert run_plot(_parse("mask", "--pad", "64", "--out", str(path))) == 2
    assert "--pad 64" in capsys.readouterr().err
    assert run_plot(_parse("mask", "--window", "-3", "--out", str(path))) == 2
    assert run_plot(_parse("io", "--N", "1024", "--out", str(path))) == 2  # one N: no line
    assert run_plot(_parse("io", "--sram", "100", "--out", str(path))) == 2  # M < 4d
    assert not path.exists()
    with pytest.raises(SystemExit):
        _parse("trace", "--x", "")


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    # A None entry in sys.modules makes the import raise ImportError, as if absent.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'flashtile\[plot\]'"):
        plot_memory(tmp_path / "m.png")
    for kind in (["memory"], ["mask"], ["io"], ["trace", "--x", "1 2"]):
        path = tmp_path / f"{kind[0]}.png"
        assert run_plot(_parse(*kind, "--out", str(path)), out=io.StringIO()) == 1
        assert PLOT_HINT in capsys.readouterr().err
        assert not path.exists()
