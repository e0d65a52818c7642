"""Pick each kernel's fastest configuration per shape class, once, on the GPU.

The candidates are the short lists of :mod:`.configs`; the first call of a
shape class times each (``triton.testing.do_bench``) and remembers the
winner for the process. ``FLASHTILE_TRITON_TUNE=0`` skips the timing and
takes each list's first entry (a deterministic choice, e.g. for profiling).
Every kernel rewrites its outputs completely, so timing a launch several
times leaves the right result behind; the one exception, the gradients of
the tables a user's mods capture (atomic adds), is cleared by the launcher
before the launch that counts. Under the interpreter nothing is timed:
:data:`.configs.INTERPRET` is used.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Hashable
from dataclasses import replace

from .configs import INTERPRET, Config, candidates
from .tiles import INTERPRET as INTERPRETING

_CHOSEN: dict[Hashable, Config] = {}


def pick(
    kernel: str, element_bytes: int, block_d: int, key: Hashable, launch: Callable, fits=None
) -> Config:
    """The configuration to launch ``kernel`` with; ``launch(config)`` runs it once.
    ``fits(kernel, config)``: whether the call can use a configuration (a
    block mask's blocks must hold whole tiles); ValueError when none can."""
    options = [INTERPRET[kernel]] if INTERPRETING else candidates(kernel, element_bytes, block_d)
    if fits is not None:
        options = _fitting(kernel, options, fits)
    if INTERPRETING:
        return options[0]
    full_key = (kernel, element_bytes, block_d, key)
    if len(options) == 1 or os.environ.get("FLASHTILE_TRITON_TUNE", "1") == "0":
        return options[0]
    if full_key not in _CHOSEN:
        from triton.runtime.errors import OutOfResources
        from triton.testing import do_bench

        times = []
        for config in options:
            try:
                times.append(do_bench(lambda c=config: launch(c), warmup=5, rep=20))
            except OutOfResources:  # a GPU with less shared memory than an A100
                times.append(math.inf)
        if min(times) == math.inf:
            raise RuntimeError(f"no configuration of {kernel} fits this GPU: {options}")
        _CHOSEN[full_key] = options[times.index(min(times))]
    return _CHOSEN[full_key]


#: The smallest tile a configuration shrinks to for a block mask (``tl.dot``'s minimum).
MIN_TILE = 16


def _fitting(kernel: str, options: list[Config], fits) -> list[Config]:
    """The ``options`` that ``fits`` allows; where none does (a block mask of
    blocks smaller than the tiles), each option with its tiles halved until
    they fit, the largest first; ValueError when not even ``MIN_TILE`` does."""
    usable = [c for c in options if fits(kernel, c)]
    if usable:
        return usable
    shrunk = []
    for c in options:
        sizes = [(m, n) for m in _halvings(c.block_m) for n in _halvings(c.block_n)]
        warps = min(c.num_warps, 4)  # (8 warps over a 16 x 16 tile would idle)
        tried = (
            replace(c, block_m=m, block_n=n, num_warps=warps)
            for m, n in sorted(sizes, key=lambda t: -t[0] * t[1])
        )
        best = next((s for s in tried if fits(kernel, s)), None)
        if best is not None and best not in shrunk:
            shrunk.append(best)
    if not shrunk:
        raise ValueError(
            f"the block mask's blocks do not hold whole tiles of {kernel} (at least "
            f"{MIN_TILE} x {MIN_TILE}): build it with BLOCK_SIZE a multiple of {MIN_TILE}"
        )
    return shrunk


def _halvings(size: int) -> list[int]:
    """``size``, ``size / 2``, ... down to :data:`MIN_TILE`."""
    return [size >> i for i in range(size.bit_length()) if size >> i >= MIN_TILE]


def chosen() -> dict[str, str]:
    """What the tuner picked so far, ``{"kernel dtype-bytes d=.. key": "M..-N..-w..-s.."}``."""
    return {f"{k[0]} {k[1]}B d={k[2]} {k[3]}": c.label() for k, c in _CHOSEN.items()}
