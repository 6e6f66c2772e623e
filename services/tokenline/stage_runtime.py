"""One runtime for the tokenizer, scheduler and detokenizer stages.

A stage is a `StageHandler`: messages in, messages out, its status and the uids it holds. It
touches no socket, so a test can chain the handlers into a ring in memory. `StageRuntime`
owns everything around it:

- the ring's sockets (`transport.SyncRing`), the inbox gauge and the stage-latency clock;
- heartbeats (the handler's status is appended and the heartbeat forwarded) and reports of
  the upstream connection opening or closing (`protocol.Link`), so the api learns of a dead
  neighbour within milliseconds;
- the leak ledger: a uid opens when a message starting it arrives and closes when a message
  ending or handing it off leaves; a periodic sweep reclaims what the handler still holds
  past that;
- containment: a message whose handling raises ends its uids with an ``internal_error``
  `protocol.Failed`; a step that raises ends the uids it was computing. The process and every
  other request carry on;
- draining on SIGTERM until nothing is held or time is up;
- liveness: while a step runs, a watcher thread answers heartbeats (with the status of the
  last one answered before the step) and connection reports, so a step that takes seconds (a
  kernel compiled on first use) is not taken for a dead stage; messages for the handler wait
  for the step, as they always did (stage_liveness.py);
- giving the C heap's free pages back to the system every ``TRIM_INTERVAL_S`` (`HeapTrim`).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Collection, Iterable
from typing import Protocol

import msgspec

from tokenline import protocol, uid_lifetime
from tokenline.ledger import Ledger
from tokenline.lifecycle import Drain, freeze_startup_heap, instance_id
from tokenline.metrics import BUFFER_DEPTH
from tokenline.stage_liveness import CONTROL, Liveness
from tokenline.transport import NEXT_STAGE, SyncRing, UpstreamLink

log = logging.getLogger(__name__)
SWEEP_INTERVAL_S = 0.5
TRIM_INTERVAL_S = 10.0
UPSTREAM = {after: before for before, after in NEXT_STAGE.items()}

Outbound = list[msgspec.Struct]


class StageHandler(Protocol):
    """What a stage does, free of sockets. Every method returns the messages to send on."""

    stage: str

    def handle(self, message: msgspec.Struct, arrived: float) -> Outbound:
        """One message from the inbox; ``arrived`` is its monotonic arrival time.

        A handler may also offer ``handle_batch(items) -> Outbound`` over a whole inbox batch
        of (arrived, message) pairs; it must leave no trace when it raises.
        """
        ...

    def has_work(self) -> bool:
        """True while `step` would make progress without a new message."""
        ...

    def step(self) -> Outbound:
        """Advance work in progress (the scheduler's engine step)."""
        ...

    def step_uids(self) -> list[str]:
        """The uids the last `step` was computing (ended when that step raises)."""
        ...

    def held(self) -> Collection[str]:
        """Uids the stage holds state for right now."""
        ...

    def status(self) -> protocol.StageStatus:
        """Waiting and running counts for heartbeats (``stage`` and ``instance`` are filled)."""
        ...

    def drop(self, uid: str) -> Outbound:
        """Free whatever is held for ``uid``; the runtime sends its `protocol.Failed` after."""
        ...

    def housekeeping(self, now: float) -> Outbound:
        """Periodic work: deadlines, gauges."""
        ...

    def shutdown(self) -> Outbound:
        """Drain time is up: end everything still held."""
        ...


class StepFreeHandler:
    """Defaults for a handler that only reacts to messages (tokenizer, detokenizer): it has no
    work of its own between them."""

    def has_work(self) -> bool:
        return False

    def step(self) -> Outbound:
        return []

    def step_uids(self) -> list[str]:
        return []

    def housekeeping(self, now: float) -> Outbound:
        return []

    def shutdown(self) -> Outbound:
        return []


class HeapTrim:
    """``malloc_trim(0)`` at most every ``interval_s``: glibc's free pages go back to the system.

    Why (issue 34, measured in benchmarks/README.md, "Soak"): torch's CPU tensors come from
    glibc malloc. glibc raises its mmap threshold to the size of each large block freed (up to
    32 MiB) and its trim threshold to twice that, so after the first large tensor is freed,
    tensors of a few MiB (the scheduler's dense decode rows, a step's activations) are carved
    from the heap, and tens of MiB freed inside it are kept resident. Each new mix of sizes
    leaves the heap a little larger: the scheduler's RSS grew by about 8 MiB per 10,000
    requests with no byte more in use. ``malloc_trim`` releases every free page of every arena
    (madvise), so RSS follows what is in use. It takes well under a millisecond with tens of
    MiB free; a page given back costs a page fault when it is used again, which at one trim
    per interval is nothing next to a step. Elsewhere than glibc it does nothing."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S, clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next = clock() + interval_s
        self._trim = _malloc_trim()

    def __call__(self, now: float | None = None) -> bool:
        """Trim if the interval has passed; True when a trim ran."""
        now = self._clock() if now is None else now
        if self._trim is None or now < self._next:
            return False
        self._next = now + self.interval_s
        self._trim(0)
        return True


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim  # the symbols already loaded: libc's
    except (OSError, AttributeError):
        return None


def internal_error(uid: str, stage: str, exc: BaseException) -> protocol.Failed:
    return protocol.Failed(
        uid=uid,
        code="internal_error",
        message=(
            f"the {stage} stage failed on this request ({type(exc).__name__}: {exc}); "
            "other requests are unaffected. Retry, and report it if it repeats."
        ),
        http_status=500,
        stage=stage,
    )


class StageRuntime:
    """Drives one handler: ring in, handler, ring out; the runtime's jobs in one place.

    ``send`` and ``clock`` are injectable so the in-memory ring can run the same runtime logic
    without sockets (`process` and `tick` are its whole interface to the outside).
    """

    def __init__(self, handler: StageHandler, send, clock=time.monotonic) -> None:
        self.handler = handler
        self.stage = handler.stage
        self.instance = instance_id()
        self.ledger = Ledger(self.stage)
        self._send = send
        self._clock = clock
        self._next_sweep = 0.0
        self._trim_heap = HeapTrim(clock=clock)
        self.stepping = False  # a step runs: heartbeats carry the status from before it
        self._status: protocol.StageStatus | None = None

    # ── one inbox batch ────────────────────────────────────────────────────────────────────────
    def process(self, batch: Iterable[tuple[float, msgspec.Struct | UpstreamLink]]) -> None:
        batch = list(batch)
        handle_batch = getattr(self.handler, "handle_batch", None)
        if handle_batch is not None:
            data = [(a, m) for a, m in batch if not isinstance(m, CONTROL)]
            for _, message in data:
                for uid, timeout in uid_lifetime.started_uids(message):
                    self.ledger.open(uid, timeout)
            try:
                out = handle_batch(data) if data else []
            except Exception:
                # A batch handler has no effect when it raises (its contract), so each message
                # is handled again alone: only the one at fault fails.
                log.exception(
                    "%s: a batch of %d raised; handling one by one", self.stage, len(data)
                )
            else:
                self._emit(out)
                batch = [(a, m) for a, m in batch if isinstance(m, CONTROL)]
        for arrived, message in batch:
            if isinstance(message, UpstreamLink):
                self._emit(
                    [protocol.Link(reporter=self.stage, peer=UPSTREAM[self.stage], up=message.up)]
                )
            elif isinstance(message, protocol.Heartbeat):
                self._heartbeat(message)
            elif isinstance(message, protocol.Link):
                self._emit([message])  # another stage's report, on its way to the api
            else:
                self._handle(message, arrived)

    def _handle(self, message: msgspec.Struct, arrived: float) -> None:
        for uid, timeout in uid_lifetime.started_uids(message):
            self.ledger.open(uid, timeout)
        try:
            out = self.handler.handle(message, arrived)
        except Exception as exc:
            self._contain(uid_lifetime.uids_of(message), exc, type(message).__name__)
            return
        self._emit(out)

    def _heartbeat(self, heartbeat: protocol.Heartbeat) -> None:
        status = self._status if self.stepping and self._status is not None else self.status()
        heartbeat.statuses.append(status)
        self._emit([heartbeat])

    def status(self) -> protocol.StageStatus:
        """The handler's status, remembered for heartbeats that come while a step runs."""
        try:
            status = self.handler.status()
        except Exception:  # a status that cannot be read says "not ready", never kills
            log.exception("%s: reading the stage status failed", self.stage)
            status = protocol.StageStatus(stage=self.stage, instance=self.instance, ready=False)
        status.stage, status.instance = self.stage, self.instance
        self._status = status
        return status

    # ── work between messages ──────────────────────────────────────────────────────────────────
    def has_work(self) -> bool:
        return self.handler.has_work()

    def step(self) -> None:
        self.finish_step(self.run_step())

    def run_step(self) -> Outbound | Exception:
        """The handler's step, its failure returned rather than raised: the part of a step
        that may run on another thread (it sends nothing)."""
        try:
            return self.handler.step()
        except Exception as exc:
            return exc

    def finish_step(self, result: Outbound | Exception) -> None:
        if isinstance(result, Exception):
            self._contain(self.handler.step_uids(), result, "step")
        else:
            self._emit(result)

    def tick(self, force: bool = False) -> None:
        """Housekeeping and the leak sweep, at most every ``SWEEP_INTERVAL_S``."""
        now = self._clock()
        if not force and now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        try:
            self._emit(self.handler.housekeeping(now))
            for uid in self.ledger.sweep(list(self.handler.held())):
                self._emit(self.handler.drop(uid))
            self._trim_heap(now)
        except Exception:
            log.exception(
                "%s: housekeeping failed; trying again in %.1fs", self.stage, SWEEP_INTERVAL_S
            )

    def shutdown(self) -> None:
        """Drain time is up: the handler ends what it holds; if that raises, each uid it held
        ends with internal_error (none of their ends went out), so none goes without one."""
        held = list(self.handler.held())
        try:
            self._emit(self.handler.shutdown())
        except Exception as exc:
            self._contain(held, exc, "shutdown")
        self.tick(force=True)

    # ── out ────────────────────────────────────────────────────────────────────────────────────
    def _emit(self, messages: Outbound) -> None:
        for message in messages:
            for uid in uid_lifetime.released_uids(message):
                self.ledger.close(uid)
            self._send(message)

    def _contain(self, uids: list[str], exc: Exception, what: str) -> None:
        log.exception(
            "%s: handling %s raised; ending uid(s) %s with internal_error",
            self.stage,
            what,
            ", ".join(uids) or "(none)",
        )
        for uid in uids:
            try:
                freed = self.handler.drop(uid)
            except Exception:  # the handler's state for uid is beyond repair; drop it
                log.exception("%s: freeing %s after a failure raised too", self.stage, uid)
                freed = []
            self._emit([m for m in freed if not isinstance(m, protocol.Failed)])
            self._emit([internal_error(uid, self.stage, exc)])


def serve_stage(handler: StageHandler, ring: SyncRing, drain: Drain) -> None:
    """The stage's loop: inbox, handler, steps, housekeeping; until drained."""
    runtime = StageRuntime(handler, ring.send)
    inbox_depth = BUFFER_DEPTH.labels(stage=handler.stage, buffer="inbox")
    batch_limit = getattr(handler, "batch_limit", 10_000)
    poll_ms = getattr(handler, "poll_ms", lambda: 50)  # an idle wait the handler may shorten
    # what others still read from the stage once its requests ended (prefill pods' lent KV)
    lent = getattr(handler, "lent", list)
    liveness = Liveness(runtime, ring, batch_limit)
    runtime.tick(force=True)
    freeze_startup_heap()
    try:
        while not (drain.draining and drain.done(held=[*handler.held(), *lent()])):
            with liveness.ring_lock:
                busy = runtime.has_work()
                batch = liveness.take_held_back()
                if not batch and ring.poll(0 if busy else poll_ms()):
                    batch = ring.recv_timed(batch_limit)
                if batch:
                    inbox_depth.set(len(batch))
                    runtime.process(batch)
                    inbox_depth.set(0)
            if runtime.has_work():
                result = liveness.step()
                with liveness.ring_lock:
                    runtime.finish_step(result)
            with liveness.ring_lock:
                runtime.tick()
        with liveness.ring_lock:
            runtime.shutdown()
    finally:
        liveness.stop()
        ring.close()
