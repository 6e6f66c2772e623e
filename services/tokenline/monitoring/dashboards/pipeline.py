"""*Pipeline* answers "where does the time go and what does each stage hold": per-stage latency,
buffers, live and leaked uids, aborts, malformed frames."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from tokenline.monitoring import promql
from tokenline.monitoring.dashboards.panels import (
    PanelSpec,
    Query,
    dashboard,
    mean_by,
    percentiles,
    rate_by,
    sum_by,
    with_rows,
)
from tokenline.monitoring.promql import mean, selector

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
            mean_by(stage_latency, "stage"),
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
            sum_by("tokenline_buffer_depth", "stage", "buffer"),
            width=8,
        ),
        PanelSpec(
            "Live uids",
            "Requests each stage currently holds state for.",
            "short",
            sum_by("tokenline_live_uids", "stage"),
            width=8,
        ),
        PanelSpec(
            "Leaked uids",
            "Uids held past their terminal event or past deadline plus grace. Must stay 0.",
            "short",
            sum_by("tokenline_leaked_uids", "stage"),
            width=8,
            red_above=1,
        ),
        PanelSpec(
            "Cache entries",
            "Entries in each bounded cache and history (grammars, tombstones, prefix blocks, "
            "...). Each has a limit: a line that climbs without levelling off is a leak.",
            "short",
            sum_by("tokenline_cache_entries", "stage", "cache"),
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
            rate_by("tokenline_aborts_total", "reason"),
            stacked=True,
            width=8,
        ),
        PanelSpec(
            "Malformed frames",
            "Frames per second that failed to decode and were dropped, by stage.",
            "short",
            rate_by("tokenline_malformed_frames_total", "stage"),
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
    engine_step = [
        PanelSpec(
            "Engine step time by phase (stacked)",
            "Mean time of an engine step that ran the model, by phase: schedule, inputs (flat "
            "batch, attention metadata), forward, sample, outputs. Everything but forward is "
            "host work: on a GPU, time the device waits.",
            "s",
            mean_by("tokenline_step_phase_seconds", "phase"),
            stacked=True,
            width=8,
        ),
        PanelSpec(
            "Engine step phase p99",
            "99th percentile of each phase's time per step: a phase whose tail grows "
            "while the mean does not is a stall (a grammar, a pool reallocation).",
            "s",
            (
                Query(
                    promql.quantile(0.99, "tokenline_step_phase_seconds", ("phase",)),
                    "{{phase}}",
                ),
            ),
            width=8,
        ),
        PanelSpec(
            "Sequences per step",
            "Mean batch of the engine's steps: what each forward is shared by.",
            "short",
            (Query(mean("tokenline_step_sequences", ()), "mean batch"),),
            width=8,
        ),
        PanelSpec(
            "Tensor-parallel collective time by rank",
            "With --tensor-parallel-size above 1: mean time per step each rank spends in "
            "collectives. A rank far from the others is slow (or its peers wait for it).",
            "s",
            (Query(mean("tokenline_collective_seconds", ("rank",)), "rank {{rank}}"),),
            width=12,
        ),
        PanelSpec(
            "Tensor-parallel step time by rank",
            "With --tensor-parallel-size above 1: mean time of each rank's step.",
            "s",
            (Query(mean("tokenline_tp_rank_step_seconds", ("rank",)), "rank {{rank}}"),),
            width=12,
        ),
    ]
    builder = dashboard(
        "tokenline-pipeline",
        "tokenline / Pipeline",
        "Per-stage latency, what each stage holds, and how requests fail between stages.",
    )
    return with_rows(
        builder,
        [
            ("Where time goes", where_time_goes),
            ("Engine step", engine_step),
            ("What stages hold", held),
            ("Failures", failures),
        ],
    )
