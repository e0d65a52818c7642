"""``flashtile learn``: listing, starter files, hints, and the checker.

The checker runs learner files in a separate process, so each ``check`` call
costs an interpreter start (about a second); the planted wrong solutions live
in ``tests/learn_solutions/``.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from pathlib import Path

import pytest

from flashtile.learn import EXERCISES
from flashtile.learn.cases import CASES
from flashtile.learn.cli import add_parser, run_learn

PLANTED = Path(__file__).resolve().parent / "learn_solutions"


def learn(*argv: str) -> tuple[int, str]:
    """Parse ``flashtile learn ARGV`` with a parser of our own and run it."""
    parser = argparse.ArgumentParser(prog="flashtile")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["learn", *argv])
    buf = io.StringIO()
    code = run_learn(args, out=buf)
    return code, buf.getvalue()


@pytest.fixture(autouse=True)
def _state_file(tmp_path, monkeypatch):
    """Hint progress goes to a temporary file, never the user's home."""
    monkeypatch.setenv("FLASHTILE_STATE", str(tmp_path / "state" / "learn.json"))


def test_list_names_every_exercise():
    code, text = learn()
    assert code == 0
    for name in ("online_softmax", "online_attention", "stable_rows", "online_update"):
        assert name in text
    assert "memory_scaling" in text and "causal_tiled" in text
    assert learn("list")[1] == text


def test_show_prints_the_statement_and_accepts_chapter_numbers():
    code, text = learn("show", "26.3")
    assert code == 0
    assert "memory_elements(T)" in text and "16,777,216" in text
    with pytest.raises(SystemExit):
        learn("show", "no_such_exercise")


def test_start_writes_a_starter_and_refuses_to_overwrite(tmp_path):
    code, text = learn("start", "online_softmax", "--dir", str(tmp_path / "lab"))
    path = tmp_path / "lab" / "online_softmax.py"
    assert code == 0 and str(path) in text
    assert "def online_softmax(x, block_size):" in path.read_text()
    assert "raise NotImplementedError" in path.read_text()
    path.write_text("# my work\n")
    code, text = learn("start", "online_softmax", "--dir", str(tmp_path / "lab"))
    assert code == 1 and "--force" in text
    assert path.read_text() == "# my work\n"  # untouched
    code, _ = learn("start", "online_softmax", "--dir", str(tmp_path / "lab"), "--force")
    assert code == 0 and "NotImplementedError" in path.read_text()


def test_hints_progress_persist_and_reset(tmp_path):
    total = len(EXERCISES["online_softmax"].hints)
    _, first = learn("hint", "online_softmax")
    assert "Hint 1/" in first and "Hint 2/" not in first
    _, second = learn("hint", "online_softmax")
    assert "Hint 2/" in second
    assert (tmp_path / "state" / "learn.json").is_file()
    _, other = learn("hint", "causal_tiled")  # counted per exercise
    assert "Hint 1/" in other and "Hint 2/" not in other
    for _ in range(total + 2):  # never runs past the last hint
        _, text = learn("hint", "online_softmax")
    assert f"Hint {total}/{total}" in text and "last hint" in text
    assert "reset" in learn("hint", "online_softmax", "--reset")[1]
    assert "Hint 2/" not in learn("hint", "online_softmax")[1]


def test_starter_file_fails_cleanly(tmp_path):
    learn("start", "memory_scaling", "--dir", str(tmp_path))
    code, text = learn("check", "memory_scaling", str(tmp_path / "memory_scaling.py"))
    assert code == 1
    assert "not implemented yet" in text and "Summary: 0/" in text


@pytest.mark.parametrize("name", list(EXERCISES))
def test_reference_solutions_pass(name, tmp_path):
    """Each --solution text, saved as a learner would, passes every case."""
    code, text = learn("hint", name, "--solution")
    assert code == 0
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    code, report = learn("check", name, str(path))
    n = len(CASES[name]())
    assert code == 0, report
    assert report.count("  PASS  ") == n and f"Summary: {n}/{n} passed" in report


def check_planted(stem: str, name: str = "online_softmax", *extra: str) -> tuple[int, str]:
    return learn("check", name, str(PLANTED / f"{stem}.py"), *extra)


def test_forgotten_rescale_names_the_later_block_case():
    code, text = check_planted("softmax_no_rescale")
    assert code == 1
    assert "  FAIL  max appears only in a later block" in text
    assert "expected: [0.09  , 0.2447, 0.6652]" in text  # the first failure in detail
    assert "got:      [0.0572, 0.1554, 0.4223]" in text
    assert "  PASS  block_size larger than n" in text  # one block: nothing to rescale


