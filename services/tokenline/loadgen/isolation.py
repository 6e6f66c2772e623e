"""Keep two servers on one machine from measuring each other.

On a small machine a server that is not under load still takes CPU (``transformers serve``
polls in a busy loop); while one target is measured, the other target's processes can be
stopped (SIGSTOP) and are always continued (SIGCONT) afterwards. A process is stopped with
all its descendants: ``tokenline serve``'s pid stands for its four stages, which are its
children, as vLLM's api server's does for its engine core. Never stopped: the bench and the
processes above it (a pattern that matched the shell running the bench would otherwise stop
the bench and the server it measures), and the measured target's own processes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path

PROC = Path("/proc")
MAX_RESCANS = 5  # a process forked while its parent was being stopped is found by a rescan

log = logging.getLogger(__name__)


def parse_pids(text: str) -> list[int]:
    """``"123,456"`` → ``[123, 456]``; 0, 1 and negative numbers are refused (to kill(2) they
    are a process group, every process, or init, not a server)."""
    pids = [int(part) for part in text.split(",") if part.strip()]
    for pid in pids:
        if pid < 2:
            raise argparse.ArgumentTypeError(
                f"{pid} is not a server's process id; give the pids of its processes "
                "(pgrep -f PATTERN | paste -sd,)"
            )
    return pids


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc (empty where it cannot be read)."""
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in PROC.iterdir():
            if not entry.name.isdigit():
                continue
            try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
    return parents


def bench_line(parents: dict[int, int] | None = None) -> set[int]:
    """This process and every process above it."""
    parents = _parents() if parents is None else parents
    line, pid = set(), os.getpid()
    while pid > 0 and pid not in line:
        line.add(pid)
        pid = parents.get(pid, 0)
    return line


def with_descendants(pids: Iterable[int], spared: set[int] = frozenset()) -> list[int]:
    """``pids`` and every process below them, parents first, each once, leaving out
    ``spared`` and what lies only below it, and the bench's own line (Linux's /proc; where it
    cannot be read, ``pids`` alone)."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    skip = set(spared) | bench_line(parents)
    found: list[int] = []
    queue = list(pids)
    while queue:
        pid = queue.pop(0)
        if pid not in found and pid not in skip:
            found.append(pid)
            queue += children.get(pid, [])
    return found


@contextlib.contextmanager
def frozen(pids: list[int], spared: Iterable[int] = ()) -> Iterator[None]:
    """``pids`` and their descendants stopped for the length of the block, except ``spared``
    (the measured target's processes) with theirs, and the bench's own line. A named process
    that cannot be signalled is an error; a descendant that cannot (another user's) is left
    running."""
    named, keep = set(pids), set(spared)
    keep.update(with_descendants(keep))  # the measured server's stages, however named
    stopped: list[int] = []
    try:
        for _ in range(MAX_RESCANS):
            new = [pid for pid in with_descendants(pids, keep) if pid not in stopped]
            if not new:
                break
            for pid in new:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    continue
                except PermissionError:
                    if pid in named:
                        raise
                    log.warning("process %d below a paused server cannot be stopped", pid)
                    keep.add(pid)
                    continue
                stopped.append(pid)
        yield
    finally:
        for pid in reversed(stopped):  # children first, before the parents that watch them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
