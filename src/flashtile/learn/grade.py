"""The grader process: ``python -m flashtile.learn.grade NAME FILE``.

``flashtile learn check`` runs this module in a separate Python process so
that a learner's endless loop can be stopped from outside and a crash cannot
take the command line down with it. It imports FILE, runs every case of the
exercise NAME and writes one JSON object per line (``ready`` once its own
imports are done, then ``start``, ``result``, ``load_error``, ``done``) to its
original stdout; anything the learner prints goes to stderr so it cannot
corrupt that protocol. Before any learner code runs, :func:`isolate` caps the
files the process writes (its output included) and takes the checker's token,
which marks every event, out of the environment.
"""

from __future__ import annotations

import importlib.util
import json
import numbers
import os
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .cases import CASES, Case, ShapeProblem
from .probe import Probe, instrumented_builtins, keep_tracked, plain, track

try:
    import resource
except ImportError:  # not POSIX: output is not capped
    resource = None

RTOL, ATOL = 1e-6, 1e-9
#: Environment variable through which the checker hands the grader its token.
TOKEN_VARIABLE = "FLASHTILE_GRADE_TOKEN"
#: The most a solution may print (bytes); a write past it raises OSError.
OUTPUT_LIMIT = 16 * 2**20


def learner_traceback(exc: BaseException, path: Path) -> str:
    """The traceback of ``exc`` reduced to the frames in the learner's file."""
    target = os.path.realpath(path)
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == target
    ]
    lines = traceback.format_list(frames) + traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()


