"""Paths, target labels and a small Prometheus HTTP client shared by the monitoring tests."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tokenline"
ALERTS_FILE = CHART / "alerts" / "tokenline-alerts.yaml"
DASHBOARDS_DIR = CHART / "dashboards"

# The target labels the Prometheus Operator and the operator's PodMonitor put on every stage
# target in a cluster; the local scrape sets the same, so filters and alerts see real values.
NAMESPACE = "tokenline-test"
INFERENCESERVICE = "tiny-test"
POD = "tokenline-test-0"
DOWN_POD = "tokenline-test-down"
FILTERS = ("namespace", "inferenceservice", "pod")

# DESIGN.md, Metrics: the names the data plane exports (counters with their `_total` suffix).
CONTRACT_METRICS = {
    "tokenline_live_uids",
    "tokenline_leaked_uids",
    "tokenline_buffer_depth",
    "tokenline_stage_latency_seconds",
    "tokenline_time_to_first_token_seconds",
    "tokenline_inter_token_latency_seconds",
    "tokenline_e2e_request_latency_seconds",
    "tokenline_request_queue_time_seconds",
    "tokenline_num_requests_running",
    "tokenline_num_requests_waiting",
    "tokenline_kv_cache_usage_ratio",
    "tokenline_prefix_cache_queries_total",
    "tokenline_prefix_cache_hits_total",
    "tokenline_requests_total",
    "tokenline_prompt_tokens_total",
    "tokenline_generation_tokens_total",
    "tokenline_request_reasoning_tokens",
    "tokenline_request_errors_total",
    "tokenline_aborts_total",
    "tokenline_malformed_frames_total",
    "tokenline_cache_entries",
}
# Issue 27: the per-adapter metrics the LoRA panels read, exported by stages serving adapters
# (--enable-lora) only, and vLLM's info gauge the endpoint picker's LoRA affinity reads.
LORA_METRICS = {
    "tokenline_lora_requests_total",
    "tokenline_lora_generated_tokens_total",
    "tokenline_lora_adapters",
}
LORA_INFO_METRIC = "vllm:lora_requests_info"
# Issue 32: the engine step's phases and batch, which every scheduler exports once a step ran.
STEP_METRICS = {"tokenline_step_phase_seconds", "tokenline_step_sequences"}
# Issue 50: per tenant and priority, exported with --scheduling-policy priority or
# --tenant-weights only.
TENANT_METRICS = {
    "tokenline_tenant_requests",
    "tokenline_tenant_queue_seconds",
    "tokenline_tenant_generation_tokens_total",
    "tokenline_tenant_preemptions_total",
}
# Issue 28: exported by rank 0 with --tensor-parallel-size above 1 only.
TENSOR_PARALLEL_METRICS = {"tokenline_collective_seconds", "tokenline_tp_rank_step_seconds"}
# Issue 49: exported by schedulers with --kv-transfer-config only (prefill and decode pods).
KV_TRANSFER_METRICS = {
    "tokenline_kv_transfer_bytes_total",
    "tokenline_kv_transfer_seconds",
    "tokenline_kv_transfer_failures_total",
    "tokenline_kv_blocks_held_for_transfer",
}
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def metric_names(expr: str) -> set[str]:
    """The tokenline metric families an expression reads (histogram series folded)."""
    return {HISTOGRAM_SERIES.sub("", name) for name in re.findall(r"\btokenline_\w+", expr)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape_config(metrics_urls: dict[str, str], down_port: int) -> dict[str, object]:
    """One target per stage, labelled like a PodMonitor target, plus one target that is down."""
    common = {"namespace": NAMESPACE, "inferenceservice": INFERENCESERVICE}
    groups = []
    for stage, url in sorted(metrics_urls.items()):
        parts = urlsplit(url)
        labels = {**common, "pod": POD, "container": stage, "__metrics_path__": parts.path}
        groups.append({"targets": [parts.netloc], "labels": labels})
    # Nothing listens on down_port: its `up` is 0, so TokenlineStageDown has something to find.
    down_labels = {**common, "pod": DOWN_POD, "container": "detokenizer"}
    groups.append({"targets": [f"127.0.0.1:{down_port}"], "labels": down_labels})
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS_FILE)],
        "scrape_configs": [{"job_name": "tokenline", "static_configs": groups}],
    }


@dataclass(frozen=True)
class Prometheus:
    url: str

    def get(self, path: str, **params: object) -> dict:
        """The decoded JSON answer of an HTTP API call, whatever its status."""
        return httpx.get(f"{self.url}{path}", params=params, timeout=10).json()

    def query(self, expr: str, at: float | None = None) -> dict:
        params: dict[str, object] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.get("/api/v1/query", **params)

    def vector(self, expr: str, at: float | None = None) -> list[dict]:
        """The samples of an instant query; fails the test unless the query succeeds."""
        answer = self.query(expr, at)
        assert answer.get("status") == "success", (expr, answer)
        return answer["data"]["result"]
