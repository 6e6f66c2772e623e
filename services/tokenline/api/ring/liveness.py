"""The loops that keep the api's view of the ring true: heartbeats, connections, restarts.

`RingHealth` (health.py) holds the answer; this feeds it. A heartbeat goes around the ring
every interval, often while the ring is down so that it is trusted again soon after it
answers, and comes back with each stage's status, which the client reads (LoRA names, endpoint
metrics). A stage whose connections drop, or that comes back as a new process, takes the ring
down: the client hears which stages were lost (`RingListener.ring_down`) and decides what that
does to the requests in flight. After a restart, aborts the dead stage may have swallowed go
again (`AbortLog`), so the stages after it free those uids now, not at deadline plus grace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Protocol

import msgspec

from tokenline import protocol
from tokenline.api.ring.abort_log import AbortLog
from tokenline.api.ring.health import RingHealth
from tokenline.transport import AsyncRing

log = logging.getLogger(__name__)
HEARTBEAT_INTERVAL_S = 0.5
RECOVERY_HEARTBEAT_INTERVAL_S = 0.05  # while the ring is down: trusted again soon after


class RingListener(Protocol):
    def send(self, message: msgspec.Struct) -> bool:
        """Into the ring; False when the outbox refused it (the sender logs it)."""

    def on_statuses(self, heartbeat: protocol.Heartbeat) -> None:
        """A heartbeat of this replica came back, with every stage's status."""

    def ring_down(self, lost: tuple[str, ...]) -> None:
        """The ring is down; ``lost``: the stages whose connections dropped or that restarted
        (none: down for another reason, a hung stage or one not ready)."""


class Liveness:
    def __init__(
        self, ring: AsyncRing, health: RingHealth, origin: str, aborts: AbortLog, to: RingListener
    ) -> None:
        self.ring = ring
        self.health = health
        self.origin = origin
        self.aborts = aborts
        self.to = to

    # ── inputs ─────────────────────────────────────────────────────────────────────────────────
    def on_link(self, observer: str, stage: str, up: bool) -> None:
        if stage == "api":
            return  # the tokenizer reporting us: we know
        self.health.on_link(observer, stage, up)
        if not up:
            self.check(f"{stage} disconnected", lost=(stage,))

    def on_heartbeat(self, heartbeat: protocol.Heartbeat) -> None:
        if heartbeat.origin != self.origin:
            return  # another replica's
        restarted = self.health.on_heartbeat(heartbeat, time.monotonic())
        self.to.on_statuses(heartbeat)
        if restarted:
            log.error("api: stage(s) %s restarted", ", ".join(restarted))
            self.health.on_restart()
            self.check(f"{', '.join(restarted)} restarted", lost=restarted)
            self._resend_unsettled_aborts()
        self.check()

    def _resend_unsettled_aborts(self) -> None:
        unsettled = self.aborts.to_resend(time.monotonic())
        for uid, reason in unsettled:
            self.to.send(protocol.Abort(uid=uid, reason=reason))
        if unsettled:
            log.info("api: re-sent %d unsettled abort(s) after a restart", len(unsettled))

    def check(self, cause: str | None = None, lost: Iterable[str] = ()) -> None:
        """Tell the client while the ring is down (`RingHealth.check` logs outages)."""
        if self.health.check(time.monotonic(), cause):
            self.to.ring_down(tuple(lost))

    # ── loops ──────────────────────────────────────────────────────────────────────────────────
    async def watch_links(self) -> None:
        await self.ring.watch_peers(lambda stage, up: self.on_link("api", stage, up))

    async def heartbeats(self) -> None:
        while True:
            interval = HEARTBEAT_INTERVAL_S
            try:
                interval = self.beat(time.monotonic())
            except Exception:  # one failed beat must not end the ones after it
                log.exception("api: sending a heartbeat failed")
            await asyncio.sleep(interval)
            try:
                if self.health.problem(time.monotonic()) is not None:
                    self.check()
            except Exception:
                log.exception("api: checking the ring's health failed")

    def beat(self, now: float) -> float:
        """Send a heartbeat; the time until the next one."""
        seq = self.health.heartbeat_sent(now)
        self.to.send(protocol.Heartbeat(seq=seq, origin=self.origin))
        return HEARTBEAT_INTERVAL_S if self.health.up(now) else RECOVERY_HEARTBEAT_INTERVAL_S
