"""``flashtile learn check``: run the grader process with a time limit and report.

The grader (:mod:`flashtile.learn.grade`) streams one JSON event per line, so
when the time limit stops it the last ``start`` without a ``result`` names
the case that hung, and the cases after it are listed as not run. The limit
counts the learner's code only: it starts at the grader's ``ready`` event,
after the interpreter has started and imported NumPy and flashtile (seconds
on a busy machine), which get :data:`STARTUP_LIMIT` of their own.

What a check isolates (a teaching tool, not a sandbox; docs/reliability.md):
the grader runs with ``python -P`` (modules in the caller's folder do not
replace real ones), in a session of its own that is killed when it ends or
times out (no process the solution forked outlives the check), with its
output capped (:data:`~flashtile.learn.grade.OUTPUT_LIMIT`), and only events
carrying a per-run token count.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

try:
    import fcntl
except ImportError:  # not POSIX: no shared-offset race to close
    fcntl = None

from .cases import CASES
from .grade import TOKEN_VARIABLE

_INDENT = " " * 8
#: Seconds the grader may take to start and import, before the learner's limit.
STARTUP_LIMIT = 120.0
_POLL = 0.02
#: POSIX sessions: the grader and every process it starts can be killed at once.
_SESSIONS = hasattr(os, "killpg")


def _grader_env(token: str) -> dict[str, str]:
    """The environment of the grader: this flashtile first on its import path,
    and the token that marks the grader's own events."""
    env = os.environ.copy()
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env[TOKEN_VARIABLE] = token
    return env


def run_grader(name: str, path: Path, timeout: float) -> tuple[list[dict], bool, int, str]:
    """Run the grader; return ``(events, timed_out, exit code, stderr tail)``.

    ``timeout`` seconds (``inf``: no limit) start at the grader's ``ready``
    event; before it, the grader has :data:`STARTUP_LIMIT` seconds to start.
    """
    # -P: the caller's folder does not join sys.path, so a json.py or numpy.py
    # there cannot stand in for the real module.
    cmd = [sys.executable, "-P", "-m", "flashtile.learn.grade", name, str(path)]
    token = secrets.token_hex(16)
    # Both streams go to files, not pipes: a print loop cannot fill memory or
    # block the child on a full pipe, a child the solution forks cannot hold
    # the check by holding a pipe open, and the events can be read while it
    # runs (the events file appends: see events_file).
    with (
        events_file() as out,
        tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err,
    ):
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            text=True,
            env=_grader_env(token),
            start_new_session=_SESSIONS,
        )
        try:
            timed_out = _wait(proc, out, timeout)
        finally:  # on Ctrl-C too: the grader's session is not the terminal's
            _kill_session(proc)
            proc.wait()
        out.seek(0)
        stdout = out.read()
        err.seek(0, os.SEEK_END)
        err.seek(max(0, err.tell() - 4000))
        tail = err.read()
    return _own_events(stdout, token), timed_out, proc.returncode, tail


def events_file():
    """An anonymous temporary file whose every write lands at its end.

    The child's stdout shares this file's offset with us, and we seek to
    read it while the child runs. ``TemporaryFile("a+")`` does not set
    ``O_APPEND`` on the descriptor (Python only seeks to the end once), so a
    write that came between our ``seek(0)`` and our read landed at the start
    and overwrote the first events (a case reported "not run" under load).
    """
    out = tempfile.TemporaryFile("a+", encoding="utf-8", errors="replace")  # noqa: SIM115 (returned)
    if fcntl is not None:
        flags = fcntl.fcntl(out.fileno(), fcntl.F_GETFL)
        fcntl.fcntl(out.fileno(), fcntl.F_SETFL, flags | os.O_APPEND)
    return out


def _wait(proc: subprocess.Popen, out, timeout: float) -> bool:
    """Wait for ``proc`` to end, at most ``timeout`` s after its ``ready`` line
    in ``out``; True when the time ran out (the caller kills it)."""
    deadline = time.monotonic() + STARTUP_LIMIT
    ready = False
    while proc.poll() is None:
        if not ready:
            out.seek(0)
            if '"ready"' in out.readline():
                ready = True
                deadline = time.monotonic() + timeout  # inf stays inf: no limit
        if time.monotonic() > deadline:
            return True
        time.sleep(_POLL)
    return False


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the grader's session: the grader and every process it started.

    The session's id is the grader's pid, which Linux does not hand out again
    while a process of the session lives, even once the grader is reaped. A
    child that called ``setsid()`` has left and is not killed.
    """
    if not _SESSIONS:  # not POSIX: the grader only
        if proc.poll() is None:
            proc.kill()
        return
    with contextlib.suppress(ProcessLookupError):  # every one has exited already
        os.killpg(proc.pid, signal.SIGKILL)


def _own_events(text: str, token: str) -> list[dict]:
    """The grader's events in ``text``: the JSON lines carrying ``token``
    (taken out); lines the solution wrote to the channel do not count."""
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # not ours (a partial last line of a killed grader)
        if isinstance(event, dict) and event.pop("token", None) == token:
            events.append(event)
    return events


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
