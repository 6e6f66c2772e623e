"""*Pipeline* answers "where does the time go and what does each stage hold": per-stage latency,
buffers, live and leaked uids, aborts, malformed frames."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from tokenline.monitoring import promql
from tokenline.monitoring.dashboards.panels import (
    PanelSpec,
    Query,
    dashboard,
    percentiles,
    with_rows,
)
from tokenline.monitoring.promql import mean, selector, summed_rate

STAGES = ("api", "tokenizer", "scheduler", "detokenizer")


def pipeline() -> dash.Dashboard:
    stage_latency = "tokenline_stage_latency_seconds"
    where_time_goes = [
        PanelSpec(
            "Time in stage p50 / p90 / p99",
            "Time a request spends inside each stage.",
            "s",
            percentiles(stage_latency, "stage"),
        ),
        PanelSpec(
            "Mean time in stage (stacked)",
            "Mean time per request in each stage, stacked: the stack's height is the mean "
            "end-to-end time the stages account for.",
            "s",
            (Query(mean(stage_latency, ("stage",)), "{{stage}}"),),
            stacked=True,
        ),
    ]
    stage_targets = f'{promql.CONTAINER}=~"{"|".join(STAGES)}"'
    held = [
        PanelSpec(
            "Buffer depth",
            "Items held in each stage's queues and buffers (api: reply items held for clients; "
            "scheduler: waiting, running, paused; every stage: inbox).",
            "short",
            (
                Query(
                    f"sum by (stage, buffer) (tokenline_buffer_depth{selector()})",
                    "{{stage}} {{buffer}}",
                ),
            ),
            width=8,
        ),
        PanelSpec(
            "Live uids",
            "Requests each stage currently holds state for.",
            "short",
            (Query(f"sum by (stage) (tokenline_live_uids{selector()})", "{{stage}}"),),
            width=8,
        ),
        PanelSpec(
            "Leaked uids",
            "Uids held past their terminal event or past deadline plus grace. Must stay 0.",
            "short",
            (Query(f"sum by (stage) (tokenline_leaked_uids{selector()})", "{{stage}}"),),
            width=8,
            red_above=1,
        ),
        PanelSpec(
            "Cache entries",
            "Entries in each bounded cache and history (grammars, tombstones, prefix blocks, "
            "...). Each has a limit: a line that climbs without levelling off is a leak.",
            "short",
            (
                Query(
                    f"sum by (stage, cache) (tokenline_cache_entries{selector()})",
                    "{{stage}} {{cache}}",
                ),
            ),
            width=12,
        ),
        PanelSpec(
            "Resident memory",
            "Each stage's resident set size. Flat under steady traffic once warm; growth "
            "that follows request count rather than load is a leak.",
            "bytes",
            (
                Query(
                    f"sum by (container) (process_resident_memory_bytes{selector(stage_targets)})",
                    "{{container}}",
                ),
            ),
            width=12,
        ),
    ]
    failures = [
        PanelSpec(
            "Aborts by reason",
            "Aborts started by the api, per second: client_disconnect, deadline, slow_client, "
            "stage_failure, shutdown.",
            "short",
            (Query(summed_rate("tokenline_aborts_total", ("reason",)), "{{reason}}"),),
            stacked=True,
            width=8,
        ),
        PanelSpec(
            "Malformed frames",
            "Frames per second that failed to decode and were dropped, by stage.",
            "short",
            (Query(summed_rate("tokenline_malformed_frames_total", ("stage",)), "{{stage}}"),),
            width=8,
        ),
        PanelSpec(
            "Stage targets up",
            "1 when Prometheus scrapes the stage's /metrics, 0 when it cannot.",
            "short",
            (
                Query(
                    f"up{selector(stage_targets)}",
                    "{{pod}} {{container}}",
                ),
            ),
            width=8,
        ),
    ]
    builder = dashboard(
        "tokenline-pipeline",
        "tokenline / Pipeline",
        "Per-stage latency, what each stage holds, and how requests fail between stages.",
    )
    return with_rows(
        builder,
        [("Where time goes", where_time_goes), ("What stages hold", held), ("Failures", failures)],
    )
