"""The CPUs a process may use: cgroup v1 and v2 quotas read from planted files."""

from __future__ import annotations

import os

import numba
import numpy as np
import pytest

import flashtile.cpu.launch as launch
from flashtile.cpu.blas import GemmEntry
from flashtile.cpu.launch import numba_threads
from flashtile.cpuset import cgroup_cpu_limit, usable_cpus


def _plant(root, files: dict[str, str]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


V2 = "0::/kubepods/pod1/ctr\n"
V1 = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"


@pytest.mark.parametrize(
    ("files", "want"),
    [
        ({"proc/self/cgroup": V2, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "150000 100000"}, 1.5),
        ({"proc/self/cgroup": V2, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000"}, None),
        # An ancestor's quota binds its descendants: the tightest wins.
        (
            {
                "proc/self/cgroup": V2,
                "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "400000 100000",
                "sys/fs/cgroup/kubepods/pod1/cpu.max": "100000 100000",
            },
            1.0,
        ),
        # In a cgroup namespace the process's path is the mount's root.
        ({"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "250000 100000"}, 2.5),
        (
            {
                "proc/self/cgroup": V1,
                "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000",
                "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
            },
            0.5,
        ),
        (
            {
                "proc/self/cgroup": V1,
                "sys/fs/cgroup/cpu/docker/abc/cpu.cfs_quota_us": "-1",
                "sys/fs/cgroup/cpu/docker/abc/cpu.cfs_period_us": "100000",
            },
            None,
        ),
        ({"proc/self/cgroup": V2, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "garbage"}, None),
        ({}, None),  # no /proc: no limit known
    ],
    ids=["v2", "v2-max", "v2-parent", "v2-namespace", "v1", "v1-none", "v2-garbage", "none"],
)
def test_the_quota_is_read_in_both_cgroup_formats(tmp_path, files, want):
    assert cgroup_cpu_limit(_plant(tmp_path, files)) == want


def test_usable_cpus_round_a_quota_down_and_keep_the_affinity(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # nothing planted: the affinity
    quota = {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "50000 100000"}
    assert usable_cpus(_plant(tmp_path, quota)) == 1  # half a CPU: one thread, never zero
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text(f"{(affinity + 5) * 100000} 100000")
    assert usable_cpus(tmp_path) == affinity  # a quota above the affinity changes nothing


def test_the_kernels_run_on_the_planned_threads():
    # Planned at most the usable CPUs (a user's NUMBA_NUM_THREADS kept), and
    # each call runs on the plan's count, whatever the pool's size.
    assert 1 <= numba_threads() <= launch._USABLE
    if "NUMBA_NUM_THREADS" not in os.environ:
        assert usable_cpus() == launch._USABLE

    @numba.njit
    def running(gemm_fn, blas_threads):  # a kernel's last two arguments
        return numba.get_num_threads()

    entry = GemmEntry(0, "none", False, np.zeros((0, 4), dtype=np.int64))
    assert launch._call(1, 0, entry, running) == 1
    assert launch._call(numba_threads(), 1 << 20, entry, running) == numba_threads()
    if numba.config.NUMBA_NUM_THREADS > 1:  # a pool larger than the CPUs allowed
        monkeypatched = launch._USABLE
        try:
            launch._USABLE = 1
            assert launch._call(2, 1 << 20, entry, running) == 2  # swapped to the plan's count
        finally:
            launch._USABLE = monkeypatched


@numba.njit
def _running(gemm_fn, blas_threads):  # a kernel's last two arguments
    return numba.get_num_threads()


@pytest.fixture
def join_watch(monkeypatch):
    """The launcher's join watch, on, from a clean slate, reading a planted
    clock (``clock[0]``, ns)."""
    clock = [10**12]
    monkeypatch.setattr(launch, "JOIN_WATCH", True)
    monkeypatch.setattr(launch, "_clock", lambda: clock[0])
    launch.reset_join_watch()
    yield clock
    launch.reset_join_watch()


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs a pool of 2 threads")
def test_small_calls_run_on_one_thread_while_their_parallel_mean_is_the_slower(
    join_watch, monkeypatch
):
    monkeypatch.setattr(launch, "_USABLE", 1)  # Numba's count is set to the plan's on each call
    monkeypatch.setattr(launch, "JOIN_HOLD_NS", 30_000_000)  # 100 serial calls of 0.3 ms
    entry = GemmEntry(0, "none", False, np.zeros((0, 4), dtype=np.int64))
    parallel_times = []

    def kernel(gemm_fn, table):  # takes its planted time on the threads it was given
        threads = numba.get_num_threads()
        join_watch[0] += parallel_times.pop(0) if threads == 2 else 300_000
        return threads

    def run(times, size=3 << 20):
        parallel_times[:] = list(times)
        ran = []
        while parallel_times:
            ran.append(launch._call(2, size, entry, kernel))
        return ran

    quiet = [150_000 + 20_000 * (n % 3) for n in range(300)]
    assert run([500_000_000] + quiet) == [2] * 301  # parallel throughout (the first call loads)
    busy = ([8_000_000] + [150_000] * 9) * 30  # one join in ten waits 8 ms: mean 0.9 ms
    ran = run(busy)
    assert ran[:40] == [2] * 40  # (the mean rises over 4 x 0.15 ms: a hold)
    assert ran.count(1) > 6 * ran.count(2), (ran.count(1), ran.count(2))  # then holds
    assert run(quiet)[-200:] == [2] * 200  # the waits gone: parallel again
    assert run([40_000_000] * 40, size=3 << 30) == [2] * 40  # a large call is never held


def test_the_join_watch_leaves_serial_calls_and_can_be_turned_off(join_watch, monkeypatch):
    entry = GemmEntry(0, "none", False, np.zeros((0, 4), dtype=np.int64))
    assert launch._call(1, 1 << 20, entry, _running) == 1
    assert launch._WATCH == {}  # serial plans are not timed
    if numba.config.NUMBA_NUM_THREADS > 1:
        monkeypatch.setattr(launch, "_USABLE", 1)  # (so that 2 threads run whatever the pool)
        assert launch._call(2, 1 << 20, entry, _running) == 2
        assert len(launch._WATCH) == 1  # timed
        launch.reset_join_watch()
        monkeypatch.setattr(launch, "JOIN_WATCH", False)
        assert launch._call(2, 1 << 20, entry, _running) == 2
        assert launch._WATCH == {}


@pytest.mark.skipif(numba_threads() < 2, reason="needs 2 kernel threads")
@pytest.mark.parametrize("tq", [1, 256], ids=["decode", "forward"])
def test_a_call_held_to_one_thread_returns_the_same_bits(join_watch, monkeypatch, tq):
    import flashtile

    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 8, tq, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 8, 2048, 64), dtype=np.float32) for _ in range(2))
    swaps = []
    swap = launch._swap_threads
    monkeypatch.setattr(launch, "_swap_threads", lambda n: swaps.append(n) or swap(n))
    parallel = flashtile.attention(q, k, v, causal=True)  # planned for 2 threads (and timed)
    (state,) = launch._WATCH.values()
    assert 1 not in swaps
    state[3], before = join_watch[0] + 1, len(swaps)  # a hold (the planted clock stands)
    assert np.array_equal(flashtile.attention(q, k, v, causal=True), parallel)
    assert swaps[before] == 1  # run on one thread