def load(path: Path):
    """Import the learner's file as a module (its folder joins ``sys.path``)."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("learner_solution", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path.name} is not a Python file: save your solution as a .py file")
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(instrumented_builtins())  # see probe.instrumented_builtins
    sys.modules["learner_solution"] = module
    spec.loader.exec_module(module)
    return module


def _fmt(value) -> str:
    if isinstance(value, np.ndarray):
        with np.printoptions(precision=4, suppress=True, threshold=24, linewidth=88):
            return np.array2string(np.round(value.astype(float), 4), separator=", ")
    return repr(value)


def _compare_array(got, expected: np.ndarray, label: str) -> dict | None:
    """None if ``got`` matches ``expected``, else what is wrong (one clear message)."""
    what = f"{label}: " if label else ""
    if got is None:
        return {"reason": f"{what}returned None (is a `return` statement missing?)"}
    try:
        arr = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return {"reason": f"{what}returned {type(got).__name__}, not an array of numbers"}
    if arr.shape != expected.shape:
        return {
            "reason": f"{what}wrong shape: expected {expected.shape}, got {arr.shape}",
            "expected": f"shape {expected.shape}",
            "got": f"shape {arr.shape}",
        }
    detail = {"expected": _fmt(expected), "got": _fmt(arr)}
    bad = np.isnan(arr) & ~np.isnan(expected)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        return {"reason": f"{what}result contains NaN (first at index {index})", **detail}
    bad = np.isinf(arr) & np.isfinite(expected)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        return {"reason": f"{what}result contains inf (first at index {index})", **detail}
    if not np.allclose(arr, expected, rtol=RTOL, atol=ATOL, equal_nan=True):
        diff = np.abs(np.where(np.isfinite(expected), arr - expected, 0.0))
        index = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
        return {"reason": f"{what}wrong values (largest error at index {index})", **detail}
    return None


def compare(got, expected, labels: tuple[str, ...] = ()) -> dict | None:
    """Dispatch on the kind of expected value: dict, int, tuple of arrays, array."""
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping):
            return {
                "reason": f"expected a dict with keys {sorted(expected)}, got {type(got).__name__}"
            }
        if set(got) != set(expected):
            return {
                "reason": "wrong keys",
                "expected": repr(sorted(expected)),
                "got": repr(sorted(got)),
            }
        for key, want in expected.items():
            if not isinstance(got[key], numbers.Number) or got[key] != want:
                return {
                    "reason": f"wrong count for {key!r}",
                    "expected": repr(want),
                    "got": repr(got[key]),
                }
        return None
    if isinstance(expected, numbers.Integral):
        if not isinstance(got, numbers.Number) or got != expected:
            return {"reason": "wrong value", "expected": repr(expected), "got": repr(got)}
        return None
    if isinstance(expected, tuple):
        if not isinstance(got, tuple | list) or len(got) != len(expected):
            names = ", ".join(labels)
            return {"reason": f"expected a tuple ({names}); got {type(got).__name__}"}
        for item, want, label in zip(got, expected, labels, strict=True):
            problem = _compare_array(item, np.asarray(want), label)
            if problem:
                return problem
        return None
    return _compare_array(got, np.asarray(expected), "")


def run_case(case: Case, module, path: Path) -> dict:
    """Grade one case: ``{"ok": bool, "reason", "expected", "got", "traceback"}``."""
    fn = getattr(module, case.func, None)
    if not callable(fn):
        return {"ok": False, "reason": f"your file defines no function {case.func}()"}
    args = case.make()
    expected = case.expect(*(a.copy() if isinstance(a, np.ndarray) else a for a in args))
    call_args = list(args)
    probes = []
    for spec in case.streams:
        arr = call_args[spec.arg]
        row_len = arr.shape[-1] if arr.ndim == 2 else 1
        probe = Probe(spec.label, spec.block_size, row_len, spec.mode, spec.unit)
        probes.append(probe)
        call_args[spec.arg] = track(arr, probe)
    try:
        with np.errstate(all="ignore"):  # NaN/overflow are reported as results, not warnings
            got = case.drive(fn, *call_args) if case.drive else fn(*call_args)
    except ShapeProblem as exc:
        return {"ok": False, "reason": str(exc)}
    except BaseException as exc:  # the learner's exception, SystemExit included
        reason = f"your code raised {type(exc).__name__}: {exc}"
        if isinstance(exc, NotImplementedError):
            reason = "not implemented yet: replace the `raise NotImplementedError` with your code"
        # The instrumented array is an ndarray to the learner; do not name our subclass.
        tb = learner_traceback(exc, path).replace("'Tracked'", "'numpy.ndarray'")
        return {
            "ok": False,
            "reason": reason.replace("'Tracked'", "'numpy.ndarray'"),
            "traceback": tb,
        }
    for probe in probes:
        if probe.violations:
            return {
                "ok": False,
                "reason": f"does not stream: {probe.violations[0]}",
                "hint": "keep a running state and look at one block at a time",
            }
    problem = compare(plain(got), expected, case.labels)
    return {"ok": True} if problem is None else {"ok": False, **problem}


def isolate() -> str | None:
    """Cap output and take the checker's token; call before any learner code.

    No file this process (or a child) writes may grow past :data:`OUTPUT_LIMIT`:
    a write beyond fails with ``OSError: File too large`` (Python ignores
    SIGXFSZ), reported like any exception of the learner. The soft and the
    hard limit are both set, so the learner's code cannot raise them again.
    Returns the token (None when run by hand); it leaves the environment, so
    the learner's code and its children do not see it there.
    """
    if resource is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        cap = OUTPUT_LIMIT if hard == resource.RLIM_INFINITY else min(hard, OUTPUT_LIMIT)
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
    return os.environ.pop(TOKEN_VARIABLE, None)


def main(argv: list[str]) -> int:
    """Grade ``FILE`` against exercise ``NAME``; the verdict is in the JSON lines."""
    name, file = argv
    path = Path(file).resolve()
    # Our protocol keeps the real stdout; fd 1 (print, C extensions) becomes stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    token = isolate()

    def emit(**event) -> None:
        if token:  # only lines carrying it count: a solution cannot forge a verdict by accident
            event["token"] = token
        proto.write(json.dumps(event) + "\n")
        proto.flush()

    keep_tracked()
    emit(event="ready")  # the learner's time limit starts here, not at our imports
    try:
        module = load(path)
    except BaseException as exc:
        emit(event="load_error", traceback=learner_traceback(exc, path))
        emit(event="done")
        return 0
    for case in CASES[name]():
        emit(event="start", case=case.name)
        try:
            result = run_case(case, module, path)
        except Exception as exc:  # a grader problem: say so without a flashtile traceback
            result = {"ok": False, "reason": f"the checker could not grade this case ({exc})"}
        emit(event="result", case=case.name, **result)
    emit(event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
