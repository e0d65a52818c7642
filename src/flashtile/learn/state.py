"""Hint progress, remembered between calls in a small JSON file.

The file is ``~/.flashtile/learn.json`` unless the ``FLASHTILE_STATE``
environment variable names another path (the tests point it at a temporary
folder). A missing or unreadable file means "no hints shown yet": losing
the count is harmless, crashing the command over it would not be.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENV_VAR = "FLASHTILE_STATE"


def state_path() -> Path:
    """Where hint progress is stored."""
    custom = os.environ.get(ENV_VAR)
    return Path(custom) if custom else Path.home() / ".flashtile" / "learn.json"


def _load() -> dict:
    try:
        data = json.loads(state_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(data: dict) -> None:
    path = state_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
        tmp.replace(path)  # never leave a half-written file behind
    except OSError as exc:
        print(
            f"flashtile learn: could not save hint progress to {path} ({exc.strerror or exc}); "
            f"set {ENV_VAR} to a writable file to keep it",
            file=sys.stderr,
        )


def _hints(data: dict) -> dict:
    hints = data.get("hints")
    return hints if isinstance(hints, dict) else {}


def hints_shown(name: str) -> int:
    """How many hints of exercise ``name`` have been shown so far."""
    value = _hints(_load()).get(name, 0)
    return value if isinstance(value, int) and value >= 0 else 0


def set_hints_shown(name: str, count: int) -> None:
    """Remember that ``count`` hints of ``name`` have been shown (0 resets)."""
    data = _load()
    hints = _hints(data)
    hints[name] = count
    data["hints"] = hints
    _save(data)
