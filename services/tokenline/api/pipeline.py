"""The api's side of the ring: admission, the reply listener, heartbeats and the watchdog.

One listener task routes replies by uid into each request's `Exchange`. A heartbeat travels
the ring every ``HEARTBEAT_INTERVAL_S``; when it stops coming back, or a stage comes back with
a new identity, every in-flight request fails at once with ``stage_failure`` instead of hanging.
A watchdog enforces deadlines and slow-client limits and sweeps the leak ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator

from tokenline import protocol
from tokenline.api.errors import ApiError, abort_error
from tokenline.api.exchange import Exchange
from tokenline.ledger import LEAK_GRACE_S, Ledger
from tokenline.metrics import (
    ABORTS,
    BUFFER_DEPTH,
    E2E_LATENCY,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    LATE_REPLIES,
    PROMPT_TOKENS,
    REQUEST_ERRORS,
    REQUESTS,
    STAGE_LATENCY,
    TIME_TO_FIRST_TOKEN,
)
from tokenline.settings import Settings
from tokenline.transport import AsyncRing

log = logging.getLogger(__name__)
HEARTBEAT_INTERVAL_S = 0.5
WATCHDOG_INTERVAL_S = 0.25
RECENT_ABORTS = 65_536  # aborts remembered for re-sending after a stage restart
COUNTED_ABORTS = ("client_disconnect", "deadline", "slow_client", "stage_failure", "shutdown")


class Pipeline:
    def __init__(self, settings: Settings, ring: AsyncRing, heartbeat_timeout: float = 5.0) -> None:
        self.settings = settings
        self.ring = ring
        self.model = settings.model_name
        self.heartbeat_timeout = heartbeat_timeout
        self.exchanges: dict[str, Exchange] = {}  # uid → exchange
        self.draining = False
        self.ledger = Ledger("api")
        self._origin = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._uid_counter = itertools.count()
        self._heartbeat_seq = itertools.count()
        # (sent at, uid, reason): an abort queued to a stage that then died is lost with it
        self._recent_aborts: deque[tuple[float, str, str]] = deque(maxlen=RECENT_ABORTS)
        self._last_heartbeat: float | None = None  # when one last came back
        self._unanswered_since: float | None = None  # when the oldest unanswered one left
        self._instances: dict[str, str] = {}
        self.stage_statuses: dict[str, protocol.StageStatus] = {}
        self._tasks: list[asyncio.Task] = []
        self._late = LATE_REPLIES.labels(stage="api")
        self._depth = BUFFER_DEPTH.labels(stage="api", buffer="replies")
        self._latency = STAGE_LATENCY.labels(stage="api")
        for reason in COUNTED_ABORTS:
            ABORTS.labels(reason=reason)  # export zeros so rate() works from the start
        for reason in ("stop", "length", "abort", "error"):
            REQUESTS.labels(model=self.model, finish_reason=reason)

    # ── lifecycle ──────────────────────────────────────────────────────────────────────────────
    async def start(self) -> None:
        for loop in (self._listen, self._heartbeats, self._watchdog):
            self._tasks.append(asyncio.create_task(loop(), name=loop.__name__))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.ring.close()

    @property
    def ring_up(self) -> bool:
        """Every stage answered, and no heartbeat has gone unanswered for the timeout.

        Measured from the oldest unanswered heartbeat, not from the last answer: if the api
        itself stalls (a paused process, a long GC), the ring is not blamed for it.
        """
        unanswered = self._unanswered_since
        return (
            self._last_heartbeat is not None
            and (unanswered is None or time.monotonic() - unanswered < self.heartbeat_timeout)
            and all(s in self.stage_statuses for s in ("tokenizer", "scheduler", "detokenizer"))
        )

    @property
    def ready(self) -> bool:
        return self.ring_up and not self.draining

    def _distinct_exchanges(self) -> list[Exchange]:
        """Each open request once (a request of n choices is keyed by n uids)."""
        return list(dict.fromkeys(self.exchanges.values()))

    @property
    def in_flight(self) -> int:
        return len(self._distinct_exchanges())

    def waiting(self) -> int:
        return sum(ex.first_token_at is None for ex in self._distinct_exchanges())

    # ── admission and cleanup ──────────────────────────────────────────────────────────────────
    def new_uid(self) -> str:
        return f"{self._origin}-{next(self._uid_counter)}"

    def open(self, n: int, build: Callable[[str, int], protocol.Generate]) -> Exchange:
        """Admit a request of ``n`` choices and send them into the ring.

        Every exchange opened must be closed (`close` or the `exchange` context manager): that
        is the only place per-request api state is freed.
        """
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down; retry on another replica",
                "shutting_down",
                retry_after=1,
            )
        if not self.ring_up:
            raise ApiError(
                503,
                "the pipeline is not ready (a stage is down or starting); retry shortly",
                "stage_unavailable",
                retry_after=1,
            )
        if self.waiting() >= self.settings.max_waiting:
            raise ApiError(
                429,
                f"more than {self.settings.max_waiting} requests are waiting; retry later",
                "too_many_requests",
                retry_after=1,
            )
        base = self.new_uid()
        uids = [base] if n == 1 else [f"{base}.{i}" for i in range(n)]
        timeout = self.settings.request_timeout
        ex = Exchange(uids=uids, deadline=time.monotonic() + timeout, flow=self)
        for i, uid in enumerate(uids):
            self.exchanges[uid] = ex
            self.ledger.open(uid, timeout)
            self.ring.send_nowait(build(uid, i))
        ex.sent_at = time.monotonic()
        return ex

    def close(self, ex: Exchange) -> None:
        """Free the request; unfinished choices (client gone, handler cancelled) are aborted."""
        if ex.closed:
            return
        ex.closed = True
        if not ex.done:
            self.abort(ex, "client_disconnect")
        self._forget(ex)
        self._observe_end(ex)

    @contextlib.contextmanager
    def exchange(
        self, n: int, build: Callable[[str, int], protocol.Generate]
    ) -> Iterator[Exchange]:
        ex = self.open(n, build)
        try:
            yield ex
        finally:
            self.close(ex)

    def _forget(self, ex: Exchange) -> None:
        for uid in ex.uids:
            if self.exchanges.get(uid) is ex:
                del self.exchanges[uid]
            self.ledger.close(uid)

    def abort(self, ex: Exchange, reason: str) -> None:
        """End ``ex`` now with ``reason``; tell every stage to drop its unfinished uids."""
        live = ex.live_uids()
        if ex.done or not live:
            return
        if reason in COUNTED_ABORTS:
            ABORTS.labels(reason=reason).inc()
        log.info("abort %s (%s)", ",".join(live), reason)
        now = time.monotonic()
        for uid in live:
            self.ring.send_nowait(protocol.Abort(uid=uid, reason=reason))
            self._recent_aborts.append((now, uid, reason))
        ex.fail(abort_error(reason), abort_reason=reason)

    def _resend_recent_aborts(self) -> None:
        """After a stage restarts, send again the aborts it may have taken down with it, so
        the stages after it free those uids now rather than at deadline plus grace.

        Every abort that a stage could still be holding a uid for goes again: one sent up to
        a request timeout plus the ledgers' grace ago. A restart that took longer than the
        request timeout (a large model loading) still frees what the dead stage's peers hold.
        """
        horizon = time.monotonic() - self.settings.request_timeout - LEAK_GRACE_S
        recent = [(uid, reason) for sent, uid, reason in self._recent_aborts if sent >= horizon]
        for uid, reason in recent:
            self.ring.send_nowait(protocol.Abort(uid=uid, reason=reason))
        if recent:
            log.info("api: re-sent %d recent abort(s) after a stage restart", len(recent))

    def fail_all(self, reason: str) -> None:
        for ex in self._distinct_exchanges():
            self.abort(ex, reason)

    # ── flow control (called by exchanges) ─────────────────────────────────────────────────────
    def pause(self, ex: Exchange) -> None:
        for uid in ex.live_uids():
            self.ring.send_nowait(protocol.Pause(uid=uid))

    def resume(self, ex: Exchange) -> None:
        for uid in ex.live_uids():
            self.ring.send_nowait(protocol.Resume(uid=uid))

    # ── listener ───────────────────────────────────────────────────────────────────────────────
    async def _listen(self) -> None:
        while True:
            message = await self.ring.recv()
            try:
                self._route(message)
            except Exception:  # a bug in routing one message must not stop every request
                log.exception("api: failed to route %r", type(message).__name__)

    def _route(self, message: protocol.ToApi | None) -> None:
        if isinstance(message, protocol.ReplyBatch):
            now = time.monotonic()
            for reply in message.replies:
                if reply.stop_string:  # the detokenizer ended it; free the scheduler's copy
                    self.ring.send_nowait(protocol.Abort(uid=reply.uid, reason="stop_string"))
                ex = self.exchanges.get(reply.uid)
                if ex is None:
                    self._late.inc()
                    continue
                self._observe_tokens(ex, reply, now)
                ex.deliver(reply)
                if ex.done:
                    ex.finished_at = now
                if reply.finish_reason:
                    del self.exchanges[reply.uid]
                    self.ledger.close(reply.uid)
        elif isinstance(message, protocol.Failed):
            ex = self.exchanges.get(message.uid)
            if ex is None:
                self._late.inc()
                return
            REQUEST_ERRORS.labels(code=message.code).inc()
            for uid in ex.live_uids():
                if uid != message.uid:
                    self.ring.send_nowait(protocol.Abort(uid=uid, reason="stage_failure"))
            ex.fail(
                ApiError(message.http_status or 400, message.message, message.code, message.param)
            )
        elif isinstance(message, protocol.Heartbeat):
            self._on_heartbeat(message)
        # Abort: it has travelled the whole ring; nothing is left to do

    def _observe_tokens(self, ex: Exchange, reply: protocol.Reply, now: float) -> None:
        if reply.num_tokens == 0:
            return
        GENERATION_TOKENS.labels(model=self.model).inc(reply.num_tokens)
        if ex.first_token_at is None:
            ex.first_token_at = now
            TIME_TO_FIRST_TOKEN.labels(model=self.model).observe(now - ex.created)
        elif ex.last_token_at is not None:
            gap = (now - ex.last_token_at) / reply.num_tokens
            hist = INTER_TOKEN_LATENCY.labels(model=self.model)
            for _ in range(reply.num_tokens):
                hist.observe(gap)
        ex.last_token_at = now

    def _observe_end(self, ex: Exchange) -> None:
        e2e = time.monotonic() - ex.created
        E2E_LATENCY.labels(model=self.model).observe(e2e)
        for choice in ex.choices:
            reason = choice.finish_reason or ("abort" if ex.abort_reason else "error")
            REQUESTS.labels(model=self.model, finish_reason=reason).inc()
        if ex.error is not None and ex.abort_reason is not None:
            REQUEST_ERRORS.labels(code=ex.error.code).inc()
        if ex.prompt_tokens:
            PROMPT_TOKENS.labels(model=self.model).inc(ex.prompt_tokens)
        # The api's own time on the critical path, measured (not e2e minus the others): from
        # arrival until the request left for the tokenizer, and from the last reply until now.
        now = ex.created + e2e
        ex.timings["api_s"] = (ex.sent_at - ex.created) + (now - (ex.finished_at or now))
        ex.timings["e2e_s"] = e2e
        self._latency.observe(ex.timings["api_s"])
        log.debug(
            "request %s timings %s",
            ex.uids[0],
            " ".join(f"{k}={v * 1000:.1f}ms" for k, v in ex.timings.items()),
        )

    # ── heartbeats ─────────────────────────────────────────────────────────────────────────────
    async def _heartbeats(self) -> None:
        was_up = False
        while True:
            self.ring.send_nowait(
                protocol.Heartbeat(seq=next(self._heartbeat_seq), origin=self._origin)
            )
            if self._unanswered_since is None:
                self._unanswered_since = time.monotonic()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            up = self.ring_up
            if was_up and not up:
                log.error(
                    "api: no heartbeat for %.1fs; a stage is down or hung", self.heartbeat_timeout
                )
                if not self.draining:
                    self.fail_all("stage_failure")
            elif up and not was_up:
                log.info("api: every stage answers; ready")
            was_up = up

    def _on_heartbeat(self, heartbeat: protocol.Heartbeat) -> None:
        if heartbeat.origin != self._origin:
            return
        instances = {s.stage: s.instance for s in heartbeat.statuses}
        restarted = [s for s, i in instances.items() if self._instances.get(s, i) != i]
        if restarted:
            log.error("api: stage(s) %s restarted; failing in-flight requests", restarted)
            self._resend_recent_aborts()
            self.fail_all("stage_failure")
        self._instances.update(instances)
        self.stage_statuses = {s.stage: s for s in heartbeat.statuses}
        self._last_heartbeat = time.monotonic()
        self._unanswered_since = None

    # ── watchdog ───────────────────────────────────────────────────────────────────────────────
    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            self.check_exchanges(time.monotonic())

    def check_exchanges(self, now: float) -> None:
        exchanges = self._distinct_exchanges()
        for ex in exchanges:
            if now > ex.deadline:
                self.abort(ex, "deadline")
            elif ex.paused and now - ex.last_read > self.settings.slow_client_timeout:
                self.abort(ex, "slow_client")
        self._depth.set(sum(ex.depth for ex in exchanges))
        for uid in self.ledger.sweep(list(self.exchanges)):
            ex = self.exchanges.pop(uid, None)
            if ex is not None:
                ex.fail(abort_error("deadline"), abort_reason="deadline")
