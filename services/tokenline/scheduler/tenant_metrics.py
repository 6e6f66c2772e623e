"""The scheduler's metrics by tenant and priority level, from what the engine logged.

Tenants and priorities come from clients (a gateway header, any integer), so the labels are
bounded: the first `MAX_TENANTS` tenants and `MAX_PRIORITIES` levels seen keep their own
label, later ones share ``other``.
"""

from __future__ import annotations

from collections import Counter

from tokenline.metrics import (
    TENANT_PREEMPTIONS,
    TENANT_QUEUE_TIME,
    TENANT_REQUESTS,
    TENANT_TOKENS,
)
from tokenline.scheduler.engine import Engine

MAX_TENANTS = 64
MAX_PRIORITIES = 16


class TenantMetrics:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._tenants: dict[str, str] = {}
        self._priorities: dict[int, str] = {}
        self._shown: set[tuple[str, str, str]] = set()  # request gauges set before

    def _labels(self, tenant: str, priority: int) -> tuple[str, str]:
        """Past the bounds nothing is remembered: a client sending a new tenant each time must
        not grow the scheduler."""
        label = self._tenants.get(tenant)
        if label is None:
            label = "other"
            if len(self._tenants) < MAX_TENANTS:
                label = self._tenants[tenant] = tenant or "default"
        level = self._priorities.get(priority)
        if level is None:
            level = "other"
            if len(self._priorities) < MAX_PRIORITIES:
                level = self._priorities[priority] = str(priority)
        return label, level

    def after_step(self) -> None:
        """Tokens and queue times of the step's outputs."""
        log = self.engine.tenant_log
        if not log:
            return
        for tenant, priority, tokens, queued in log:
            labels = self._labels(tenant, priority)
            if tokens:
                TENANT_TOKENS.labels(*labels).inc(tokens)
            if queued is not None:
                TENANT_QUEUE_TIME.labels(*labels).observe(queued)
        log.clear()

    def housekeeping(self) -> None:
        """Running and waiting requests now, and the preemptions since last time."""
        policy = self.engine.policy
        counts: Counter[tuple[str, str, str]] = Counter()
        for state, seqs in (("running", policy.running), ("waiting", policy.waiting)):
            for seq in seqs:
                counts[(*self._labels(seq.tenant, seq.priority), state)] += 1
        for gone in self._shown - set(counts):
            TENANT_REQUESTS.labels(*gone).set(0)
        for labels, count in counts.items():
            TENANT_REQUESTS.labels(*labels).set(count)
        self._shown = set(counts)
        for (tenant, priority), count in policy.preempted.items():
            TENANT_PREEMPTIONS.labels(*self._labels(tenant, priority)).inc(count)
        policy.preempted.clear()
