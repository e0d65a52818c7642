"""``flashtile bench --preset calls``: what a small call costs, against torch SDPA.

Per call (float32; medians over shuffled interleaved rounds, each round the
median of its calls):

- the fixed cost: a T=1 call, q, k, v of (1, 12, 1, 64), through
  ``flashtile.attention`` (NumPy), ``flashtile.decode_attention`` and
  ``flashtile.torch.attention``, against SDPA;
- a decoding step, q (1, 12, 1, 64) against 2048 keys, and a tiny causal
  call (1, 4, 16, 32), forward and forward+backward, through the torch op
  against SDPA;
- the tiny call through ``flashtile.attention`` against its kernel alone (a
  ready plan's ``run_forward``): the difference is the front door's cost;
- the decoding step again while a second process keeps one core busy (a
  pure-Python loop), each round's mean time per call (a decoding loop's
  throughput; the median hides the calls whose join waited for a
  descheduled thread, which the launcher's join watch answers by running
  such calls on one thread, :mod:`flashtile.cpu.launch`); and with each
  provider alone in a process of its own, as a serving loop runs one of
  them (processes taking turns, :data:`ALONE_ROUNDS` each, all calls
  pooled): the mean and the median. In one process the two thread pools
  spin against each other after their rounds: on an AVX2 EPYC flashtile's
  mean was 0.77 ms there and 0.43 alone, SDPA's 0.75 and 0.72-0.80.

On a busy small machine torch's and Numba's thread pools spin against each
other and the parallel cases measure the scheduler (docs/decoding.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

from .timing import round_orders

#: Calls per round.
CALLS = 100
#: The case timed again with one core busy.
STEP = "step (1, 12, 1, 64) vs 2048 keys, torch op"
LOADED = f"{STEP}, a second process busy on one core, mean"
#: The loaded step with each provider alone in its process: its two rows.
ALONE = f"{STEP}, a second process busy on one core, each alone in its process"
ALONE_ROWS = {f"{ALONE}, mean": statistics.fmean, f"{ALONE}, median": statistics.median}
#: Processes per provider for those rows, the calls each times, and the
#: calls before (a serving loop runs long: the join watch has settled).
ALONE_ROUNDS, ALONE_CALLS, ALONE_WARMUP = 3, 3000, 500
#: The line of such a process that holds its times (after any other output).
_ALONE_MARK = "step times: "
#: The case whose difference is the front door's cost.
FRONT = "tiny causal, flashtile.attention vs its kernel alone"


def _per_call(fn, calls: int, stat=statistics.median) -> float:
    """Microseconds of ``calls`` calls of ``fn``: their median (or ``stat``)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return stat(times) / 1e3


def _cases(torch) -> dict:
    """``case -> {provider: zero-argument call}``."""
    import flashtile
    import flashtile.torch as ftt
    from flashtile.cpu.launch import run_forward
    from flashtile.frontdoor import check_call
    from flashtile.planning import plan_forward

    sdpa = torch.nn.functional.scaled_dot_product_attention
    g = torch.Generator().manual_seed(0)
    one = [torch.randn(1, 12, 1, 64, generator=g) for _ in range(3)]
    step = [torch.randn(1, 12, 1, 64, generator=g)]
    step += [torch.randn(1, 12, 2048, 64, generator=g) for _ in range(2)]
    tiny = [torch.randn(1, 4, 16, 32, generator=g) for _ in range(3)]
    grads = [t.clone().requires_grad_() for t in tiny]
    n_one, n_tiny = [t.numpy() for t in one], [t.numpy() for t in tiny]
    plan = plan_forward(check_call(*n_tiny, True, None, {}))

    def backward(fn):
        return lambda: fn(*grads, is_causal=True).sum().backward()

    def op(*a, is_causal=False):
        return ftt.attention(*a, causal=is_causal)

    return {
        "T=1, flashtile.attention (NumPy)": {
            "flashtile": lambda: flashtile.attention(*n_one), "SDPA": lambda: sdpa(*one),
        },
        "T=1, flashtile.decode_attention": {
            "flashtile": lambda: flashtile.decode_attention(*n_one), "SDPA": lambda: sdpa(*one),
        },
        "T=1, torch op": {"flashtile": lambda: op(*one), "SDPA": lambda: sdpa(*one)},
        STEP: {
            "flashtile": lambda: op(*step), "SDPA": lambda: sdpa(*step),
        },
        "tiny (1, 4, 16, 32) causal, torch op": {
            "flashtile": lambda: op(*tiny, is_causal=True),
            "SDPA": lambda: sdpa(*tiny, is_causal=True),
        },
        "tiny causal fwd+bwd, torch op": {"flashtile": backward(op), "SDPA": backward(sdpa)},
        FRONT: {
            "flashtile": lambda: flashtile.attention(*n_tiny, causal=True),
            "kernel": lambda: run_forward(plan),
        },
    }  # fmt: skip


