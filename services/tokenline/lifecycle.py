"""Process lifecycle shared by the stages: logging, signals, draining, identity."""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import uuid
from collections.abc import Collection

DRAIN_REPORT_INTERVAL_S = 5.0


def setup_logging(stage: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {stage}[%(process)d] %(name)s: %(message)s",
    )


def freeze_startup_heap() -> None:
    """Take what startup built (imports, model, tokenizer) out of the garbage collector's scans.

    A full collection walks every tracked object: ~100 ms in a process with torch and
    transformers loaded, ~15 ms for the api's imports, a pause that lands on whichever
    requests are in flight. Those objects live as long as the process, so scanning them again
    can never free anything; frozen, a full collection only walks what serving allocates.
    """
    gc.collect()
    gc.freeze()


def instance_id() -> str:
    """Random per process start: a changed value in a heartbeat means the stage restarted."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Drain:
    """SIGTERM or SIGINT starts draining; the stage exits once idle or when time runs out.

    All containers of a pod get SIGTERM together, so a stage keeps serving the uids it holds
    for up to ``timeout`` seconds instead of dropping them.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.started: float | None = None
        self._next_report = 0.0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.started is None:
            self.started = time.monotonic()
            logging.getLogger(__name__).info(
                "signal %d: draining for up to %.0fs", signum, self.timeout
            )
        else:  # a second signal means now
            raise SystemExit(0)

    @property
    def draining(self) -> bool:
        return self.started is not None

    def done(self, held: Collection[str]) -> bool:
        """True once draining and nothing is ``held`` (uids), or when time is up."""
        if self.started is None:
            return False
        now = time.monotonic()
        elapsed = now - self.started
        if held and now >= self._next_report:  # say what a slow drain is waiting for
            self._next_report = now + DRAIN_REPORT_INTERVAL_S
            sample = ", ".join(sorted(held)[:5])
            logging.getLogger(__name__).info(
                "draining: %d request(s) still held (%s), %.0fs left",
                len(held),
                sample,
                self.timeout - elapsed,
            )
        return (not held and elapsed > 0.5) or elapsed > self.timeout
