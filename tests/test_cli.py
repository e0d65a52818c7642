"""The ``flashtile`` command line: every subcommand registers itself and runs from ``main``."""

from __future__ import annotations

import pytest

from flashtile.cli import build_parser, main

COMMANDS = ("demo", "trace", "bench", "report", "precompile", "tune", "gpu", "learn", "io", "plot")


def _leaves(parser, name):
    """``(name, parser)`` of the parsers that set ``func``: ``parser`` itself, or
    its subcommands' (``gpu`` sets it on ``gpu compile``)."""
    if parser.get_default("func") is not None:
        return [(name, parser)]
    nested = [a for a in parser._actions if isinstance(a.choices, dict)]
    assert nested, f"{name} sets no func and has no subcommands"
    return [leaf for a in nested for n, p in a.choices.items() for leaf in _leaves(p, n)]


def test_every_subcommand_is_registered_with_the_function_that_runs_it():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert tuple(sub.choices) == COMMANDS
    for name, parser in sub.choices.items():
        for leaf, leaf_parser in _leaves(parser, name):  # gpu -> compile
            func = leaf_parser.get_default("func")
            assert callable(func) and func.__name__ == f"run_{leaf}", leaf


@pytest.mark.parametrize("command", [(), *((c,) for c in COMMANDS)])
def test_help_has_no_tracker_words(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: flashtile")
    assert "issue" not in text.lower()


def test_trace_prints_the_running_max_per_block(capsys):
    assert main(["trace", "--x", "0 1 5 2 9", "--block-size", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:5]]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert [float(row[-3]) for row in rows] == [1, 5, 9]  # m_new after each block


def test_trace_refuses_text_and_names_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["trace", "--x", "1 two 3"])
    err = capsys.readouterr().err
    assert "argument --x: expected numbers separated by spaces or commas, got '1 two 3'" in err


def test_demo_runs(capsys):
    assert main(["demo"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("flashtile demo") and "max |tiled - naive|" in text
