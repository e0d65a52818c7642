"""Check the API reference before the site is built (``make docs`` runs it).

Every public name of flashtile's namespaces (their ``__all__``) must have a
docstring and appear in a page of docs/api/ (a ``::: dotted.path`` line), so
a name added to the API without its reference fails the build. Names the
namespaces re-export from PyTorch are documented in prose, not here.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

NAMESPACES = (
    "flashtile", "flashtile.torch", "flashtile.torch.flex", "flashtile.distributed",
    "flashtile.triton", "flashtile.flash_attn",
)  # fmt: skip
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.MULTILINE)


def resolve(path: str):
    """The object a dotted path names (a module, then attributes)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"cannot import {path}")


def public_objects(namespaces=NAMESPACES):
    """``(qualified name, object)`` of every name the namespaces export,
    PyTorch's re-exports left out."""
    for ns in namespaces:
        module = importlib.import_module(ns)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            owner = getattr(obj, "__module__", None) or ""
            if owner == "torch" or owner.startswith("torch."):
                continue
            yield f"{ns}.{name}", obj


def problems(pages, namespaces=NAMESPACES) -> list[str]:
    """What is wrong with the reference: names without a docstring, names no
    page documents, directives that name nothing."""
    found, out = {}, []
    for page in pages:
        for path in DIRECTIVE.findall(Path(page).read_text()):
            try:
                found[id(resolve(path))] = path
            except (ImportError, AttributeError):
                out.append(f"{page}: '::: {path}' names nothing")
    for name, obj in public_objects(namespaces):
        # (its own docstring: inspect.getdoc would take a base class's)
        documented = (obj.__doc__ or "").strip() if callable(obj) else True
        if not documented:
            out.append(f"{name} has no docstring")
        if id(obj) not in found and not isinstance(obj, str | int | float | tuple | dict):
            out.append(f"{name} is in no page of docs/api/ (add a '::: {name}' line)")
    return out


def main() -> int:
    pages = sorted(Path("docs/api").glob("*.md"))
    found = problems(pages)
    for line in found:
        print(f"check_docs: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
