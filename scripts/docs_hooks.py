"""MkDocs hooks of the documentation site (mkdocs.yml names this file).

``api/cli.md`` holds a marker that becomes the help of every ``flashtile``
command, written from the parser itself at build time, so the page cannot
drift from the code.
"""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- flashtile-cli -->"


def _subparsers(parser: argparse.ArgumentParser):
    """``(name, parser)`` of every subcommand, nested ones (``learn show``) too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, deeper in _subparsers(sub):
                    yield f"{name} {inner}", deeper


def cli_reference() -> str:
    """The help of ``flashtile`` and of each subcommand, as Markdown."""
    from flashtile.cli import build_parser

    os.environ["COLUMNS"] = "88"  # (argparse wraps to the terminal's width)
    parser = build_parser()
    parts = [f"```text\n{parser.format_help().rstrip()}\n```"]
    for name, sub in _subparsers(parser):
        parts.append(f"## flashtile {name}\n\n```text\n{sub.format_help().rstrip()}\n```")
    return "\n\n".join(parts)


def on_page_markdown(markdown: str, page, **_) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
