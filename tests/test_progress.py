"""flashtile.progress: a bar on a terminal, the plain lines elsewhere."""

from __future__ import annotations

import io

from flashtile.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal():
    err, out = io.StringIO(), io.StringIO()
    with Progress(3, "work", stream=err, out=out) as progress:
        for n in range(3):
            progress.show(f"step {n}")
            progress.step()
            progress.note(f"done {n}")
    assert out.getvalue() == "done 0\ndone 1\ndone 2\n" and err.getvalue() == ""


def test_a_bar_with_an_estimate_on_a_terminal():
    err, out = _Terminal(), io.StringIO()
    with Progress(4, "work", stream=err, out=out) as progress:
        progress.show("first")
        progress.step()
        progress.show("second")  # (tqdm draws an update at most every 0.1 s; a step shows)
        progress.note("a line")
        shown = err.getvalue()
    assert "work" in shown and "1/4" in shown and "second" in shown and "<" in shown  # eta
    assert "a line" in out.getvalue()
