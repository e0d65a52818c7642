"""``flashtile learn check``: run the grader process with a time limit and report.

The grader (:mod:`flashtile.learn.grade`) streams one JSON event per line, so
when the time limit stops it the last ``start`` without a ``result`` names
the case that hung, and the cases after it are listed as not run. The limit
counts the learner's code only: it starts at the grader's ``ready`` event,
after the interpreter has started and imported NumPy and flashtile (seconds
on a busy machine), which get :data:`STARTUP_LIMIT` of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from .cases import CASES

_INDENT = " " * 8
#: Seconds the grader may take to start and import, before the learner's limit.
STARTUP_LIMIT = 120.0
_POLL = 0.02


def _grader_env() -> dict[str, str]:
    """The environment of the grader: this flashtile first on its import path."""
    env = os.environ.copy()
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def run_grader(name: str, path: Path, timeout: float) -> tuple[list[dict], bool, int, str]:
    """Run the grader; return ``(events, timed_out, exit code, stderr tail)``.

    ``timeout`` seconds start at the grader's ``ready`` event; before it, the
    grader has :data:`STARTUP_LIMIT` seconds to start.
    """
    cmd = [sys.executable, "-m", "flashtile.learn.grade", name, str(path)]
    # Both streams go to files, not pipes: a print loop cannot fill memory or
    # block the child on a full pipe, and the events can be read while it runs.
    # The events file is in append mode: the child shares its offset, so our
    # seek to read it must not move where the child writes.
    with (
        tempfile.TemporaryFile("a+", encoding="utf-8", errors="replace") as out,
        tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err,
    ):
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True, env=_grader_env()
        )
        timed_out = _wait(proc, out, timeout)
        out.seek(0)
        stdout = out.read()
        err.seek(0, os.SEEK_END)
        err.seek(max(0, err.tell() - 4000))
        tail = err.read()
    events = []
    for line in stdout.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # not ours (a partial last line of a killed grader)
    return events, timed_out, proc.returncode, tail


def _wait(proc: subprocess.Popen, out, timeout: float) -> bool:
    """Wait for ``proc``; kill it ``timeout`` s after its ``ready`` line in ``out``.

    True when it was killed.
    """
    deadline = time.monotonic() + STARTUP_LIMIT
    ready = False
    while proc.poll() is None:
        if not ready:
            out.seek(0)
            if '"ready"' in out.readline():
                ready = True
                deadline = time.monotonic() + timeout
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return True
        time.sleep(_POLL)
    return False


def _indent(text: str) -> str:
    return "\n".join(_INDENT + line for line in text.splitlines())


def check(name: str, file: str | Path, timeout: float = 10.0, out: TextIO | None = None) -> int:
    """Grade ``file`` for exercise ``name``; print a report to ``out``; 0 iff all pass."""
    out = out or sys.stdout
    path = Path(file)
    if not path.is_file():
        print(
            f"error: {file} is not a file (create one with: flashtile learn start {name})", file=out
        )
        return 1
    names = [case.name for case in CASES[name]()]
    print(f"Checking {path} against exercise {name} ({len(names)} cases)", file=out)
    events, timed_out, code, tail = run_grader(name, path.resolve(), timeout)

    if any(e["event"] == "load_error" for e in events):
        error = next(e for e in events if e["event"] == "load_error")
        print(f"  could not import {path}:", file=out)
        print(_indent(error["traceback"]), file=out)
        print(f"Summary: 0/{len(names)} passed (the file did not import)", file=out)
        return 1

    passed = 0
    detailed = False
    seen: set[str] = set()
    running = None
    for event in events:
        if event["event"] == "start":
            running = event["case"]
        elif event["event"] == "result":
            running = None
            seen.add(event["case"])
            if event["ok"]:
                passed += 1
                print(f"  PASS  {event['case']}", file=out)
                continue
            print(f"  FAIL  {event['case']}: {event['reason']}", file=out)
            if not detailed:  # the full story for the first failure only
                detailed = True
                if "expected" in event:
                    for label, value in (
                        ("expected: ", event["expected"]),
                        ("got:      ", event["got"]),
                    ):
                        # Continuation lines of a printed array line up under its first.
                        text = value.replace("\n", "\n" + _INDENT + " " * len(label))
                        print(f"{_INDENT}{label}{text}", file=out)
                if event.get("traceback"):
                    print(_indent(event["traceback"]), file=out)
                if event.get("hint"):
                    print(f"{_INDENT}hint: {event['hint']}", file=out)

    finished = any(e["event"] == "done" for e in events)
    if not finished:
        where = f" during case {running!r}" if running else ""
        if timed_out:
            print(
                f"  TIMEOUT  stopped after {timeout:g} s{where}: your code did not finish "
                "(an endless loop? check that the loop variable advances)",
                file=out,
            )
        else:
            print(f"  ERROR  the Python process ended{where} (exit code {code})", file=out)
            last = tail.strip().splitlines()[-5:]
            if last:
                print(_indent("last output:\n" + "\n".join(last)), file=out)
    not_run = [n for n in names if n not in seen and n != running]
    for n in not_run:
        print(f"  ----  {n}: not run", file=out)
    total = len(names)
    verdict = "all passed" if passed == total else f"{total - passed} did not pass"
    print(f"Summary: {passed}/{total} passed, {verdict}", file=out)
    return 0 if passed == total and finished else 1
