"""Deadlines and slow clients: which open requests must be aborted now, and why. No I/O."""

from __future__ import annotations

from collections.abc import Iterable

from tokenline.api.ring.exchange import Exchange


def overdue(
    exchanges: Iterable[Exchange], now: float, slow_client_timeout: float
) -> list[tuple[Exchange, str]]:
    """(exchange, abort reason) for each request past its deadline or paused unread too long."""
    late = []
    for ex in exchanges:
        if now > ex.deadline:
            late.append((ex, "deadline"))
        elif ex.paused and now - ex.last_read > slow_client_timeout:
            late.append((ex, "slow_client"))
    return late
