"""Keep two servers on one machine from measuring each other.

On a small machine a server that is not under load still takes CPU (``transformers serve``
polls in a busy loop); while one target is measured, the other target's processes can be
stopped (SIGSTOP) and are always continued (SIGCONT) afterwards. A process is stopped with
all its descendants: ``tokenline serve``'s pid stands for its four stages, which are its
children, as vLLM's api server's does for its engine core.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")


def parse_pids(text: str) -> list[int]:
    """``"123,456"`` → ``[123, 456]``."""
    return [int(part) for part in text.split(",") if part.strip()]


def with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them, parents first, each once (Linux's /proc; where
    it cannot be read, ``pids`` alone)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in PROC.iterdir():
            if not entry.name.isdigit():
                continue
            try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    queue = list(pids)
    while queue:
        pid = queue.pop(0)
        if pid not in found:
            found.append(pid)
            queue += children.get(pid, [])
    return found


@contextlib.contextmanager
def frozen(pids: list[int]) -> Iterator[None]:
    """``pids`` and their descendants stopped for the length of the block."""
    stopped = []
    try:
        for pid in with_descendants(pids):
            if pid == os.getpid():  # below a pid given (a shell's): stopped, it would never wake
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
