"""The documentation: the tutorial runs as a notebook and prints what it
shows, the API reference covers every public name, and the site's strict
build fails on a broken link (planted in a temporary copy)."""

from __future__ import annotations

import importlib
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _same_output(got: str, shown: str) -> bool:
    """Printed text against the text a page shows: the words equal, numbers
    within 1e-3 relative, or both below 1e-5: errors at float32's rounding
    level, which another BLAS or CPU sums differently (a wrong result is
    far above it)."""
    lines_got = [line.rstrip() for line in got.strip("\n").splitlines()]
    lines_shown = [line.rstrip() for line in shown.strip("\n").splitlines()]
    if len(lines_got) != len(lines_shown):
        return False
    for a, b in zip(lines_got, lines_shown, strict=True):
        if NUMBER.sub("#", a).split() != NUMBER.sub("#", b).split():
            return False
        for x, y in zip(NUMBER.findall(a), NUMBER.findall(b), strict=True):
            fx, fy = float(x), float(y)
            if not (math.isclose(fx, fy, rel_tol=1e-3) or max(abs(fx), abs(fy)) < 1e-5):
                return False
    return True


def _shown_after(cell) -> str | None:
    """The output a Markdown cell shows first (a plain ``` block), or None."""
    text = cell.source.lstrip("\n")
    if cell.cell_type != "markdown" or not text.startswith("```\n"):
        return None
    return text[4:].split("\n```", 1)[0]


def _script(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_tutorial_runs_as_a_notebook_and_prints_what_it_shows(tmp_path):
    for package in ("jupytext", "nbclient", "ipykernel"):
        pytest.importorskip(package)
    nb = _script("tutorial_notebook").execute(cwd=tmp_path)  # a cell that raises fails here
    assert sum(c.cell_type == "code" for c in nb.cells) >= 12
    checked = 0
    for cell, after in zip(nb.cells, nb.cells[1:], strict=False):
        shown = _shown_after(after)
        if cell.cell_type != "code" or shown is None:
            continue
        printed = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert _same_output(printed, shown), (
            f"the tutorial shows\n{shown}\nafter\n{cell.source}\nbut it printed\n{printed}"
        )
        checked += 1
    assert checked >= 10


def test_the_output_comparison_can_fail():
    assert _same_output("max err 7.77e-16\nsum 1.368", "max err 8.9e-8\nsum 1.368")
    assert not _same_output("max err 2e-4", "max err 8.9e-8")
    assert not _same_output("sum 1.368", "sum 1.468")
    assert not _same_output("sum 1.368", "total 1.368")
    assert not _same_output("a\nb", "a")


def test_every_public_name_is_in_the_reference(tmp_path, monkeypatch):
    check_docs = _script("check_docs")
    assert check_docs.problems(sorted((ROOT / "docs" / "api").glob("*.md"))) == []
    fake = types.ModuleType("planted_api")

    def undocumented(x):
        return x

    def documented(x):
        """Documented."""
        return x

    fake.undocumented, fake.documented = undocumented, documented
    fake.__all__ = ["documented", "undocumented"]
    monkeypatch.setitem(sys.modules, "planted_api", fake)
    page = tmp_path / "planted.md"
    page.write_text("::: planted_api.documented\n\n::: planted_api.missing\n")
    found = check_docs.problems([page], namespaces=("planted_api",))
    assert any("'::: planted_api.missing' names nothing" in p for p in found)
    assert any("planted_api.undocumented has no docstring" in p for p in found)
    assert any("planted_api.undocumented is in no page" in p for p in found)
    assert not any("planted_api.documented" in p and "::: planted_api.documented" not in p
                   for p in found)  # fmt: skip


def test_the_strict_site_build_fails_on_a_broken_link(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed")
    for name in ("docs", "scripts"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    config = (ROOT / "mkdocs.yml").read_text().replace("paths: [src]", f"paths: [{ROOT / 'src'}]")
    (tmp_path / "mkdocs.yml").write_text(config)
    with (tmp_path / "docs" / "index.md").open("a") as page:
        page.write("\nSee [the missing page](missing.md).\n")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [str(mkdocs), "build", "--strict"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode != 0 and "missing.md" in done.stderr


def test_the_benchmark_page_is_drawn_from_the_kept_runs(tmp_path):
    """docs/benchmarks.md is `flashtile report docs/bench/*.json`, byte for
    byte, and its plots are drawn from the same files."""
    from flashtile.bench import page

    runs = page.load(sorted((ROOT / "docs" / "bench").glob("*.json")))
    presets = {run["config"]["preset"] for _, run in runs}
    assert {"core", "torch-op", "calls", "variants", "decode", "flex", "generate"} <= presets
    images = {caption: f"img/{name}" for caption, name in page.captions(runs).items()}
    text = page.page(runs, images)
    assert text == (ROOT / "docs" / "benchmarks.md").read_text()
    # (a readable page: one run per preset; a section run on another BLAS
    # or CPU than the page's names its own, a line or two each)
    assert len(text.splitlines()) < 320
    for name in images.values():
        assert (ROOT / "docs" / name).is_file()
    page.plots(runs, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(page.captions(runs).values())


def test_the_rerun_command_names_every_option_that_is_not_a_default():
    from flashtile.bench import page

    config = {"preset": "core", "reps": 5, "dtype": "bfloat16", "no_memory": True, "B": 2}
    line = page.command("x", {"config": config})
    assert line == (
        "flashtile bench --preset core --B 2 --dtype bfloat16 --no-memory --json docs/bench/x.json"
    )
