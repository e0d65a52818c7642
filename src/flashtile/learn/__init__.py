"""The learning lab: ``flashtile learn``, ``io``, ``plot``, ``demo`` and ``trace``.

Exercises: :mod:`.catalog` holds the statements, starter files and hints,
:mod:`.cases` the graded cases, :mod:`.grade` the grader that runs in its own
process, :mod:`.runner` the time-limited check that drives it, :mod:`.probe`
the instrumented arrays that tell streaming from whole-row code, :mod:`.state`
the remembered hint progress and :mod:`.cli` the ``learn`` command.

Pictures and models: :mod:`.walkthrough` (``demo``, ``trace``: the algorithm
in text), :mod:`.iomodel` (the HBM-traffic model) and :mod:`.io_table` (its
``io`` report), :mod:`.plots` (``plot``: the same ideas as PNG files).

Nothing here is part of the attention API; the lab only calls it.
"""

from .catalog import EXERCISES, Exercise

__all__ = ["EXERCISES", "Exercise"]
