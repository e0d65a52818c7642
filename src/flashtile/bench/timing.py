"""The one timer of ``flashtile bench``: calls timed side by side, in interleaved rounds.

A shared, noisy machine drifts (other jobs, clocks, caches), and on this
project's machines the position of a call within a round alone moved its time
by up to 15%. So the contenders are never timed one after the other: every
round calls each of them once, in a seeded shuffled order, and the next round
runs that order backwards. Each pair of rounds thus gives every contender the
same mean position, the shuffle varies who follows whom, and a slow drift hits
all of them alike. Results are reported as medians, which one disturbed call
cannot move.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from statistics import median

#: Seed of the round order: a rerun times the calls in the same order.
SEED = 0


def round_orders(names: list[str], rounds: int, seed: int = SEED) -> list[list[str]]:
    """The call order of each round: a shuffle, its reverse, a new shuffle, ..."""
    rng = random.Random(seed)
    orders: list[list[str]] = []
    for r in range(rounds):
        orders.append(orders[-1][::-1] if r % 2 else rng.sample(names, len(names)))
    return orders


def interleaved_times(
    calls: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    budget: float | None = None,
    on_call: Callable[[str, int], None] | None = None,
    seed: int = SEED,
) -> dict[str, list[float]]:
    """Seconds of every timed call of each of ``calls``, in call order.

    Args:
        calls: name -> zero-argument function; each is called at most once
            per round (already warmed up: the first timed call counts).
        rounds: rounds to run (>= 1).
        budget: once a function's timed calls add up to ``budget`` seconds it
            sits out the remaining rounds, so a slow contender gets fewer
            calls; every function is timed at least once. None: no limit.
        on_call: called as ``on_call(name, round)`` before each timed call
            (a progress line), outside the timed span.
        seed: seed of the shuffled order (:func:`round_orders`).
    """
    times: dict[str, list[float]] = {name: [] for name in calls}
    spent = dict.fromkeys(calls, 0.0)
    for r, order in enumerate(round_orders(list(calls), rounds, seed)):
        for name in order:
            if budget is not None and times[name] and spent[name] >= budget:
                continue
            if on_call is not None:
                on_call(name, r)
            start = time.perf_counter()
            calls[name]()
            elapsed = time.perf_counter() - start
            times[name].append(elapsed)
            spent[name] += elapsed
    return times


def interleaved_medians(
    calls: Mapping[str, Callable[[], object]], rounds: int, *, seed: int = SEED
) -> dict[str, float]:
    """Median seconds of each of ``calls`` over ``rounds`` interleaved rounds."""
    return {name: median(t) for name, t in interleaved_times(calls, rounds, seed=seed).items()}
