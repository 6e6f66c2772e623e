"""Whether the api lets a new request into the ring now, and what it answers when not. No I/O.

One rule, in the order a client should learn about it: a replica shutting down (503: go to
another), a ring that is down (503: retry shortly), too many requests already waiting for their
first token (429: the queue is the scheduler's, so the api sheds load before the ring buffers
it), and --max-waiting-per-tenant for a tenant's own generations. `/ready` asks the same ring
health, so readiness and admission never disagree.
"""

from __future__ import annotations

from tokenline.api.http.errors import ApiError
from tokenline.api.ring.exchange import Exchange


class OpenExchanges(dict[str, Exchange]):
    """uid → the request it belongs to; a request of n choices is keyed by n uids."""

    def distinct(self) -> list[Exchange]:
        """Each open request once."""
        return list(dict.fromkeys(self.values()))

    def waiting(self, tenant: str | None = None) -> int:
        """Generations (of ``tenant``, when given) before their first token."""
        return sum(
            ex.first_token_at is None and (tenant is None or ex.tenant == tenant)
            for ex in self.distinct()
        )


def refusal(
    *,
    draining: bool,
    problem: str | None,
    waiting: int,
    max_waiting: int,
    tenant: str | None = None,
    tenant_waiting: int = 0,
    max_waiting_per_tenant: int = 0,
) -> ApiError | None:
    """The 503 or 429 a new request gets now; None: it is admitted. ``problem``: why the ring
    cannot take requests (`RingHealth.problem`); ``waiting``: requests before their first
    token, tokenizer calls included (they queue in the same inbox); ``tenant`` (a generation's)
    with ``tenant_waiting`` of its own, held to ``max_waiting_per_tenant`` (0: no limit)."""
    if draining:
        return ApiError(
            503,
            "the server is shutting down; retry on another replica",
            "shutting_down",
            retry_after=1,
        )
    if problem is not None:
        return ApiError(
            503,
            f"the pipeline is not ready ({problem}); retry shortly",
            "stage_unavailable",
            retry_after=1,
        )
    if waiting >= max_waiting:
        return ApiError(
            429,
            f"more than {max_waiting} requests are waiting; retry later",
            "too_many_requests",
            retry_after=1,
        )
    if tenant is not None and max_waiting_per_tenant and tenant_waiting >= max_waiting_per_tenant:
        return ApiError(
            429,
            f"{max_waiting_per_tenant} requests of tenant {tenant or 'default'!r} are already "
            "waiting (--max-waiting-per-tenant); retry later",
            "too_many_requests",
            retry_after=1,
        )
    return None
