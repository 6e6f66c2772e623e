"""Aborts the api sent whose end it has not seen yet, to send again after a stage restarts.

An abort is settled when it comes back around the ring, or when a terminal reply for its uid
arrives (a stage that held the uid turned the abort into its end). What a stage that died had
queued is lost with it; after a restart only the aborts still unsettled go again, not every
abort of the last request timeout. An abort unsettled past the horizon is forgotten (the
watchdog calls `expire`): every stage has reclaimed its uid by then.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_UNSETTLED = 65_536


class AbortLog:
    def __init__(self, horizon_s: float, capacity: int = MAX_UNSETTLED) -> None:
        self.horizon_s = horizon_s  # after this long every stage has reclaimed the uid itself
        self._capacity = capacity
        self._unsettled: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def sent(self, uid: str, reason: str, now: float) -> None:
        self._unsettled[uid] = (now, reason)
        self._unsettled.move_to_end(uid)
        while len(self._unsettled) > self._capacity:
            self._unsettled.popitem(last=False)

    def settle(self, uid: str) -> bool:
        """True when ``uid`` had an unsettled abort (so its late end was expected)."""
        return self._unsettled.pop(uid, None) is not None

    def expire(self, now: float) -> None:
        """Forget the aborts sent longer than the horizon ago."""
        while self._unsettled:
            uid, (sent, _) = next(iter(self._unsettled.items()))
            if now - sent <= self.horizon_s:
                break
            del self._unsettled[uid]

    def to_resend(self, now: float) -> list[tuple[str, str]]:
        """(uid, reason) of every abort still unsettled and not past the horizon."""
        self.expire(now)
        return [(uid, reason) for uid, (_, reason) in self._unsettled.items()]

    def __len__(self) -> int:
        return len(self._unsettled)
