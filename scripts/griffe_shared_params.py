"""A griffe extension for flashtile's docstrings (mkdocs.yml loads it).

flashtile documents parameters that share a meaning on one line of an
``Args:`` section (``k, v: (B, Hkv, Tk, d) keys and values``). Google style,
as griffe parses it, wants one name per entry, so this extension writes such
an entry once per name before the docstring is parsed; a name that is not a
parameter still fails the strict build.
"""

from __future__ import annotations

import re

import griffe

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Keyword Arguments):\s*$")
_SHARED = re.compile(r"^(\s+)(\**\w+(?:\s*,\s*\**\w+)+)\s*:(.*)$")


def split_shared(text: str) -> str:
    """``text`` with each ``a, b: description`` entry of an arguments section
    written as ``a: description`` and ``b: description``."""
    lines, out, section = text.splitlines(), [], None
    n = 0
    while n < len(lines):
        line = lines[n]
        head = _SECTION.match(line)
        if head:
            section = len(head.group(1))
        elif line.strip() and section is not None and _indent(line) <= section:
            section = None  # the section ended
        entry = _SHARED.match(line) if section is not None else None
        if entry is None:
            out.append(line)
            n += 1
            continue
        indent = len(entry.group(1))
        body = [entry.group(3)]
        n += 1
        while n < len(lines) and (not lines[n].strip() or _indent(lines[n]) > indent):
            body.append(lines[n])
            n += 1
        for name in entry.group(2).split(","):
            out.append(f"{entry.group(1)}{name.strip()}:{body[0]}")
            out.extend(body[1:])
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


class SharedParameters(griffe.Extension):
    def on_function_instance(self, *, func: griffe.Function, **_) -> None:
        if func.docstring is not None:
            func.docstring.value = split_shared(func.docstring.value)

    def on_class_instance(self, *, cls: griffe.Class, **_) -> None:
        if cls.docstring is not None:
            cls.docstring.value = split_shared(cls.docstring.value)
