"""Heartbeats answered while a stage's long step runs (`Liveness`), so that a step that takes
seconds (a kernel compiled on first use) is not taken for a dead stage."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Protocol

import msgspec

from tokenline import protocol
from tokenline.transport import SyncRing, UpstreamLink

log = logging.getLogger(__name__)
LIVENESS_POLL_S = 0.05  # how long a step runs before the watcher answers heartbeats
# what the watcher answers during a step; everything else waits for the loop
CONTROL = (UpstreamLink, protocol.Heartbeat, protocol.Link)


class SteppedRuntime(Protocol):
    """What `Liveness` needs of the stage runtime whose steps it watches (`StageRuntime`)."""

    stage: str
    stepping: bool

    def run_step(self) -> list[msgspec.Struct] | Exception: ...

    def process(self, batch: Iterable[tuple[float, msgspec.Struct | UpstreamLink]]) -> None: ...


class Liveness:
    """Heartbeats answered while a long step runs.

    Steps run on the loop's own thread (a hop to another thread costs a small model's decode
    step about 5%). A watcher thread wakes every ``LIVENESS_POLL_S``; when a step has run that
    long, it takes the ring (every use of the ring's sockets holds ``ring_lock``, so one thread
    at a time touches them) and answers the heartbeats and connection reports that came, with
    the status of the last heartbeat answered before the step; the handler's other messages
    are held back for the loop, which handles them after the step, in the order they came.
    """

    def __init__(self, runtime: SteppedRuntime, ring: SyncRing, limit: int) -> None:
        self.runtime, self.ring, self.limit = runtime, ring, limit
        self.ring_lock = threading.Lock()
        self._held_back: list = []
        self._step_started: float | None = None
        self._stopped = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, name=f"{runtime.stage}-liveness", daemon=True
        )
        self._watcher.start()

    def step(self) -> list[msgspec.Struct] | Exception:
        self._step_started = time.monotonic()
        self.runtime.stepping = True
        try:
            return self.runtime.run_step()
        finally:
            self._step_started = None
            with self.ring_lock:  # the watcher is done with the ring before the loop goes on
                self.runtime.stepping = False

    def take_held_back(self) -> list:
        held, self._held_back = self._held_back, []
        return held

    def stop(self) -> None:
        self._stopped.set()
        self._watcher.join(timeout=1)

    def _watch(self) -> None:
        while not self._stopped.wait(LIVENESS_POLL_S):
            started = self._step_started
            if started is None or time.monotonic() - started < LIVENESS_POLL_S:
                continue
            with self.ring_lock:
                if not self.runtime.stepping:
                    continue
                try:
                    while self.ring.poll(0):
                        for item in self.ring.recv_timed(self.limit):
                            if isinstance(item[1], CONTROL):
                                self.runtime.process([item])
                            else:
                                self._held_back.append(item)
                except Exception:  # never let the watcher die: the loop owns the ring's fate
                    log.exception(
                        "%s: answering heartbeats during a step failed", self.runtime.stage
                    )
