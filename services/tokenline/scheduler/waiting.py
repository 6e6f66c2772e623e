"""The waiting queue, in the order the scheduling policy admits from it, and the fair share of
tenants. No tensors, no I/O.

``fcfs`` (vLLM's default): arrival order; a preempted sequence goes back to the head.
``priority`` (vLLM's): the lowest ``priority`` first, arrival order within a level; a preempted
sequence keeps its priority and goes back to the head of its level.

With tenant weights (`FairShare`), within a priority level the next sequence comes from the
tenant that has had the least service per unit of weight (tokens computed for it / its weight),
oldest first within a tenant: deficit accounting over tokens, so a tenant that floods the server
gets its share and no more, and an idle tenant's share goes to whoever is busy. A tenant that
comes back after being idle starts level with the least-served busy tenant, not with credit for
the time it was away (start-time fair queueing's rule), so it cannot starve the others to catch
up.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass

from tokenline.scheduler.sequence import Sequence


@dataclass(frozen=True)
class Scheduling:
    """How waiting sequences are ordered: ``policy`` fcfs or priority; ``tenant_weights``
    (None: tenants are not told apart) turns fair share on."""

    policy: str = "fcfs"
    tenant_weights: dict[str, float] | None = None

    def shares(self) -> FairShare | None:
        return FairShare(self.tenant_weights) if self.tenant_weights is not None else None


def parse_weights(text: str | None) -> dict[str, float]:
    """``--tenant-weights`` (``team-a=1,team-b=3``; ``*`` sets every other tenant's weight)."""
    weights: dict[str, float] = {}
    for part in (text or "").replace(" ", ",").split(","):
        if not part:
            continue
        name, sep, value = part.rpartition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not name or not weight > 0:
            raise ValueError(
                f"--tenant-weights {part!r}: expected TENANT=WEIGHT with a weight above 0, "
                "e.g. team-a=1,team-b=3 (* for every other tenant)"
            )
        weights[name] = weight
    return weights


# idle tenants whose service is remembered (`FairShare._forget_idle`)
IDLE_TENANTS_KEPT = 1024


class FairShare:
    """Service per tenant, in tokens per unit of weight; who is owed the next turn."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = dict(weights)
        self._other = self.weights.pop("*", 1.0)
        self.usage: dict[str, float] = {}
        self._held: Counter[str] = Counter()  # sequences each tenant has in the scheduler

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self._other)

    def enter(self, tenant: str) -> None:
        """A sequence of ``tenant`` arrived; a tenant idle until now starts level with the
        least-served busy one."""
        if not self._held[tenant]:
            busy = [self.usage.get(t, 0.0) for t, n in self._held.items() if n]
            if busy:
                self.usage[tenant] = max(self.usage.get(tenant, 0.0), min(busy))
        self._held[tenant] += 1

    def leave(self, tenant: str) -> None:
        self._held[tenant] -= 1
        if self._held[tenant] <= 0:
            del self._held[tenant]
            if len(self.usage) > len(self._held) + IDLE_TENANTS_KEPT:
                self._forget_idle()

    def _forget_idle(self) -> None:
        """Tenants come from clients, so the idle ones' usage is bounded. An idle tenant served
        no more than the least-served busy one would come back level with it anyway
        (`enter`): forgetting it changes nothing. Past the bound, the least-served idle
        tenants go first; the most-served keep their debt longest."""
        busy = [self.usage.get(t, 0.0) for t in self._held]
        floor = min(busy) if busy else float("inf")
        idle = sorted((u, t) for t, u in self.usage.items() if t not in self._held)
        excess = len(idle) - IDLE_TENANTS_KEPT // 2
        for n, (used, tenant) in enumerate(idle):
            if used > floor and n >= excess:
                break
            del self.usage[tenant]

    def charge(self, tenant: str, tokens: int) -> None:
        self.usage[tenant] = self.usage.get(tenant, 0.0) + tokens / self.weight(tenant)

    def owed(self, tenant: str) -> float:
        """Lower is owed more: the next turn goes to the lowest."""
        return self.usage.get(tenant, 0.0)


def preemption_order(seq: Sequence, by_priority: bool, shares: FairShare | None) -> tuple:
    """Higher is preempted first: a lower priority, then more service than its tenant's share,
    then newer."""
    owed = shares.owed(seq.tenant) if shares is not None else 0.0
    return (seq.priority if by_priority else 0, owed, seq.arrival)


class WaitingQueue:
    """Sequences waiting to run, by priority level (one level unless ``by_priority``) and,
    with ``shares``, by tenant within a level; each queue in arrival order."""

    def __init__(self, by_priority: bool = False, shares: FairShare | None = None) -> None:
        self.by_priority = by_priority
        self.shares = shares
        self._levels: dict[int, dict[str, deque[Sequence]]] = {}
        self._len = 0

    def _queue(self, seq: Sequence) -> deque[Sequence]:
        level = self._levels.setdefault(seq.priority if self.by_priority else 0, {})
        tenant = seq.tenant if self.shares is not None else ""
        queue = level.get(tenant)
        if queue is None:
            queue = level[tenant] = deque()
        return queue

    def _drop_if_empty(self, seq: Sequence) -> None:
        key = seq.priority if self.by_priority else 0
        level = self._levels[key]
        tenant = seq.tenant if self.shares is not None else ""
        if not level[tenant]:
            del level[tenant]
            if not level:
                del self._levels[key]

    def append(self, seq: Sequence) -> None:
        self._queue(seq).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        self._queue(seq).appendleft(seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        self._queue(seq).remove(seq)
        self._len -= 1
        self._drop_if_empty(seq)

    def peek(self) -> Sequence:
        """The sequence admitted next (the queue must not be empty)."""
        level = self._levels[min(self._levels)] if self.by_priority else self._levels[0]
        if len(level) == 1:
            return next(iter(level.values()))[0]
        owed = self.shares.owed
        tenant = min(level, key=lambda t: (owed(t), level[t][0].arrival))
        return level[tenant][0]

    def popleft(self) -> Sequence:
        """Take the sequence `peek` names."""
        seq = self.peek()
        self._queue(seq).popleft()
        self._len -= 1
        self._drop_if_empty(seq)
        return seq

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        for level in self._levels.values():
            for queue in level.values():
                yield from queue
