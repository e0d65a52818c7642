"""Progress of long work: a bar with an estimate on a terminal, plain lines elsewhere.

``flashtile precompile``, ``bench`` and ``tune`` run for minutes. On a
terminal they show tqdm's bar (done / total, elapsed, an estimate of what is
left) with the current step beside it; lines they print go above the bar.
Into a file or a pipe (a CI log) the bar is left out and the lines are
printed as they come, so a log reads the same as before.
"""

from __future__ import annotations

import sys


class Progress:
    """``total`` steps of work called ``what``, reported on ``stream``
    (stderr by default; the lines of :meth:`note` go to ``out``, stdout)."""

    def __init__(self, total: int, what: str = "", stream=None, out=None):
        self.stream = stream or sys.stderr
        self.out = out
        self.bar = None
        if total > 1 and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=what, file=self.stream, leave=False)

    def show(self, text: str) -> None:
        """What runs now (beside the bar; nothing without one)."""
        if self.bar is not None:
            self.bar.set_postfix_str(text[:60], refresh=True)

    def step(self) -> None:
        """One step done."""
        if self.bar is not None:
            self.bar.update(1)

    def note(self, line: str) -> None:
        """A line of the work's own output (above the bar on a terminal)."""
        out = self.out or sys.stdout
        if self.bar is not None:
            self.bar.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_) -> None:
        self.close()
