"""Helpers for the image tests (a plain module: tests/image has no package)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import uuid
from pathlib import Path

IMAGE = os.environ.get("IMAGE", "localhost/tokenline:cpu")
RUNC = "/usr/sbin/runc"
CLIENT = Path(__file__).with_name("client.py")


def podman(*args: str, timeout: float = 120, check: bool = True) -> str:
    done = subprocess.run(
        ["podman", "--runtime", RUNC, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {done.stdout}\n{done.stderr}")
    return done.stdout.strip()


def run_flags() -> list[str]:
    """How the chart and the operator run every container, as podman flags."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    procs = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    procs = 4096 if procs == resource.RLIM_INFINITY else min(procs, 4096)
    return [
        # runc refuses rlimits above the caller's; crun is not installed (it fails here).
        f"--ulimit=nofile={soft}:{hard}",
        f"--ulimit=nproc={procs}:{procs}",
        "--user=10001:10001",
        "--group-add=10001",  # the pod's fsGroup
        "--read-only",
        "--read-only-tmpfs=false",  # podman's own writable /tmp, /var/tmp, /run: not in a pod
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        "--pull=never",
    ]


class Containers:
    """Starts containers detached; removes them all, printing their logs, at the end."""

    def __init__(self) -> None:
        self.prefix = f"tokenline-image-test-{uuid.uuid4().hex[:8]}"
        self.names: list[str] = []

    def start(self, name: str, *args: str) -> str:
        full = f"{self.prefix}-{name}"
        podman("run", "--detach", f"--name={full}", *run_flags(), *args)
        self.names.append(full)
        return full

    def pid(self, name: str) -> int:
        return int(podman("inspect", "--format={{.State.Pid}}", name))

    def running(self) -> list[str]:
        return [
            n for n in self.names if podman("inspect", "--format={{.State.Running}}", n) == "true"
        ]

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{podman('logs', n, check=False)[-4000:]}" for n in self.names)

    def remove(self) -> None:
        for name in reversed(self.names):
            podman("rm", "--force", "--time=5", name, check=False)


def client_in(pid: int, api_port: int, *metrics_ports: int) -> dict:
    """Run client.py in the network namespace of process ``pid`` (a container's)."""
    done = subprocess.run(
        [
            "nsenter",
            f"--net=/proc/{pid}/ns/net",
            "--",
            sys.executable,
            str(CLIENT),
            str(api_port),
            *map(str, metrics_ports),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=400,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))
