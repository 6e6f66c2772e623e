"""Panels of prefill/decode disaggregation (issue 49: --kv-transfer-config, the operator's
spec.disaggregation), for the overview dashboard's row of the same name: the KV blocks decode
pods pull from prefill pods over NIXL, how long each pull takes, why pulls fail, and the
blocks prefill pods hold until their reader has them. Empty on pods that do not transfer."""

from __future__ import annotations

from tokenline.monitoring.dashboards.panels import PanelSpec, Query, rate_by, sum_by
from tokenline.monitoring.promql import quantile

#: The metrics these panels read, as the schedulers export them (counters with ``_total``).
KV_TRANSFER_METRICS = (
    "tokenline_kv_transfer_bytes_total",
    "tokenline_kv_transfer_seconds",
    "tokenline_kv_transfer_failures_total",
    "tokenline_kv_blocks_held_for_transfer",
)


def kv_transfer_panels() -> list[PanelSpec]:
    bytes_total, seconds, failures, held = KV_TRANSFER_METRICS
    return [
        PanelSpec(
            "KV transfer bytes/s",
            "KV cache bytes per second moved between prefill and decode pods: sent by prefill "
            "pods, received by decode pods (the two agree when every pull completes).",
            "Bps",
            rate_by(bytes_total, "direction"),
            width=6,
        ),
        PanelSpec(
            "KV pull time p50 / p99",
            "Time a decode pod spends pulling one request's KV blocks from its prefill pod "
            "(one observation per pull); the request waits for it instead of prefilling.",
            "s",
            tuple(Query(quantile(q, seconds, ()), f"p{round(q * 100)}") for q in (0.5, 0.99)),
            width=6,
        ),
        PanelSpec(
            "KV transfer failures/s",
            "Pulls that failed, by reason (a prefill pod that died, a refused handshake, a "
            "lease that ran out): each request then prefills locally or ends with an error, "
            "as its kv_load_failure_policy says.",
            "short",
            rate_by(failures, "reason"),
            stacked=True,
            width=6,
        ),
        PanelSpec(
            "KV blocks held for transfer",
            "Blocks prefill pods keep for a decode pod that has not read them yet, per pod: "
            "they return to the cache once read, or when the lease runs out.",
            "short",
            sum_by(held, "pod"),
            width=6,
        ),
    ]
