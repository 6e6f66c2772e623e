"""Panels of who runs first (tenants and priority levels) and of speculative decoding, for the
overview dashboard's rows of the same names."""

from __future__ import annotations

from tokenline.monitoring.dashboards.panels import PanelSpec, Query, rate_by, sum_by
from tokenline.monitoring.promql import quantile, summed_rate


def tenant_panels() -> list[PanelSpec]:
    """What each tenant and priority level gets: tokens, waiting, queue time, preemptions
    (--scheduling-policy priority, --tenant-weights; empty otherwise)."""
    return [
        PanelSpec(
            "Tokens/s by tenant",
            "Generated tokens per second, by tenant (the API key's name or the gateway's "
            "fairness id) and priority level: with --tenant-weights, busy tenants' shares follow "
            "their weights.",
            "short",
            rate_by("tokenline_tenant_generation_tokens_total", "tenant", "priority"),
            stacked=True,
            width=6,
        ),
        PanelSpec(
            "Running / waiting by tenant",
            "Requests in the scheduler now, by tenant, priority level and state.",
            "short",
            sum_by("tokenline_tenant_requests", "tenant", "priority", "state"),
            width=6,
        ),
        PanelSpec(
            "Queue time p99 by tenant",
            "Time from arrival at the scheduler to a request's first step, p99 by tenant and "
            "priority level: an urgent level's stays near one step under any flood.",
            "s",
            (
                Query(
                    quantile(0.99, "tokenline_tenant_queue_seconds", ("tenant", "priority")),
                    "{{tenant}} {{priority}}",
                ),
            ),
            width=6,
        ),
        PanelSpec(
            "Preemptions/s by tenant",
            "Running requests preempted (their KV recomputed later), by tenant and priority "
            "level: the lowest priority, then the tenant most over its share, gives way first.",
            "short",
            rate_by("tokenline_tenant_preemptions_total", "tenant", "priority"),
            stacked=True,
            width=6,
        ),
    ]


def speculation_panels() -> list[PanelSpec]:
    """What speculative decoding verifies and keeps (--speculative-config), from vLLM's
    counters."""
    drafts = summed_rate("vllm:spec_decode_num_drafts_total", ("model_name",))
    proposed = summed_rate("vllm:spec_decode_num_draft_tokens_total", ("model_name",))
    accepted = summed_rate("vllm:spec_decode_num_accepted_tokens_total", ("model_name",))
    return [
        PanelSpec(
            "Tokens per verification",
            "Mean tokens a speculating step emits for a request: the proposals kept plus the "
            "target's own next token (1: no proposal is ever right).",
            "short",
            (Query(f"1 + {accepted} / {drafts}", "{{model_name}}"),),
            width=8,
        ),
        PanelSpec(
            "Acceptance rate",
            "Share of proposed tokens the target model kept.",
            "percentunit",
            (Query(f"{accepted} / {proposed}", "{{model_name}}"),),
            width=8,
        ),
        PanelSpec(
            "Accepted by position/s",
            "Proposals kept per second by their position among a step's proposals (0: the "
            "first): how far ahead guesses stay right.",
            "short",
            rate_by("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position"),
            width=8,
        ),
    ]
