"""argparse ``type=`` converters shared by the ``flashtile`` subcommands.

Each one turns an option's text into a value or raises
``argparse.ArgumentTypeError``; argparse then prints ``argument --NAME:`` and
the message, so the messages name the expected form and the value given.
This module imports nothing from flashtile: every subcommand may use it.
"""

from __future__ import annotations

import argparse

import numpy as np


def positive_int(text: str) -> int:
    """A positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """A positive number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def number_vector(text: str) -> np.ndarray:
    """A non-empty 1-D float64 array from numbers separated by spaces or commas."""
    try:
        values = [float(tok) for tok in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by spaces or commas, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("the list is empty: give at least one number")
    return np.array(values)


#: The help of a ``--x`` option typed :func:`number_vector`: argparse reads
#: ``--x "-3 1"`` as a missing value, so a leading negative needs ``=``.
VECTOR_HELP = 'e.g. "0 1 5 2 9"; starting with a negative value, write --x="-3 1 2"'
