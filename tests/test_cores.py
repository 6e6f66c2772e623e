"""A stage sizes its torch threads by the cores it may use: its CPU affinity and its cgroup's
quota (a Kubernetes CPU limit), never the machine's count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenline import cores
from tokenline.cores import cgroup_cpu_quota, usable_cores


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_v2_quota_is_read_from_the_process_cgroup_and_its_parents(tmp_path: Path) -> None:
    _write(tmp_path / "kubepods" / "cpu.max", "max 100000\n")
    _write(tmp_path / "kubepods" / "pod1" / "cpu.max", "250000 100000\n")
    _write(tmp_path / "kubepods" / "pod1" / "c1" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/kubepods/pod1/c1\n") == 2.5
    assert cgroup_cpu_quota(tmp_path, "0::/kubepods\n") is None  # "max": no limit
    assert cgroup_cpu_quota(tmp_path, "0::/\n") is None  # no file: the host's root


def test_a_v1_quota_is_read_from_the_cpu_controllers_hierarchy(tmp_path: Path) -> None:
    hierarchy = tmp_path / "cpu,cpuacct"
    _write(hierarchy / "docker" / "cpu.cfs_quota_us", "150000\n")
    _write(hierarchy / "docker" / "cpu.cfs_period_us", "100000\n")
    _write(hierarchy / "cpu.cfs_quota_us", "-1\n")
    _write(hierarchy / "cpu.cfs_period_us", "100000\n")
    membership = "4:memory:/docker\n3:cpu,cpuacct:/docker\n1:name=systemd:/\n"
    assert cgroup_cpu_quota(tmp_path, membership) == 1.5
    assert cgroup_cpu_quota(tmp_path, "3:cpu,cpuacct:/\n") is None  # -1: no limit


def test_a_quota_caps_the_cores_and_never_below_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: None)
    assert usable_cores() == 8
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: 2.5)
    assert usable_cores() == 2  # half a core more would only be throttled
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: 0.5)
    assert usable_cores() == 1


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux's CPU affinity")
def test_a_process_pinned_to_one_core_counts_one() -> None:
    """taskset, as a benchmark pins a stack: os.cpu_count() still says every core."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core here already")
    code = (
        "from tokenline.cores import usable_cores; import os; print(usable_cores(), os.cpu_count())"
    )
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0] == "1" and int(out[1]) >= 2
