"""The scheduler's load on the api port, for endpoint pickers (Gateway API Inference Extension).

An endpoint picker scrapes one port per pod, the pool's target port, which is the api's; the
scheduler's own gauges live on its metrics port. The api copies them here from the
scheduler's heartbeat status, so a pod's whole load shows where the picker looks, at most a
heartbeat old.

The names differ from the scheduler's (``tokenline_num_requests_waiting`` and friends): the
dashboards and alerts sum those over every series of a pod, and would count a copy twice.
The picker is told these names (the operator's EndpointPickerConfig ``engineConfigs``).
"""

from __future__ import annotations

from prometheus_client import Gauge

from tokenline import protocol

REQUESTS_WAITING = Gauge(
    "tokenline_endpoint_requests_waiting",
    "Requests waiting for admission in this pod's scheduler (copied from its heartbeat).",
    ["model"],
)
REQUESTS_RUNNING = Gauge(
    "tokenline_endpoint_requests_running",
    "Requests in this pod's decode batch (copied from the scheduler's heartbeat).",
    ["model"],
)
KV_CACHE_USAGE = Gauge(
    "tokenline_endpoint_kv_cache_usage_ratio",
    "Fraction (0-1) of this pod's usable KV cache blocks referenced by requests.",
    ["model"],
)
#: vLLM's ``vllm:cache_config_info`` shape: always 1, the configuration in its labels.
CACHE_CONFIG_INFO = Gauge(
    "tokenline_endpoint_cache_config_info",
    "The KV cache configuration of this pod's scheduler, in labels (value always 1).",
    ["model", "block_size", "num_gpu_blocks"],
)


class EndpointMetrics:
    """Sets the endpoint gauges from the scheduler's status in each returning heartbeat."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._waiting = REQUESTS_WAITING.labels(model=model)
        self._running = REQUESTS_RUNNING.labels(model=model)
        self._kv_usage = KV_CACHE_USAGE.labels(model=model)
        self._cache_labels: tuple[str, str] | None = None

    def update(self, scheduler: protocol.StageStatus | None) -> None:
        if scheduler is None:
            return
        self._waiting.set(scheduler.waiting)
        self._running.set(scheduler.running)
        self._kv_usage.set(min(max(scheduler.kv_usage, 0.0), 1.0))
        if scheduler.num_blocks <= 0:
            return  # a status without its cache configuration: keep what was known
        labels = (str(scheduler.block_size), str(scheduler.num_blocks))
        if labels != self._cache_labels:
            # A restarted scheduler may size its cache differently: one series, the current.
            if self._cache_labels is not None:
                CACHE_CONFIG_INFO.remove(self.model, *self._cache_labels)
            CACHE_CONFIG_INFO.labels(self.model, *labels).set(1)
            self._cache_labels = labels
