"""The leak ledger: which uids a stage holds, and which it should no longer hold.

A stage opens a uid when its state is created and closes it on the uid's terminal event. A
periodic sweep compares the ledger with the uids the stage really holds: a uid that is held
after it was closed, or past its deadline plus a grace period, is a leak; so is an open uid
past it that the stage no longer holds (its state went without its end). Leaks are reported in
``tokenline_leaked_uids``, logged, counted and handed back to the stage to reclaim.

A closed uid is forgotten at once: the sweep needs only the open ones (a held uid that is not
open is a leak, whichever way it was closed), and a history of closed uids would grow with
every request served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from tokenline.metrics import LEAKED_UIDS, LEAKS_RECLAIMED, LIVE_UIDS

log = logging.getLogger(__name__)


LEAK_GRACE_S = 30.0  # past its deadline, a uid is reclaimed (and counted) after this long


class Ledger:
    def __init__(self, stage: str, grace_s: float = LEAK_GRACE_S) -> None:
        self.stage = stage
        self.grace_s = grace_s
        self._deadlines: dict[str, float] = {}
        self._live = LIVE_UIDS.labels(stage=stage)
        self._leaked = LEAKED_UIDS.labels(stage=stage)
        self._reclaimed = LEAKS_RECLAIMED.labels(stage=stage)
        self._live.set(0)
        self._leaked.set(0)

    def open(self, uid: str, timeout_s: float) -> None:
        self._deadlines[uid] = time.monotonic() + timeout_s
        self._live.set(len(self._deadlines))

    def close(self, uid: str) -> None:
        self._deadlines.pop(uid, None)
        self._live.set(len(self._deadlines))

    def is_open(self, uid: str) -> bool:
        return uid in self._deadlines

    def __len__(self) -> int:
        return len(self._deadlines)

    def sweep(self, held: Iterable[str]) -> list[str]:
        """Uids the stage should have let go: those in ``held`` that are closed or past their
        deadline plus grace, which the caller reclaims, and open ones past it that the stage
        no longer holds (it lost them without their end: only the ledger entry is left)."""
        now = time.monotonic()
        held = set(held)
        leaked = []
        for uid in held:
            deadline = self._deadlines.get(uid)
            if deadline is None or now > deadline + self.grace_s:
                leaked.append(uid)
        lost = [
            uid
            for uid, deadline in self._deadlines.items()
            if uid not in held and now > deadline + self.grace_s
        ]
        leaked += lost
        self._leaked.set(len(leaked))
        for uid in leaked:
            log.warning(
                "%s: reclaiming leaked uid %s (closed or past deadline plus %.0fs grace)",
                self.stage,
                uid,
                self.grace_s,
            )
            self._reclaimed.inc()
            self._deadlines.pop(uid, None)
        self._live.set(len(self._deadlines))
        return leaked