def test_whole_row_softmax_does_not_stream():
    code, text = check_planted("softmax_whole_row")
    assert code == 1
    assert "Summary: 10/11 passed" in text  # the values are right ...
    assert "does not stream: np.maximum.reduce read 12 entries of x" in text  # ... the method not


@pytest.mark.parametrize("stem", ["softmax_block_max", "softmax_frozen_max"])
def test_a_max_that_is_not_the_running_max_fails(stem):
    # Shifting by any reference is exact until the logits spread past ~709:
    # the 800-apart cases catch a block-local or a frozen first-block max.
    code, text = check_planted(stem)
    assert code == 1
    assert "  FAIL  a later logit 800 above the first (block_size=1)" in text


def test_builtin_max_and_sum_do_not_stream():
    code, text = check_planted("softmax_builtin_max")
    assert code == 1
    assert "does not stream: max() read 12 entries of x at once" in text


def test_zeros_like_of_v_is_not_a_read_of_v(tmp_path):
    # The reference solution with its accumulator made by np.zeros_like(v):
    # a buffer of v's shape, not a read of v.
    code, source = learn("hint", "causal_tiled", "--solution")
    line = "acc = np.zeros((T, v.shape[1]))"
    assert line in source
    path = tmp_path / "causal_zeros_like.py"
    path.write_text(source.replace(line, "acc = np.zeros_like(v)"))
    code, text = learn("check", "causal_tiled", str(path))
    assert code == 0, text


def test_hints_survive_an_unwritable_progress_file(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHTILE_STATE", str(blocker / "learn.json"))  # under a file
    code, text = learn("hint", "online_softmax")
    assert code == 0 and "hint 1" in text.lower()
    assert "could not save hint progress" in capsys.readouterr().err
    (tmp_path / "odd.json").write_text('{"hints": []}')
    monkeypatch.setenv("FLASHTILE_STATE", str(tmp_path / "odd.json"))
    assert learn("hint", "online_softmax")[0] == 0


def test_a_solution_that_is_not_a_python_file(tmp_path):
    path = tmp_path / "solution.txt"
    path.write_text("def online_softmax(x, block_size):\n    return x\n")
    code, text = learn("check", "online_softmax", str(path))
    assert code == 1 and "save your solution as a .py file" in text


def test_full_score_matrix_does_not_stream():
    code, text = check_planted("attention_full_scores", "online_attention")
    assert code == 1
    assert "does not stream: np.matmul read 10 rows of K at once" in text


def test_endless_loop_is_stopped_at_the_time_limit():
    # 1 s is less than the grader's own start (Python, NumPy, flashtile) on a
    # busy machine: the limit starts after it, so the hang is still found in case 1.
    code, text = check_planted("softmax_hangs", "online_softmax", "--timeout", "1")
    assert code == 1
    assert "TIMEOUT  stopped after 1 s during case 'seed example" in text
    assert "not run" in text and "Traceback" not in text


def test_exception_shows_only_the_learners_traceback():
    code, text = check_planted("softmax_raises")
    assert code == 1
    assert "your code raised AttributeError" in text
    assert 'softmax_raises.py", line 7, in helper' in text
    assert "flashtile" not in text.replace(str(PLANTED), "")  # no frame of ours
    assert "Tracked" not in text


def test_wrong_shape_and_nan_get_clear_messages():
    code, text = check_planted("softmax_wrong_shape")
    assert code == 1 and "wrong shape: expected (3,), got (3, 1)" in text
    code, text = check_planted("softmax_nan")
    assert code == 1 and "result contains NaN" in text


def test_file_that_does_not_import(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def online_softmax(x, block_size)\n    return x\n")
    code, text = learn("check", "online_softmax", str(bad))
    assert code == 1
    assert "could not import" in text and "SyntaxError" in text
    assert "flashtile/learn" not in text
    code, text = learn("check", "online_softmax", str(tmp_path / "missing.py"))
    assert code == 1 and "is not a file" in text


def test_grader_module_runs_as_a_subprocess():
    """The grader is importable with ``-m`` and speaks one JSON event per line."""
    path = PLANTED / "softmax_whole_row.py"
    proc = subprocess.run(
        [sys.executable, "-m", "flashtile.learn.grade", "online_softmax", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0
    assert lines[0] == '{"event": "ready"}' and lines[-1] == '{"event": "done"}'
    assert lines[1].startswith('{"event": "start"')
