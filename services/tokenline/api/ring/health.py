"""Whether the ring can take a request right now: the one answer `/ready` and admission share.

Two sources, no I/O but log lines (the ring client feeds them):

- **links**: ZeroMQ monitor events on the ring's connections. The api sees its own two
  (the tokenizer behind its outbox, the detokenizer behind its inbox); every other stage
  reports the connection from its upstream peer (`protocol.Link`), so the scheduler's death is
  reported by the detokenizer. A stage that exits, crashes or is killed drops its connections
  at once, so a death shows within milliseconds, whoever restarts the process.
- **heartbeats**: one goes around the ring every interval and each stage appends its status.
  A stage that hangs keeps its connections but stops answering: the heartbeat times out.

The ring is up when every link is up, no heartbeat has gone unanswered for the timeout, and a
heartbeat sent after the last link went down has come back with every stage's status. That
last rule keeps a heartbeat that passed a stage just before it died from vouching for it.
"""

from __future__ import annotations

import logging
import time

from tokenline import protocol

log = logging.getLogger(__name__)
RING_STAGES = ("tokenizer", "scheduler", "detokenizer")


class RingHealth:
    def __init__(self, heartbeat_timeout: float = 5.0) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.links: dict[tuple[str, str], bool] = {}  # (observer, stage) → connected
        self.statuses: dict[str, protocol.StageStatus] = {}
        self.instances: dict[str, str] = {}
        self._next_seq = 0
        self._proof_seq = 0  # heartbeats from this seq on can prove the ring answers
        self._answered = False  # a heartbeat at or after _proof_seq came back
        self._unanswered_since: float | None = None  # the oldest heartbeat still out
        self._outage: tuple[float, str] | None = (time.monotonic(), "starting")  # since, why

    # ── inputs ─────────────────────────────────────────────────────────────────────────────────
    def heartbeat_sent(self, now: float) -> int:
        """Record a heartbeat leaving; returns its seq."""
        seq = self._next_seq
        self._next_seq += 1
        if self._unanswered_since is None:
            self._unanswered_since = now
        return seq

    def on_heartbeat(self, heartbeat: protocol.Heartbeat, now: float) -> list[str]:
        """A heartbeat came back; returns the stages that restarted since the last one."""
        instances = {s.stage: s.instance for s in heartbeat.statuses}
        restarted = [s for s, i in instances.items() if self.instances.get(s, i) != i]
        self.instances.update(instances)
        self._unanswered_since = None
        if heartbeat.seq >= self._proof_seq:
            self.statuses = {s.stage: s for s in heartbeat.statuses}
            self._answered = True
        return restarted

    def on_link(self, observer: str, stage: str, up: bool) -> None:
        self.links[(observer, stage)] = up
        if not up:
            self._distrust_heartbeats()

    def on_restart(self) -> None:
        """A stage came back as a new process: what the old one promised no longer holds."""
        self._distrust_heartbeats()

    def _distrust_heartbeats(self) -> None:
        self._proof_seq = self._next_seq
        self._answered = False

    # ── the answer ─────────────────────────────────────────────────────────────────────────────
    def problem(self, now: float) -> str | None:
        """None when the ring is up; else why not, in words for a log line."""
        down = sorted({stage for (_, stage), up in self.links.items() if not up})
        if down:
            return f"{', '.join(down)} disconnected"
        unanswered = self._unanswered_since
        if unanswered is not None and now - unanswered >= self.heartbeat_timeout:
            return f"no heartbeat answered for {now - unanswered:.1f}s (a stage is hung)"
        if not self._answered:
            return "waiting for every stage to answer a heartbeat"
        missing = [s for s in RING_STAGES if s not in self.statuses]
        if missing:
            return f"{', '.join(missing)} not answering"
        not_ready = [s for s in RING_STAGES if not self.statuses[s].ready]
        if not_ready:
            return f"{', '.join(not_ready)} not ready"
        return None

    def up(self, now: float) -> bool:
        return self.problem(now) is None

    def check(self, now: float, cause: str | None = None) -> bool:
        """Whether the ring is down (``cause``: it just went down for that reason); logs each
        outage as it starts and as it ends."""
        problem = self.problem(now)
        if problem is None and cause is None:
            if self._outage is not None:
                since, why = self._outage
                log.info("api: every stage answers; ready after %.2fs (%s)", now - since, why)
                self._outage = None
            return False
        if self._outage is None:
            why = cause or problem or ""
            log.error("api: the ring is down (%s); failing in-flight requests", why)
            self._outage = (now, why)
        return True

    @property
    def grammar_refusal(self) -> str:
        """Why the scheduler cannot constrain an answer to a grammar; "" when it can."""
        scheduler = self.statuses.get("scheduler")
        return scheduler.grammar_refusal if scheduler is not None else ""
