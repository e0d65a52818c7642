"""Reference solutions of ``flashtile learn``, written the way a learner would.

Each module is a complete answer file: ``flashtile learn hint NAME --solution``
prints it and the tests run it through ``learn check`` like any other file.
"""
