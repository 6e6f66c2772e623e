"""How many cores this process may use: its CPU affinity (taskset, a cpuset) and its cgroup's
CPU quota (a Kubernetes CPU limit), not the machine's count `os.cpu_count` gives. A stage that
sized its torch threads by the machine would run more threads than it has cores, and each
parallel region would wait for a thread the kernel has parked."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """At least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:  # a fraction of a core left over would only be throttled
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


def cgroup_cpu_quota(root: Path = CGROUP, membership: str | None = None) -> float | None:
    """The tightest CPU quota, in cores, on this process's cgroup and those above it (cgroup
    v2's ``cpu.max``, v1's ``cpu.cfs_quota_us``); None where none is set."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    quotas: list[float] = []
    for line in membership.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2's unified hierarchy
            quotas += _along(root, path, "cpu.max", _v2_quota)
        elif "cpu" in controllers.split(","):  # mounted as "cpu,cpuacct", or "cpu" beside it
            hierarchy = root / controllers
            hierarchy = hierarchy if hierarchy.is_dir() else root / "cpu"
            quotas += _along(hierarchy, path, "cpu.cfs_quota_us", _v1_quota)
    return min(quotas) if quotas else None


def _along(base: Path, path: str, name: str, read) -> list[float]:
    """Quotas of ``name`` in the cgroup at ``path`` below ``base`` and in each parent (in a
    container the namespace's root is the container's own cgroup)."""
    found = []
    # under a cgroup namespace a path may climb out of it ("/../.."): those steps lead nowhere
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    for depth in range(len(parts), -1, -1):
        quota = read(base.joinpath(*parts[:depth]) / name)
        if quota is not None:
            found.append(quota)
    return found


def _v2_quota(file: Path) -> float | None:
    try:
        limit, period = file.read_text().split()[:2]
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(file: Path) -> float | None:
    try:
        quota = int(file.read_text())
        period = int((file.parent / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None
