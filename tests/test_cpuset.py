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
    assert launch._call(1, entry, running) == 1
    assert launch._call(numba_threads(), entry, running) == numba_threads()
    if numba.config.NUMBA_NUM_THREADS > 1:  # a pool larger than the CPUs allowed
        monkeypatched = launch._USABLE
        try:
            launch._USABLE = 1
            assert launch._call(2, entry, running) == 2  # swapped to the plan's count
        finally:
            launch._USABLE = monkeypatched
