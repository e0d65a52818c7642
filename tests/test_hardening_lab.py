"""Regression tests for the learning lab's checker, run as a hostile solution would.

Each test names the defect it guards; every one failed before its fix (the
commit that added it says how it was checked). A check starts a Python
process (about a second), so the tests are few and their limits short: the
time limit starts once the grader has imported NumPy and flashtile.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from flashtile.cli import main
from flashtile.learn.cases import CASES
from flashtile.learn.catalog import EXERCISES
from flashtile.learn.runner import check

try:
    import resource
except ImportError:  # not POSIX
    resource = None

POSIX_SESSIONS = pytest.mark.skipif(
    not hasattr(os, "fork") or not Path("/proc/self/stat").exists(),
    reason="needs fork and /proc",
)


def solution(tmp_path: Path, body: str, name: str = "solution.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def reference_softmax() -> str:
    return EXERCISES["online_softmax"].solution


def run_check(path: Path, timeout: float = 30.0, name: str = "online_softmax") -> tuple[int, str]:
    out = io.StringIO()
    return check(name, path, timeout=timeout, out=out), out.getvalue()


def test_modules_in_the_callers_folder_do_not_shadow_the_real_ones(tmp_path, monkeypatch):
    """The grader ran with ``python -m`` from the caller's folder, so a json.py
    or numpy.py there replaced the real module."""
    here = tmp_path / "here"
    here.mkdir()
    for module in ("json", "numpy"):
        (here / f"{module}.py").write_text("raise SystemExit('the wrong module was imported')\n")
    monkeypatch.chdir(here)
    code, text = run_check(solution(tmp_path, reference_softmax()))
    assert code == 0, text


FORKS = """
import os, time

if os.fork() == 0:  # a child holding every inherited descriptor
    with open({pidfile!r}, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
    os._exit(0)
"""


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its reaper does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@POSIX_SESSIONS
@pytest.mark.parametrize("hang", [False, True])
def test_forked_children_do_not_outlive_the_check(tmp_path, hang):
    """Children a solution forked kept running after the check, whether the
    grader finished or was killed at the time limit."""
    pidfile = tmp_path / "child.pid"
    body = FORKS.format(pidfile=str(pidfile)) + reference_softmax()
    if hang:
        body += "\nwhile True:\n    pass\n"
    start = time.monotonic()
    code, text = run_check(solution(tmp_path, body), timeout=0.5 if hang else 30.0)
    assert time.monotonic() - start < 30, text
    assert (code == 1 and "TIMEOUT" in text) if hang else code == 0, text
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


@pytest.mark.skipif(resource is None, reason="needs POSIX resource limits")
def test_a_solutions_output_is_capped(tmp_path):
    """A print loop wrote 2.2 GiB to a temporary file in 5 s."""
    body = reference_softmax() + "\nwhile True:\n    print('x' * 65536)\n"
    code, text = run_check(solution(tmp_path, body), timeout=2.0)
    assert code == 1 and "File too large" in text and "TIMEOUT" not in text, text


def test_an_unbounded_timeout(tmp_path, capsys):
    """``--timeout inf`` and ``--timeout 1e300`` ended in an OverflowError traceback."""
    path = solution(tmp_path, reference_softmax())
    code, text = run_check(path, timeout=float("inf"))
    assert code == 0, text
    code = main(["learn", "check", "online_softmax", str(path), "--timeout", "1e300"])
    assert code == 0, capsys.readouterr().out


FORGER = """
import json, os

for fd in range(3, 16):  # whatever the result channel is, write a perfect score to it
    lines = [{{"event": "result", "case": n, "ok": True}} for n in {names!r}]
    text = "".join(json.dumps(e) + "\\n" for e in [*lines, {{"event": "done"}}])
    try:
        os.write(fd, text.encode())
    except OSError:
        pass
os._exit(0)
"""


def test_result_lines_written_by_a_solution_do_not_count(tmp_path):
    """A solution could write the grader's result lines itself and pass without
    defining the function."""
    names = [case.name for case in CASES["online_softmax"]()]
    code, text = run_check(solution(tmp_path, FORGER.format(names=names)))
    assert code == 1 and f"0/{len(names)} passed" in text, text


def test_the_events_file_appends_whatever_our_offset():
    """The grader's writes share our offset; a write between our seek(0) and
    our read once landed at the start and overwrote the first events."""
    from flashtile.learn.runner import events_file

    with events_file() as out:
        child = os.dup(out.fileno())  # the child's stdout: the same open file
        try:
            os.write(child, b'{"event": "ready"}\n')
            out.seek(0)  # what the parent does while it waits for "ready"
            os.write(child, b'{"event": "start"}\n')
        finally:
            os.close(child)
        out.seek(0)
        assert out.read() == '{"event": "ready"}\n{"event": "start"}\n'
