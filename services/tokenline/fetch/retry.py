"""How often and how long to wait between attempts. No I/O: the caller sleeps."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter, capped.

    ``attempts`` bounds consecutive failures that made no progress: an attempt that moved bytes
    resets the count, so a link that drops every gigabyte still finishes a 100 GB file, while a
    dead one fails within ``attempts`` tries.
    """

    attempts: int = 8
    base: float = 0.5
    cap: float = 30.0

    def delay(self, failure: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``failure``-th consecutive failure (1-based)."""
        ceiling = min(self.cap, self.base * (2 ** max(failure - 1, 0)))
        return (rng or random).uniform(ceiling / 2, ceiling)

    def exhausted(self, failure: int) -> bool:
        return failure >= self.attempts