@contextlib.contextmanager
def busy_core():
    """A second process that keeps one core busy while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # (started, and placed by the scheduler)
        yield
    finally:
        proc.kill()
        proc.wait()


def _interleaved(calls: dict, reps: int, stat=statistics.median) -> dict:
    """``key -> [us per call of each round]`` over ``reps`` rounds in
    :func:`.timing.round_orders` (the ``stat`` of each round's calls: their
    median, or mean)."""
    times = {key: [] for key in calls}
    for order in round_orders(list(calls), reps):
        for key in order:
            times[key].append(_per_call(calls[key], CALLS, stat))
    return times


def _with_loaded(case: str) -> tuple:
    """The table's order: the loaded steps right after the step."""
    return (case, LOADED, *ALONE_ROWS) if case == STEP else (case,)


def step_alone(who: str, threads: int) -> list[float]:
    """Microseconds of each of ALONE_CALLS decoding steps by ``who``
    (``"flashtile"`` or ``"SDPA"``) after a warm-up, on ``threads`` torch
    threads: the body of :func:`_alone_times`' process."""
    import torch

    torch.set_num_threads(threads)
    fn = _cases(torch)[STEP][who]
    for _ in range(ALONE_WARMUP):
        fn()
    times = []
    for _ in range(ALONE_CALLS):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def _alone_times(threads: int) -> dict:
    """``{(row, provider): [its statistic]}`` of the :data:`ALONE_ROWS`: the
    step by each provider in processes of its own, taking turns."""
    pooled = {"flashtile": [], "SDPA": []}
    for order in round_orders(list(pooled), ALONE_ROUNDS):
        for who in order:
            code = (
                "import json; from flashtile.bench.calls import step_alone; "
                f"print({_ALONE_MARK!r} + json.dumps(step_alone({who!r}, {threads})))"
            )
            try:
                run = subprocess.run(
                    [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
                )
            except subprocess.TimeoutExpired as error:
                raise RuntimeError(f"the {who} process of the loaded step timed out") from error
            marked = [line for line in run.stdout.splitlines() if line.startswith(_ALONE_MARK)]
            if run.returncode != 0 or not marked:
                tail = "\n".join((run.stdout + run.stderr).splitlines()[-15:])
                raise RuntimeError(
                    f"the {who} process of the loaded step failed (exit {run.returncode}):\n{tail}"
                )
            pooled[who] += json.loads(marked[-1][len(_ALONE_MARK) :])
    return {(row, who): [stat(t)] for row, stat in ALONE_ROWS.items() for who, t in pooled.items()}


def measure(reps: int) -> list[dict]:
    """``[{"case", "flashtile", "other", "other_name"}]`` in microseconds."""
    import torch

    cases = _cases(torch)
    calls = {(case, who): fn for case, pair in cases.items() for who, fn in pair.items()}
    for fn in calls.values():  # compile and warm up
        for _ in range(20):
            fn()
    times = _interleaved(calls, reps)
    with busy_core():
        loaded = {(LOADED, who): fn for who, fn in cases[STEP].items()}
        times.update(_interleaved(loaded, reps, statistics.fmean))
        times.update(_alone_times(torch.get_num_threads()))
    cases = {c: pair for case, pair in cases.items() for c in _with_loaded(case)}
    rows = []
    for case, pair in cases.items():
        other = next(w for w in pair if w != "flashtile")
        rows.append({
            "case": case,
            "flashtile": statistics.median(times[(case, "flashtile")]),
            "other": statistics.median(times[(case, other)]),
            "other_name": other,
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> list[str]:
    """Markdown table lines."""
    lines = [
        "| case | flashtile us | against | its us | ratio |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        ratio = r["other"] / r["flashtile"]
        lines.append(
            f"| {r['case']} | {r['flashtile']:.1f} | {r['other_name']} | {r['other']:.1f} "
            f"| {ratio:.2f}x |"
        )
    return lines


def run_calls_bench(out, reps: int = 15, records=None) -> int:
    """Print the small calls' table and the front door's cost to ``out``."""
    import torch

    from .machine import header_lines, machine_info

    for line in header_lines(machine_info(torch.get_num_threads()), None):
        print(line, file=out)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"calls   : float32, {reps} shuffled rounds of {CALLS} calls, medians (the busy core's "
        f"first row: means; its others: {ALONE_ROUNDS} processes of {ALONE_CALLS} calls per "
        f"provider, pooled); ratio = the other's time / flashtile's (above 1: flashtile is "
        f"faster); load {load}",
        file=out,
    )
    rows = measure(reps)
    if records is not None:
        records += rows
    print("", file=out)
    for line in table(rows):
        print(line, file=out)
    front = next(r["flashtile"] - r["other"] for r in rows if r["case"] == FRONT)
    print("", file=out)
    print(f"* the front door's cost (tiny call above its kernel): {front:.1f} us", file=out)
    return 0
