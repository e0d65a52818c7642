"""How many CPUs this process may really use: affinity and a cgroup CPU quota.

Numba sizes its thread pool by the CPUs the process may run on
(``os.sched_getaffinity``), but a container's CPU *quota* is invisible there:
a pod limited to 1 CPU on a 2-core node sees 2 cores, and a kernel that runs
2 threads there is throttled every period, its join waiting for the partner
thread the quota has descheduled (a 0.3 ms decoding step then takes a whole
period). The kernels' thread count (:func:`flashtile.cpu.launch.numba_threads`)
is capped at :func:`usable_cpus` (:func:`flashtile.cpu.launch._call`
sets Numba's count to the plan's for each call), as Go's automaxprocs does.

The quota is read in both cgroup formats: v2's ``cpu.max`` (``"max 100000"``
or ``"<quota> <period>"``) and v1's ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us`` (quota ``-1``: none), in the process's own cgroup
(``/proc/self/cgroup``) and each of its ancestors up to the mount's root
(the tightest limit wins). Quotas round down to whole CPUs (at least 1),
as automaxprocs does: a fractional CPU would be throttled. ``NUMBA_NUM_THREADS``, when the user
sets it, is their choice and is kept.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _quota(text: str | None, period_text: str | None = None) -> float | None:
    """CPUs allowed by one cgroup's files: v2 ``cpu.max`` (``text`` only) or
    v1 quota and period; None for no limit or anything unreadable."""
    if text is None:
        return None
    if period_text is None:  # v2: "<quota|max> <period>"
        parts = text.split()
        if len(parts) != 2 or parts[0] == "max":
            return None
        quota, period = parts
    else:
        quota, period = text, period_text
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _ancestors(base: Path, relative: str):
    """``base / relative`` and each parent directory up to ``base``."""
    path = base / relative.lstrip("/")
    while True:
        yield path
        if path == base or base not in path.parents:
            return
        path = path.parent


def cgroup_cpu_limit(root: Path = Path("/")) -> float | None:
    """CPUs the process's cgroups allow (fractional), or None for no quota.
    ``root``: the file system root (tests plant files under another one)."""
    lines = _read(root / "proc/self/cgroup")
    if lines is None:
        return None
    limits = []
    for line in lines.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2, the unified hierarchy
            base = root / "sys/fs/cgroup"
            limits += [_quota(_read(d / "cpu.max")) for d in _ancestors(base, relative)]
        elif "cpu" in controllers.split(","):  # cgroup v1's cpu controller
            for mount in ("cpu,cpuacct", "cpuacct,cpu", "cpu"):
                base = root / "sys/fs/cgroup" / mount
                for d in _ancestors(base, relative):
                    period = _read(d / "cpu.cfs_period_us")
                    limits.append(_quota(_read(d / "cpu.cfs_quota_us"), period or "0"))
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def usable_cpus(root: Path = Path("/")) -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup quota
    rounded down (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)
