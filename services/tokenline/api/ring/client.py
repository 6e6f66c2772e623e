"""The api's side of the ring: admission, reply routing, and the loops that keep both honest.

One listener task routes replies by uid into each request's `Exchange`, and the answers to
calls (the tokenizer's to /tokenize and /detokenize, the scheduler's to LoRA loads and unloads)
into the waiting `call`. Admission asks `admission.refusal`, over the ring health `/ready`
reads too. `Liveness` keeps that health current; a stage that dies or hangs fails every
in-flight request at once with ``stage_failure`` instead of letting it hang (during a drain,
once what a stage that stopped on purpose passed on had time to arrive). A watchdog enforces
deadlines and slow-client limits (a slow client's request is freed at its abort, and its stuck
response cut off) and sweeps the leak ledger. A send the outbox refuses is logged; it stops
neither a loop nor a cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable

import msgspec
import zmq

from tokenline import protocol
from tokenline.api.http.endpoint_metrics import EndpointMetrics
from tokenline.api.http.errors import ApiError, abort_error
from tokenline.api.http.lora_metrics import LoraInfo
from tokenline.api.ring import admission
from tokenline.api.ring.abort_log import AbortLog
from tokenline.api.ring.admission import OpenExchanges
from tokenline.api.ring.calls import Calls
from tokenline.api.ring.exchange import NORMAL_ENDS, Exchange, ended_as
from tokenline.api.ring.health import RingHealth
from tokenline.api.ring.liveness import Liveness
from tokenline.api.ring.lora_names import LoraNames
from tokenline.api.ring.request_metrics import RequestMetrics
from tokenline.api.ring.watchdog import overdue
from tokenline.ledger import LEAK_GRACE_S, Ledger
from tokenline.metrics import BUFFER_DEPTH, LATE_REPLIES, track_cache
from tokenline.settings import Settings
from tokenline.transport import AsyncRing

log = logging.getLogger(__name__)
WATCHDOG_INTERVAL_S = 0.25
# The stages drain with the api (one SIGTERM reaches them all): one stopped on purpose held
# nothing, so what it passed on reaches the api within this; a crashed one strands the rest.
DRAIN_STRAND_GRACE_S = 1.0
# Their loss strands every request in flight; the tokenizer leaves each drain at its start,
# holding nothing, and what already passed it needs it no more.
STRANDING_STAGES = ("scheduler", "detokenizer")


class RingClient:
    def __init__(
        self,
        settings: Settings,
        ring: AsyncRing,
        heartbeat_timeout: float = 5.0,
        lora_names: LoraNames | None = None,
    ) -> None:
        self.settings = settings
        self.ring = ring
        self.model = settings.model_name
        # LoRA adapters a request may name, kept current from heartbeats and load answers
        self.lora_names = lora_names or LoraNames(
            settings.enable_lora, self.model, settings.model, settings.model_names
        )
        self.lora_info = LoraInfo()
        self.exchanges = OpenExchanges()
        horizon = settings.request_timeout + LEAK_GRACE_S
        # /tokenize and /detokenize, answered by the tokenizer alone; LoRA loads and unloads,
        # answered by the scheduler
        self.calls = Calls(horizon_s=horizon)
        self.draining = False
        self._stranded_at: float | None = None  # draining, a stage was lost: fail them then
        self.ledger = Ledger("api")
        self.health = RingHealth(heartbeat_timeout)
        self.aborts = AbortLog(horizon_s=horizon)
        self._origin = f"{os.getpid()}-{os.urandom(4).hex()}"
        self.liveness = Liveness(ring, self.health, self._origin, self.aborts, to=self)
        self.metrics = RequestMetrics(self.model)
        self.endpoint_metrics = EndpointMetrics(self.model)
        self._uid_counter = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._late = LATE_REPLIES.labels(stage="api")
        self._depth = BUFFER_DEPTH.labels(stage="api", buffer="replies")
        self._unsettled_depth = BUFFER_DEPTH.labels(stage="api", buffer="unsettled_aborts")
        track_cache("api", "unsettled_aborts", self.aborts)
        track_cache("api", "abandoned_calls", self.calls.abandoned)

    # ── lifecycle ──────────────────────────────────────────────────────────────────────────────
    async def start(self) -> None:
        loops = (self._listen, self.liveness.heartbeats, self._watchdog, self.liveness.watch_links)
        for loop in loops:
            self._tasks.append(asyncio.create_task(loop(), name=loop.__name__))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.ring.close()

    def problem(self) -> str | None:
        """Why a request would be refused now (None: it would be admitted)."""
        if self.draining:
            return "draining"
        return self.health.problem(time.monotonic())

    @property
    def in_flight(self) -> int:
        return len(self.exchanges.distinct())

    def _refuse_unless_admissible(self, tenant: str | None = None) -> None:
        """Raise the 503 or 429 a new request (or tokenizer call) gets now, if any; a
        generation of ``tenant`` also meets --max-waiting-per-tenant."""
        per_tenant = self.settings.max_waiting_per_tenant
        counted = tenant is not None and per_tenant
        error = admission.refusal(
            draining=self.draining,
            problem=self.health.problem(time.monotonic()),
            waiting=len(self.calls) + self.exchanges.waiting(),
            max_waiting=self.settings.max_waiting,
            tenant=tenant,
            tenant_waiting=self.exchanges.waiting(tenant) if counted else 0,
            max_waiting_per_tenant=per_tenant,
        )
        if error is not None:
            raise error

    # ── admission and cleanup ──────────────────────────────────────────────────────────────────
    def new_uid(self) -> str:
        return f"{self._origin}-{next(self._uid_counter)}"

    def open(self, messages: list[protocol.Generate], tenant: str = "") -> Exchange:
        """Admit a request of one message a choice, give each its uid and send them into the
        ring.

        Every exchange opened must be closed (`close`): that
        is the only place per-request api state is freed.
        """
        self._refuse_unless_admissible(tenant)
        base = self.new_uid()
        uids = [base] if len(messages) == 1 else [f"{base}.{i}" for i in range(len(messages))]
        for message, uid in zip(messages, uids, strict=True):
            message.uid = uid
        # Everything is encoded before any state exists, so a request that cannot be encoded
        # leaves nothing behind.
        frames = [self.ring.encode(message) for message in messages]
        timeout = self.settings.request_timeout
        ex = Exchange(uids=uids, deadline=time.monotonic() + timeout, flow=self, tenant=tenant)
        ex.pausable = not all(_one_reply(message) for message in messages)
        for uid in uids:
            self.exchanges[uid] = ex
            self.ledger.open(uid, timeout)
        try:
            for frame in frames:
                self.ring.send_frame(frame)
        except zmq.ZMQError as exc:
            self.close(ex, "stage_failure")  # the choices already sent are aborted
            raise ApiError(
                503,
                f"the request could not be sent into the ring ({exc}); retry shortly",
                "stage_unavailable",
                retry_after=1,
            ) from exc
        ex.sent_at = time.monotonic()
        return ex

    def close(self, ex: Exchange, reason: str = "client_disconnect") -> None:
        """Free the request; unfinished choices are aborted with ``reason`` (the default: the
        client went away or the handler was cancelled)."""
        if ex.closed:
            return
        ex.closed = True
        try:
            if not ex.done:
                self.abort(ex, reason)
        finally:  # whatever the abort met, the request's state must not outlive it
            self._forget(ex)
            self.metrics.end(ex)

    def _forget(self, ex: Exchange) -> None:
        for uid in ex.uids:
            if self.exchanges.get(uid) is ex:
                del self.exchanges[uid]
            self.ledger.close(uid)

    def send(self, message: msgspec.Struct) -> bool:
        """Send ``message`` into the ring; False (logged) when the outbox refused it, which must
        not stop what sends it (a loop, a close, the other uids of an abort)."""
        try:
            self.ring.send_nowait(message)
        except zmq.ZMQError as exc:  # zmq.Again: the outbox is at its high-water mark
            log.error("api: could not send %s into the ring (%s)", type(message).__name__, exc)
            return False
        return True

    def _send_abort(self, uid: str, reason: str) -> None:
        self.send(protocol.Abort(uid=uid, reason=reason))
        # Logged even when unsent: a restarted stage's re-send gets another chance, and the
        # uid's terminal reply still settles it.
        self.aborts.sent(uid, reason, time.monotonic())

    def abort(self, ex: Exchange, reason: str) -> None:
        """End ``ex`` now with ``reason``; tell every stage to drop its unfinished uids."""
        live = ex.live_uids()
        if ex.done or not live:
            return
        self.metrics.abort(reason)
        log.info("abort %s (%s)", ",".join(live), reason)
        for uid in live:
            self._send_abort(uid, reason)
        ex.fail(abort_error(reason), abort_reason=reason)

    def fail_all(self, reason: str) -> None:
        for ex in self.exchanges.distinct():
            self.abort(ex, reason)
        self.calls.fail_all(abort_error(reason))

    def _cut_off(self, ex: Exchange) -> None:
        """Free a request whose client stopped reading, now: its handler waits on a write that
        may never end (and would close it only then), so its uids, ledger entries and buffered
        replies go at once, and its response is ended, which closes the connection."""
        self.close(ex)
        ex.drop_replies()
        if ex.cut_off is not None:
            ex.cut_off()

    # ── calls a stage answers alone ────────────────────────────────────────────────────────────
    async def call(self, build: Callable[[str], msgspec.Struct]):
        """Send the call ``build(uid)`` makes (a `TokenizeCall` or a `LoraCall`) and wait for
        its stage's answer, at most the request timeout. Raises `ApiError`: the call's own
        failure, a 503 when the ring is down (at once, or when it goes down meanwhile), a 504
        past the deadline."""
        self._refuse_unless_admissible()
        uid = self.new_uid()
        frame = self.ring.encode(build(uid))  # before any state: a failure leaves none
        timeout = self.settings.request_timeout
        answer = self.calls.open(uid)
        self.ledger.open(uid, timeout)
        try:
            self.ring.send_frame(frame)
            async with asyncio.timeout(timeout):
                return await answer
        except TimeoutError:
            raise abort_error("deadline") from None
        finally:
            self.calls.close(uid)
            self.ledger.close(uid)

    # ── flow control (called by exchanges) ─────────────────────────────────────────────────────
    def pause(self, ex: Exchange) -> None:
        for uid in ex.live_uids():
            self.send(protocol.Pause(uid=uid))

    def resume(self, ex: Exchange) -> None:
        for uid in ex.live_uids():
            self.send(protocol.Resume(uid=uid))

    # ── listener ───────────────────────────────────────────────────────────────────────────────
    async def _listen(self) -> None:
        while True:
            message = await self.ring.recv()
            try:
                self.route(message)
            except Exception:  # a bug in routing one message must not stop every request
                log.exception("api: failed to route %r", type(message).__name__)

    def route(self, message: msgspec.Struct | None) -> None:
        if isinstance(message, protocol.ReplyBatch):
            now = time.monotonic()
            for reply in message.replies:
                self._route_reply(reply, now)
        elif isinstance(message, protocol.Failed):
            self._route_failed(message)
        elif isinstance(message, protocol.TokenizerAnswer | protocol.LoraAnswer):
            if isinstance(message, protocol.LoraAnswer):
                # before the caller wakes, and even when it no longer waits: the newest set
                self.lora_names.on_answer(message)
            if not self.calls.answer(message):
                self._late.inc()
        elif isinstance(message, protocol.Heartbeat):
            self.liveness.on_heartbeat(message)
        elif isinstance(message, protocol.Link):
            self.liveness.on_link(message.reporter, message.peer, message.up)
        elif isinstance(message, protocol.Abort):
            self.aborts.settle(message.uid)  # it has travelled the whole ring

    def _route_reply(self, reply: protocol.Reply, now: float) -> None:
        if reply.stop_string:  # the detokenizer ended it; free the scheduler's copy
            self._send_abort(reply.uid, "stop_string")
        ex = self.exchanges.get(reply.uid)
        if ex is None:
            if not (reply.finish_reason and self.aborts.settle(reply.uid)):
                self._late.inc()
            return
        self.metrics.tokens(ex, reply, now)
        failing = ex.error is None and reply.finish_reason not in (None, *NORMAL_ENDS)
        ex.deliver(reply)
        if ex.done:
            ex.finished_at = now
        if reply.finish_reason:
            del self.exchanges[reply.uid]
            self.ledger.close(reply.uid)
        if failing:
            self._end_on_choice_error(ex, reply)

    def _end_on_choice_error(self, ex: Exchange, reply: protocol.Reply) -> None:
        """A choice that ended in an error (a grammar error, say) ends its request, as a
        `Failed` uid does: counted by its own code, its other choices freed at once."""
        error = ended_as(reply)
        self.metrics.error(error.code)
        for uid in ex.live_uids():
            self._send_abort(uid, "stage_failure")
        ex.fail(error)

    def _route_failed(self, failed: protocol.Failed) -> None:
        error = ApiError(failed.http_status or 400, failed.message, failed.code, failed.param)
        if self.calls.fail(failed.uid, error):
            self.metrics.error(failed.code)
            return
        ex = self.exchanges.get(failed.uid)
        if ex is None:
            if not self.aborts.settle(failed.uid):
                self._late.inc()
            return
        self.metrics.error(failed.code)
        if failed.stage == "detokenizer":  # the scheduler may still be decoding it
            self._send_abort(failed.uid, "stage_failure")
        for uid in ex.live_uids():
            if uid != failed.uid:
                self._send_abort(uid, "stage_failure")
        ex.fail(error)

    # ── ring health ────────────────────────────────────────────────────────────────────────────
    def on_statuses(self, heartbeat: protocol.Heartbeat) -> None:
        self.endpoint_metrics.update(self.health.statuses.get("scheduler"))
        # From this heartbeat's own status, not `health.statuses` (which keeps an older one
        # while the ring is distrusted): it passed the scheduler after every load answered so far.
        scheduler = next((s for s in heartbeat.statuses if s.stage == "scheduler"), None)
        self.lora_names.on_status(scheduler)
        self.lora_info.update(scheduler)

    def ring_down(self, lost: tuple[str, ...]) -> None:
        """Fail in-flight requests; ``lost``: the stages whose connections dropped or that
        restarted."""
        if not self.draining:
            self.fail_all("stage_failure")
        elif self._stranded_at is None and set(lost) & set(STRANDING_STAGES):
            # A drain stops the stages too: whether this one crashed or ended its own drain,
            # a request still in flight once its last replies had time to arrive is stranded.
            self._stranded_at = time.monotonic() + DRAIN_STRAND_GRACE_S

    # ── watchdog ───────────────────────────────────────────────────────────────────────────────
    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            try:
                self.check_exchanges(time.monotonic())
            except Exception:  # deadlines, slow clients and the ledger rely on the next round
                log.exception("api: the watchdog's round failed; the next one runs as usual")

    def check_exchanges(self, now: float) -> None:
        if self._stranded_at is not None and now >= self._stranded_at:
            self._stranded_at = None
            self.fail_all("stage_failure")
        exchanges = self.exchanges.distinct()
        for ex, reason in overdue(exchanges, now, self.settings.slow_client_timeout):
            self.abort(ex, reason)
            if reason == "slow_client":
                self._cut_off(ex)
        self._depth.set(sum(ex.depth for ex in exchanges))
        self.aborts.expire(now)
        self.calls.abandoned.prune(now)
        self._unsettled_depth.set(len(self.aborts))
        for uid in self.ledger.sweep([*self.exchanges, *self.calls]):
            ex = self.exchanges.pop(uid, None)
            if ex is not None:
                ex.fail(abort_error("deadline"), abort_reason="deadline")
            self.calls.fail(uid, abort_error("deadline"))


def _one_reply(message: protocol.Generate) -> bool:
    """Whether ``message``'s uid answers with its result alone: pooled, or no tokens asked."""
    return message.pooling is not None or message.sampling.max_tokens == 0
