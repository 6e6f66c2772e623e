"""Keep two servers on one machine from measuring each other.

On a small machine a server that is not under load still takes CPU (``transformers serve``
polls in a busy loop); while one target is measured, the other target's processes can be
stopped (SIGSTOP) and are always continued (SIGCONT) afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


def parse_pids(text: str) -> list[int]:
    """``"123,456"`` → ``[123, 456]``."""
    return [int(part) for part in text.split(",") if part.strip()]


@contextlib.contextmanager
def frozen(pids: list[int]) -> Iterator[None]:
    stopped = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
