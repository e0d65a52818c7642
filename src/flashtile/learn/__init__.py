"""``flashtile learn``: exercises on the online softmax and FlashAttention.

:mod:`.catalog` holds the statements, starter files and hints, :mod:`.cases`
the graded cases, :mod:`.grade` the grader that runs in its own process,
:mod:`.runner` the time-limited check that drives it, :mod:`.probe` the
instrumented arrays that tell streaming from whole-row code, :mod:`.state`
the remembered hint progress and :mod:`.cli` the command line hooks.
"""

from .catalog import EXERCISES, Exercise
from .cli import add_learn_parser, run_learn

__all__ = ["EXERCISES", "Exercise", "add_learn_parser", "run_learn"]
