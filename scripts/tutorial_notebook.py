"""docs/tutorial.md as a notebook: read with jupytext, run top to bottom with
nbclient (the ``python3`` kernel of this environment, its ``bin`` first on
``PATH`` so that ``!flashtile`` runs its command line).

``python scripts/tutorial_notebook.py OUT.ipynb`` writes the executed
notebook (``make notebook``); tests/test_docs.py runs :func:`execute` and
checks the outputs against those the page shows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parent.parent / "docs" / "tutorial.md"


def execute(source: Path = TUTORIAL, cwd: Path | None = None, timeout: int = 60):
    """The notebook of ``source`` after running every cell (``cwd``: where
    the cells run; a cell that raises raises ``CellExecutionError``)."""
    import jupytext
    import nbclient

    nb = jupytext.read(source)
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    where = str(cwd or source.parent)
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": where}}
    )
    client.execute(env=env)
    return nb


def main(argv: list[str]) -> int:
    import nbformat

    out = Path(argv[0]) if argv else TUTORIAL.with_suffix(".ipynb")
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(execute(cwd=out.parent), out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
