"""CPU-dependent routes: chosen by measurement once per machine, kept in a small cache.

A *route* is a choice between ways of computing the same result whose
ranking depends on the CPU: which BLAS runs the tile products, which gemm
runs bf16 products (or none), how a decode step walks its cache. Measured
on this project's machines, the rankings flip between CPU classes (a
decode step of 4 query rows per kv head ran 3x faster reading the cache
rows in place than through BLAS tiles on an AVX2 AMD EPYC; on an Intel
Xeon with AMX the same loops were no faster), so no fixed rule is right
everywhere.

Each route (:data:`ROUTES`) has candidates, a *fixed rule* (the choice the
code makes with nothing measured: the one measured best on the machines
the rule was written on), an environment variable that forces a candidate,
and a measurement registered by :mod:`flashtile.tune` that times every
candidate on a short representative problem, side by side.

:func:`choice` resolves a route, first match wins:

1. :func:`force` in this process (the measurement itself, ``flashtile
   precompile``'s compilations, tests);
2. the route's environment variable (``FLASHTILE_BLAS``, ``FLASHTILE_BLAS_SMALL``,
   ``FLASHTILE_BF16``, ``FLASHTILE_DECODE_WALK``), read when a call is planned (a prepared call
   keeps its plan until :data:`GENERATION` moves); but the kernels' BLAS
   library is resolved once, at the first call that needs it
   (:func:`flashtile.cpu.blas.backend`): a ``FLASHTILE_BLAS`` set later in
   the process is not read, and :func:`flashtile.cpu.blas.set_backend`
   switches it;
3. this process's earlier answer, or the cache file's entry for this machine;
4. a measurement now, on first use (stored for later processes), unless
   ``FLASHTILE_TUNE=0``; a measurement that fails gives the fixed rule;
5. the fixed rule.

The cache is ``routes.json`` in ``FLASHTILE_CACHE_DIR``, else
``$XDG_CACHE_HOME/flashtile``, else ``~/.cache/flashtile``, keyed by
:func:`.route_cache.machine_key`: the CPU model and its vector features, the kernel
threads, the versions of flashtile and the libraries whose code runs
the candidates, and the kernels' sources; an entry of a route whose ranking moves with another
choice (the decode walks' BLAS tiles with the BLAS that runs them) also
names the context it was measured under (:func:`depends`), and serves only
there. A missing, unreadable or corrupt cache (or one written for
another machine) never fails a call: the route is measured again, or
falls back to the fixed rule. Processes measuring at once do not
coordinate (the last writer's file wins; a lost entry is measured again).
``flashtile tune`` measures every route; ``flashtile precompile`` does
too, after compiling; ``flashtile bench`` prints the routes in force and
why (:func:`report`).

This module imports nothing of flashtile's kernels: the measurements are
registered from above (:func:`register`), so the planners can ask for a
route without an import cycle.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .progress import Progress
from .route_cache import read_cache, write_entry


@dataclass(frozen=True)
class Route:
    """One CPU-dependent choice.

    Attributes:
        name: the key in the cache and in :func:`report`.
        candidates: the choices, in the order they are measured.
        fixed: the fixed rule's choice (one of ``candidates``); empty: the
            first candidate this process can run, in the order :func:`limit`
            registered (a rule that depends on the CPU's features).
        env: the environment variable that forces a candidate.
        doc: what the route decides, one line.
    """

    name: str
    candidates: tuple[str, ...]
    fixed: str
    env: str
    doc: str


#: How decode items walk a cache (:func:`flashtile.workitems.decode_walk`):
#: a route per cache layout, rows per item, head dim and cache length
#: class, since the ranking moves with each (on an AVX2 AMD EPYC, one row
#: per item at d 64 ran 2x faster in BLAS tiles against 2048 keys, and at d
#: 128 2x faster read in place against 8192).
_WALK = "FLASHTILE_DECODE_WALK"
#: Items of several rows over a contiguous cache also measure "tiles-stream",
#: the tiles without the software prefetch of each next tile (the hardware
#: prefetcher's stream alone): measured on Xeons, the prefetch made GQA 32/8,
#: d 128 steps at 65536 keys 1.13-1.23x faster; on a Zen 4 EPYC it made GQA
#: 16/4, d 64 steps 1.06-1.4x slower and 32/8, d 128 no faster (docs/decoding.md).
_LAYOUTS = {
    "contiguous": (("tiles", "rows"), "contiguous cache or pages of a tile or more"),
    "paged": (("tiles", "rows", "head-rows"), "pages smaller than a tile"),
    "tokens": (("head-tiles", "head-rows", "rows", "tiles"),
               "one-token pages of several kv heads (flash-attn's cache)"),
}  # fmt: skip
#: Head dims up to this are the "d64" class, larger ones "d128"; caches of
#: at most SHORT_KEYS keys (the longest sequence) the "short" class; items of
#: 2 to FEW_ROWS query rows the "few" class, more (up to 16) "many" (the
#: row walk's cost grows with the rows, BLAS's hardly: at 16 rows the
#: ranking flips where at 4 it did not).
SMALL_HEAD_DIM, SHORT_KEYS, FEW_ROWS = 96, 4096, 8


def decode_route_name(layout: str, rows: int, head_dim: int, keys: int) -> str:
    """The route of decode items of ``rows`` query rows (1-16), head dim
    ``head_dim``, over a ``layout`` cache whose longest sequence has ``keys``."""
    rows_class = "one" if rows == 1 else "few" if rows <= FEW_ROWS else "many"
    return (
        f"decode.{layout}.{rows_class}"
        f".{'d64' if head_dim <= SMALL_HEAD_DIM else 'd128'}"
        f".{'short' if keys <= SHORT_KEYS else 'long'}"
    )


_ROWS_DOC = {"one": "one query row", "few": "2-8 query rows", "many": "9-16 query rows"}


def _fixed_walk(layout: str, rows: str) -> str:
    """The fixed rules (measured on Emerald Rapids Xeons): BLAS tiles, but
    single rows in small pages read in place; one-token pages gathered."""
    if layout == "tokens":
        return "head-tiles"
    return "rows" if (layout, rows) == ("paged", "one") else "tiles"


_DECODE = tuple(
    Route(
        f"decode.{layout}.{rows}.{d}.{keys}",
        walks + (("tiles-stream",) if layout == "contiguous" and rows != "one" else ()),
        _fixed_walk(layout, rows), _WALK,
        f"{_ROWS_DOC[rows]} per item, head dim "
        f"{'<= 96' if d == 'd64' else '> 96'}, {'<=' if keys == 'short' else '>'} 4096 "
        f"keys, {doc}",
    )
    for layout, (walks, doc) in _LAYOUTS.items()
    for rows in _ROWS_DOC
    for d in ("d64", "d128")
    for keys in ("short", "long")
)  # fmt: skip
_BLAS = Route(
    "blas", ("mkl", "openblas"), "mkl", "FLASHTILE_BLAS",
    "the library of the forward's and backward's tile products (float32)",
)  # fmt: skip
#: With oneMKL running the tile products, which library runs decoding's
#: products of one query row, and of 2 to 7
#: (:data:`flashtile.cpu.blas.SMALL_TILE_ROWS`); ``FLASHTILE_BLAS_SMALL``
#: forces both. MKL's small-call overhead made OpenBLAS faster for a few
#: rows on an Intel Xeon (the fixed rules), and on an AMD EPYC (Zen 4)
#: OpenBLAS was faster for one row too (``flashtile tune``'s decode step of
#: 12 heads against 2048 keys: 0.29 ms against 0.40).
_SMALL = tuple(
    Route(
        f"blas.{rows}", ("openblas", "mkl"), fixed, "FLASHTILE_BLAS_SMALL",
        f"with oneMKL, the library of decoding's tile products of {doc}",
    )
    for rows, fixed, doc in (("one", "mkl", "one query row"), ("few", "openblas", "2-7 query rows"))
)  # fmt: skip
#: With oneMKL running the tile products, which library runs those of a tiny
#: call's tiles (at most :data:`flashtile.planning.TINY_TILE` query rows by as
#: many keys), forward and backward; ``FLASHTILE_BLAS_SMALL`` forces it too. On
#: an AMD EPYC (Zen 4) OpenBLAS ran a (1, 4, 16, 32) causal forward 1.1-1.4
#: us faster (of 16), inside a transformer layer 2.4-3.2 us; at 64 x 64
#: tiles the two were within 1%. The fixed rule keeps oneMKL.
_TINY = Route(
    "blas.tiny", ("openblas", "mkl"), "mkl", "FLASHTILE_BLAS_SMALL",
    "with oneMKL, the library of a tiny call's tile products (forward and backward)",
)  # fmt: skip
_BF16 = Route(
    "bf16", ("vdpbf16ps", "mkl", "widen"), "", "FLASHTILE_BF16",
    "how bfloat16 inputs run their tile products (bf16 gemm, or widened to float32)",
)  # fmt: skip
ROUTES: dict[str, Route] = {route.name: route for route in (_BLAS, *_SMALL, _TINY, _BF16, *_DECODE)}

#: A measurement: ``measure(route, candidates) -> {candidate: seconds}``.
Measure = Callable[[Route, tuple[str, ...]], dict[str, float]]

_lock = threading.RLock()
_measures: dict[str, Measure] = {}
_available: dict[str, Callable[[], tuple[str, ...]]] = {}
_contexts: dict[str, Callable[[Route], str]] = {}
_forced: dict[str, str] = {}
_chosen: dict[str, tuple[str, str]] = {}  # name -> (choice, why), this process's answers
_under: dict[str, str] = {}  # name -> the context of its answer in _chosen (depends)
_check: set[str] = set()  # answers whose context may have moved since (moved)
_reporting = [0]  # > 0 while a report's context is resolved: nothing measures then
_measuring: set[str] = set()
#: ``GENERATION[0]`` moves whenever a route's answer in this process may
#: have changed (forcing, tuning, forgetting, and a change of the BLAS
#: backend, :func:`flashtile.cpu.blas.set_backend`): plans kept across calls
#: compare it to plan again (:mod:`flashtile.frontdoor`; a list read in
#: place: no call on the hot path). A variable changed after a call was
#: planned applies to calls planned afterwards (``FLASHTILE_BLAS`` excepted:
#: read once, see the module docstring).
GENERATION = [0]


def register(name: str, measure: Measure) -> None:
    """Register route ``name``'s measurement (:mod:`flashtile.tune` does)."""
    _measures[name] = measure


def limit(name: str, available: Callable[[], tuple[str, ...]]) -> None:
    """Register which of route ``name``'s candidates this process can run
    (``available()``: e.g. no ``"mkl"`` without oneMKL)."""
    _available[name] = available


def depends(name: str, context: Callable[[Route], str]) -> None:
    """Register what route ``name``'s measurement ran under besides the
    machine (:func:`.route_cache.machine_key`): ``context(route)`` names it, e.g. the
    library that runs the candidates' tile products (with OpenBLAS running
    them, a decode step's BLAS tiles took 5x their time with oneMKL on an
    AVX2 AMD EPYC, and lost to the rows read in place they beat there). An
    entry serves only under the context it was measured in; under another
    (``FLASHTILE_BLAS`` set, :func:`flashtile.cpu.blas.set_backend`) the
    route is measured again, and its entry replaced."""
    _contexts[name] = context


def _context(route: Route) -> str | None:
    """``route``'s context ("" without one; None where its function raised:
    e.g. ``FLASHTILE_BLAS=mkl`` where oneMKL cannot load, which a kernel
    call reports, not a route's answer or a report)."""
    context = _contexts.get(route.name)
    try:
        return "" if context is None else context(route)
    except ValueError:  # (what a BLAS that cannot be used raises: blas.backend)
        return None


def candidates(name: str) -> tuple[str, ...]:
    """Route ``name``'s candidates that can run in this process."""
    route = ROUTES[name]
    usable = _available.get(name)
    return route.candidates if usable is None else usable()


def _fixed(route: Route) -> str:
    usable = candidates(route.name)
    return route.fixed if route.fixed in usable or not usable else usable[0]


def _env_choice(route: Route) -> str | None:
    """The candidate ``route``'s environment variable forces, or None. One
    variable may serve several routes (the decode walks): a value that is a
    candidate of none of them is an error; one that is a candidate of others
    only leaves this route to its own rule."""
    value = os.environ.get(route.env, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in route.candidates:
        return value
    known = sorted({c for r in ROUTES.values() if r.env == route.env for c in r.candidates})
    if value not in known:
        raise ValueError(
            f"{route.env}={value!r} is not one of {known} (or 'auto', which lets the "
            f"measured route choose): unset it or pick one of those"
        )
    return None


def choice(name: str) -> str:
    """Route ``name``'s choice in force (the module docstring gives the order)."""
    # A planner asks on every call: the common case first, the marks before
    # the answer (a mark set meanwhile is settled with the new answer).
    if name not in _check and name not in _forced and not os.environ.get(ROUTES[name].env):
        answer = _chosen.get(name)
        if answer is not None:
            return answer[0]
    return explain(name)[0]


def explain(name: str, measure: bool = True) -> tuple[str, str]:
    """``(choice, why)`` of route ``name``; ``why`` says which rule chose.
    ``measure``: measure a route that has no stored choice (False: report the
    fixed rule without measuring or remembering it; nor do the routes its
    context asks, :func:`depends`)."""
    route = ROUTES[name]
    forced_here = _forced.get(name)  # (no lock: a force may be leaving in another thread)
    if forced_here is not None:  # the measurement, precompile and tests: over the variable too
        return forced_here, "forced in this process"
    forced = _env_choice(route)
    if forced is not None:
        return forced, f"forced by {route.env}"
    with _lock:
        answer = _chosen.get(name)
        if answer is not None and name not in _check:
            return answer
        measure = measure and not _reporting[0]  # (under the lock: this thread's report)
        _reporting[0] += not measure
        try:
            under = _context(route)
        finally:
            _reporting[0] -= not measure
        if under is None:  # (the call itself will raise what the context met)
            return _fixed(route), "fixed rule (its context could not be resolved)"
        if answer is not None and _under.get(name) == under:
            _check.discard(name)  # (only now: until here choice() comes to this lock)
            return answer  # (its context moved back, or never did)
        _chosen.pop(name, None)  # (measured under another context: never given again)
        entry = read_cache().get(name)
        usable = candidates(name)
        if _valid_entry(entry, usable, under):
            answer = (entry["choice"], f"measured ({_times_text(entry)})")
        elif len(usable) < 2:  # (nothing to measure, for a report too)
            answer = (_fixed(route), "fixed rule (one candidate on this machine)")
        elif measure and name in _measures and not _measuring and _lazy_tuning():
            answer, _ = _measure_and_store(route, under)
        elif _measuring or (not measure and _lazy_tuning()):
            # Not remembered: measured on its own first use (a measurement of
            # another route runs meanwhile, or a report was asked for).
            return _fixed(route), "fixed rule (not measured yet)"
        else:
            answer = (_fixed(route), "fixed rule (not measured)")
        if measure or name not in _contexts:  # (a report's context may be provisional)
            _chosen[name], _under[name] = answer, under
            _check.discard(name)
        return answer


def provisional(name: str) -> bool:
    """Whether route ``name``'s answer is not settled in this process: not
    forced (here or by its variable), not remembered (the fixed rule given
    while another route is measured, or by a report). A caller that keeps
    answers keeps none then."""
    if name in _chosen or name in _forced:
        return False
    return _env_choice(ROUTES[name]) is None


def _valid_entry(entry, usable, under: str) -> bool:
    """Whether a cache entry is a choice this process can run, measured under
    context ``under`` (:func:`depends`; "": none), with the times of every
    candidate it can run: an entry stored before a candidate was added (a
    new walk, a library installed since) is measured again."""
    if not (isinstance(entry, dict) and entry.get("choice") in usable):
        return False
    if entry.get("under", "") != under:
        return False
    times = entry.get("times")
    return (
        isinstance(times, dict)
        and all(c in times for c in usable)
        and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in times.values())
    )


def _lazy_tuning() -> bool:
    off = ("0", "off", "no", "false")
    return os.environ.get("FLASHTILE_TUNE", "1").strip().lower() not in off


def moved() -> None:
    """Something a route's answer depends on may have changed (a force, a
    tuning, the BLAS backend): plans kept across calls are planned again
    (:data:`GENERATION`), and a route with a context (:func:`depends`)
    compares it with its answer's on its next use (a measurement's forces
    move a hundred times a second: each only marks them)."""
    with _lock:
        _check.update(_contexts)
        GENERATION[0] += 1


def tune(names: list[str] | None = None) -> dict[str, dict]:
    """Measure routes ``names`` (all registered ones when None) now, store the
    results and use them in this process; returns each route's cache entry."""
    results = {}
    chosen = names if names is not None else list(_measures)
    with _lock, Progress(len(chosen), "tune") as progress:
        for name in chosen:
            progress.show(name)
            route = ROUTES[name]
            _chosen.pop(name, None)
            under = _context(route)
            results[name] = {}
            if under is not None:
                answer, results[name] = _measure_and_store(route, under)
                _chosen[name], _under[name] = answer, under
            progress.step()
        moved()
    return results


def _measure_and_store(route: Route, under: str) -> tuple[tuple[str, str], dict]:
    """``((choice, why), entry)``: time ``route``'s candidates (its registered
    measurement) and store the fastest, with the context ``under``
    (:func:`depends`; asked before: the measurement switches what it names);
    the fixed rule and no entry (``{}``) when it cannot be measured here, or
    when the measurement fails (an allocation, a compilation: never the
    caller's call)."""
    usable = candidates(route.name)
    if len(usable) < 2:
        return (_fixed(route), "fixed rule (one candidate on this machine)"), {}
    _measuring.add(route.name)
    try:
        times = _measures[route.name](route, usable)
    except Exception as error:  # a failed measurement falls back, as documented
        return (_fixed(route), f"fixed rule (the measurement failed: {error!r})"), {}
    finally:
        _measuring.discard(route.name)
    if not times:
        return (_fixed(route), "fixed rule (the measurement timed nothing)"), {}
    entry = {"choice": min(times, key=times.get), "times": times}
    if under:
        entry["under"] = under
    write_entry(route.name, entry)
    return (entry["choice"], f"measured now ({_times_text(entry)})"), entry


def _times_text(entry: dict) -> str:
    """An entry's times, fastest first, and its context (:func:`depends`)."""
    ranked = sorted(entry["times"].items(), key=lambda item: item[1])
    text = ", ".join(f"{c} {t * 1e3:.2f} ms" for c, t in ranked)
    return f"{text}; {entry['under']}" if entry.get("under") else text


@contextlib.contextmanager
def force(name: str, value: str | None) -> Iterator[None]:
    """Within the block, route ``name`` takes ``value`` (None: no forcing),
    over its environment variable too, in every thread of the process. For
    the measurement, precompile's compilations and tests."""
    if value is not None and value not in ROUTES[name].candidates:
        raise ValueError(f"route {name!r} has no candidate {value!r}: {ROUTES[name].candidates}")
    with _lock:
        before = _forced.get(name)
        if value is None:
            _forced.pop(name, None)
        else:
            _forced[name] = value
        moved()
    try:
        yield
    finally:
        with _lock:
            if before is None:
                _forced.pop(name, None)
            else:
                _forced[name] = before
            moved()


def forget() -> None:
    """Drop this process's answers (the next :func:`choice` reads the cache again)."""
    with _lock:
        _chosen.clear()
        moved()


def report(measure: bool = True) -> list[tuple[str, str, str, str]]:
    """``(route, choice, why, what it decides)`` for every route, as in force
    now (``measure``: as :func:`explain`'s)."""
    return [(name, *explain(name, measure), route.doc) for name, route in ROUTES.items()]
