"""The operator's own Prometheus metrics, in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server


class OperatorMetrics:
    """Reconciles, their errors and durations, and writes to child objects."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "tokenline_operator_reconciles_total",
            "Reconciliations of an InferenceService, by what triggered them and how they ended.",
            ["trigger", "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "tokenline_operator_reconcile_errors_total",
            "Failed reconciliations, by reason (invalid_spec, api).",
            ["reason"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "tokenline_operator_reconcile_duration_seconds",
            "Time one reconciliation took.",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.child_writes = Counter(
            "tokenline_operator_child_writes_total",
            "Writes to child objects (create, apply, delete): drift shows up here.",
            ["kind", "action"],
            registry=self.registry,
        )

    def listen(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve /metrics from a background thread (prometheus_client's own server)."""
        start_http_server(port, addr=addr, registry=self.registry)
