"""One writer per model directory: an flock on a file inside it.

flock, not fcntl's POSIX locks: POSIX locks belong to the process, so two fetchers in one
process (threads, or `serve` fetching for two stages) would both "hold" it. On NFS (a
ReadWriteMany PVC) Linux maps flock onto the server's byte-range locks, so pods on different
nodes still exclude each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenline.fetch.errors import FetchError
from tokenline.fetch.storage import disk_error


@contextlib.contextmanager
def exclusive(
    path: Path,
    timeout: float,
    on_wait: Callable[[str], None] | None = None,
    poll: float = 0.2,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed), waiting up to ``timeout`` s.

    The holder's pid and host are written into the file, so a waiter can say whom it waits for.
    The lock dies with its process, so a killed fetcher never blocks the next one.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    except OSError as exc:
        raise disk_error(exc, path, "cannot create the lock file") from exc
    try:
        deadline = clock() + timeout
        waited = False
        holder = "unknown"
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or holder
                    if on_wait is not None:
                        on_wait(holder)
                waited = True
                if clock() >= deadline:
                    raise FetchError(
                        f"another fetcher ({holder}) has held {path} for over {timeout:.0f} s; "
                        "wait for it, or raise the lock timeout for very large models",
                        reason="LockTimeout",
                    ) from None
                time.sleep(poll)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the flock
