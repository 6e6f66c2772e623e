"""The other target's processes are stopped while one is measured, and always continued."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tokenline.loadgen.isolation import bench_line, frozen, parse_pids, with_descendants
from tokenline.loadgen.load import wait_ready


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _settles_in(pid: int, states: set[str]) -> bool:
    """Signals are delivered asynchronously: give the kernel a moment."""
    deadline = time.monotonic() + 5
    while _state(pid) not in states and time.monotonic() < deadline:
        time.sleep(0.01)
    return _state(pid) in states


def test_frozen_stops_then_continues_a_process_even_on_error():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError), frozen([child.pid, 2**22 + 7]):  # one pid is gone
            assert _settles_in(child.pid, {"T"})
            raise RuntimeError("the measured phase failed")
        assert _settles_in(child.pid, {"S", "R"})
    finally:
        child.kill()
        child.wait()


def test_frozen_stops_a_process_with_its_descendants():
    """`tokenline serve`'s pid stands for its stages, which are its children."""
    grandchild = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(60)']); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", grandchild])
    try:
        deadline = time.monotonic() + 10
        while len(with_descendants([parent.pid])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = with_descendants([parent.pid])
        assert tree[0] == parent.pid and len(tree) == 2
        with frozen([parent.pid]):
            assert all(_settles_in(pid, {"T"}) for pid in tree)
        assert all(_settles_in(pid, {"S", "R"}) for pid in tree)
    finally:
        for pid in reversed(with_descendants([parent.pid])):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_parse_pids():
    assert parse_pids("12, 34,") == [12, 34]
    for group in ("0", "1", "12,-5"):  # a process group, init, every process: never a server
        with pytest.raises(argparse.ArgumentTypeError, match="not a server's process id"):
            parse_pids(group)


def test_the_bench_its_parents_and_the_measured_server_are_never_stopped():
    """A pattern that matched the shell running the bench (or the measured server's stages)
    must not stop the bench or the server it measures."""
    assert os.getpid() in bench_line() and os.getppid() in bench_line()
    assert with_descendants([os.getppid(), os.getpid()]) == []
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with frozen([os.getppid(), server.pid, other.pid], spared=[server.pid]):
            assert _settles_in(other.pid, {"T"})
            assert _state(server.pid) in {"S", "R"} and _state(os.getppid()) != "T"
        assert _settles_in(other.pid, {"S", "R"})
    finally:
        for child in (server, other):
            child.kill()
            child.wait()


@pytest.mark.timeout(30)
def test_a_continued_server_is_given_until_it_is_ready(stand_in_server: str) -> None:
    # "warming": /ready answers 503 three times; "quick" has no /ready; "hung" never recovers
    async def check() -> tuple[bool, bool, bool]:
        async with aiohttp.ClientSession() as client:
            return (
                await wait_ready(client, f"{stand_in_server}/warming"),
                await wait_ready(client, f"{stand_in_server}/quick"),
                await wait_ready(client, f"{stand_in_server}/hung", within=0.2),
            )

    started = time.monotonic()
    assert asyncio.run(check()) == (True, True, False)
    assert time.monotonic() - started < 5
