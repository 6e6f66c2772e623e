"""A stage whose step takes seconds (a kernel compiled on first use, a cold GPU) still answers
its heartbeats meanwhile, so the api does not take it for dead and fail every request in
flight; the messages for the handler that came during the step are handled after it, in order.
A draining stage also waits for what others still read from it (a prefill pod's lent KV).
"""

from __future__ import annotations

import queue
import threading
import time

from tokenline import protocol
from tokenline.lifecycle import Drain
from tokenline.stage_runtime import serve_stage

STEP_S = 1.0


class Ring:
    """`serve_stage`'s view of the ring, in memory: what was sent, and when."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.sent: list[tuple[float, object]] = []

    def poll(self, timeout_ms: int) -> bool:
        try:
            item = (
                self.inbox.get(timeout=timeout_ms / 1000) if timeout_ms else self.inbox.get_nowait()
            )
        except queue.Empty:
            return False
        self.inbox.queue.appendleft(item)
        return True

    def recv_timed(self, limit: int) -> list:
        items = []
        while not self.inbox.empty() and len(items) < limit:
            items.append((time.monotonic(), self.inbox.get_nowait()))
        return items

    def send(self, message) -> None:
        self.sent.append((time.monotonic(), message))

    def close(self) -> None:
        pass


class SlowStage:
    """One step of `STEP_S` seconds; it records the messages it handles."""

    stage = "scheduler"

    def __init__(self) -> None:
        self.steps_left = 1
        self.step_began = threading.Event()
        self.step_ended = 0.0
        self.handled: list[tuple[float, str]] = []

    def handle(self, message, arrived):
        self.handled.append((time.monotonic(), message.uid))
        return []

    def has_work(self) -> bool:
        return self.steps_left > 0

    def step(self):
        self.steps_left -= 1
        self.step_began.set()
        time.sleep(STEP_S)
        self.step_ended = time.monotonic()
        return []

    def step_uids(self):
        return []

    def held(self):
        return []

    def status(self) -> protocol.StageStatus:
        return protocol.StageStatus(stage=self.stage, instance="", running=7)

    def drop(self, uid):
        return []

    def housekeeping(self, now):
        return []

    def shutdown(self):
        return []


def test_heartbeats_are_answered_while_a_long_step_runs():
    ring, stage, drain = Ring(), SlowStage(), Drain(timeout=1.0)
    loop = threading.Thread(target=serve_stage, args=(stage, ring, drain), daemon=True)
    loop.start()
    assert stage.step_began.wait(10)
    time.sleep(0.1)
    ring.inbox.put(protocol.Abort(uid="late", reason="client_disconnect"))
    sent_heartbeat = time.monotonic()
    ring.inbox.put(protocol.Heartbeat(seq=1, origin="api"))
    time.sleep(STEP_S)
    drain.started = time.monotonic()  # as SIGTERM would: nothing is held, so the loop ends
    loop.join(timeout=5)
    assert not loop.is_alive()
    beats = [(at, m) for at, m in ring.sent if isinstance(m, protocol.Heartbeat)]
    assert len(beats) == 1
    answered, heartbeat = beats[0]
    assert answered - sent_heartbeat < 0.5 and answered < stage.step_ended
    assert heartbeat.statuses[0].running == 7  # the status read before the step
    # the abort waited for the step, then was handled
    assert [uid for _, uid in stage.handled] == ["late"]
    assert stage.handled[0][0] >= stage.step_ended


class LendingStage(SlowStage):
    """No request held, but KV lent to a reader until ``lent_until``."""

    def __init__(self, lent_until: float) -> None:
        super().__init__()
        self.steps_left = 0
        self.lent_until = lent_until

    def lent(self) -> list[str]:
        return ["p1 (KV lent)"] if time.monotonic() < self.lent_until else []


def test_a_drain_waits_for_lent_kv_then_ends():
    ring, drain = Ring(), Drain(timeout=10.0)
    stage = LendingStage(lent_until=time.monotonic() + 0.8)
    loop = threading.Thread(target=serve_stage, args=(stage, ring, drain), daemon=True)
    loop.start()
    drain.started = time.monotonic()  # as SIGTERM would
    time.sleep(0.4)
    assert loop.is_alive(), "the reader has not read the lent KV yet"
    loop.join(timeout=5)
    assert not loop.is_alive()
    assert time.monotonic() >= stage.lent_until
