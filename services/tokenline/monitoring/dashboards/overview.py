"""*Overview* answers "is the service healthy for its clients": traffic, latency the client sees,
engine occupancy, how requests end."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash

from tokenline.monitoring.dashboards.kv_transfer import kv_transfer_panels
from tokenline.monitoring.dashboards.panels import (
    PanelSpec,
    Query,
    dashboard,
    latency_panel,
    percentiles,
    rate_by,
    sum_by,
    with_rows,
)
from tokenline.monitoring.dashboards.scheduling import speculation_panels, tenant_panels
from tokenline.monitoring.promql import selector, summed_rate


def overview() -> dash.Dashboard:
    requests = "tokenline_requests_total"
    requests_by_model = summed_rate(requests, ("model",))
    errors_by_model = summed_rate(requests, ("model",), 'finish_reason="error"')
    traffic = [
        PanelSpec(
            "Requests/s",
            "Finished requests per second, by model.",
            "reqps",
            (Query(requests_by_model, "{{model}}"),),
            width=6,
        ),
        PanelSpec(
            "Tokens/s",
            "Generated (output) and prompt tokens per second, by model.",
            "short",
            (
                Query(
                    summed_rate("tokenline_generation_tokens_total", ("model",)), "{{model}} output"
                ),
                Query(summed_rate("tokenline_prompt_tokens_total", ("model",)), "{{model}} prompt"),
            ),
            width=6,
        ),
        PanelSpec(
            "Reasoning tokens per request",
            "Thinking tokens of each finished choice that thought (models served with a "
            "reasoning parser), p50 / p90 / p99 by model.",
            "short",
            percentiles("tokenline_request_reasoning_tokens", "model"),
            width=6,
        ),
        PanelSpec(
            "Finish reasons",
            "How requests end: stop, length, abort, error.",
            "reqps",
            rate_by(requests, "finish_reason"),
            stacked=True,
            width=6,
        ),
    ]
    latency = [
        latency_panel(
            "Time to first token",
            "tokenline_time_to_first_token_seconds",
            "From request arrival at the api to the first output token, p50 / p90 / p99.",
        ),
        latency_panel(
            "Inter-token latency",
            "tokenline_inter_token_latency_seconds",
            "Time between consecutive output tokens of one request, p50 / p90 / p99.",
        ),
        latency_panel(
            "End-to-end latency",
            "tokenline_e2e_request_latency_seconds",
            "From request arrival to its terminal reply, p50 / p90 / p99.",
        ),
        latency_panel(
            "Queue time",
            "tokenline_request_queue_time_seconds",
            "Time a request waits in the scheduler before its first step, p50 / p90 / p99.",
        ),
    ]
    paused = ('stage="scheduler"', 'buffer="paused"')
    engine = [
        PanelSpec(
            "Running / waiting / paused",
            "Requests in the decode batch, waiting for admission, and paused because their "
            "client is not reading.",
            "short",
            (
                Query(
                    f"sum by (model) (tokenline_num_requests_running{selector()})",
                    "{{model}} running",
                ),
                Query(
                    f"sum by (model) (tokenline_num_requests_waiting{selector()})",
                    "{{model}} waiting",
                ),
                Query(
                    f"sum(tokenline_buffer_depth{selector(*paused)})",
                    "paused",
                ),
            ),
            width=8,
        ),
        PanelSpec(
            "KV cache usage",
            "Fraction of KV cache blocks referenced by requests, per scheduler pod (cached "
            "blocks no request holds count as free).",
            "percentunit",
            (
                Query(
                    f"max by (model, pod) (tokenline_kv_cache_usage_ratio{selector()})",
                    "{{pod}} {{model}}",
                ),
            ),
            width=8,
        ),
        PanelSpec(
            "Prefix cache hit rate",
            "Share of prompt tokens found in the prefix cache (computed by an earlier "
            "request), by model: hits / queries over the rate window. No data while no "
            "prompt arrives.",
            "percentunit",
            (
                Query(
                    f"{summed_rate('tokenline_prefix_cache_hits_total', ('model',))} / "
                    f"{summed_rate('tokenline_prefix_cache_queries_total', ('model',))}",
                    "{{model}}",
                ),
            ),
            width=8,
        ),
    ]
    errors = [
        PanelSpec(
            "Error ratio",
            "Share of finished requests that ended with finish_reason error, by model.",
            "percentunit",
            # "or ... * 0": a model with traffic but no error series shows 0, not "no data".
            (
                Query(
                    f"({errors_by_model} or {requests_by_model} * 0) / {requests_by_model}",
                    "{{model}}",
                ),
            ),
        ),
        PanelSpec(
            "Errors by code",
            "Requests per second that ended in an error, by error code.",
            "reqps",
            rate_by("tokenline_request_errors_total", "code"),
            stacked=True,
        ),
    ]
    builder = dashboard(
        "tokenline-overview",
        "tokenline / Overview",
        "Traffic, client-visible latency, engine occupancy and how requests end.",
    )
    return with_rows(
        builder,
        [
            ("Traffic", traffic),
            ("Latency", latency),
            ("Engine", engine),
            ("Errors", errors),
            ("LoRA adapters", lora_panels()),
            ("Tenants and priorities", tenant_panels()),
            ("Speculative decoding", speculation_panels()),
            ("Prefill / decode disaggregation", kv_transfer_panels()),
        ],
    )


#: vLLM's info gauge of each pod's adapters, as the endpoint picker's LoRA affinity reads it:
#: labels ``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated names) and
#: ``max_lora``; the value is when it was set, so a pod's newest series is its present.
LORA_INFO = "vllm:lora_requests_info"


def lora_panels() -> list[PanelSpec]:
    """Traffic per adapter, the adapters' states, and what each pod runs and queues now."""
    current = f"topk by (pod) (1, {LORA_INFO}{selector()})"
    return [
        PanelSpec(
            "LoRA requests/s",
            "Finished requests per second, by the adapter they named in `model`.",
            "reqps",
            rate_by("tokenline_lora_requests_total", "adapter"),
            width=6,
        ),
        PanelSpec(
            "LoRA generated tokens/s",
            "Output tokens per second, by adapter.",
            "short",
            rate_by("tokenline_lora_generated_tokens_total", "adapter"),
            width=6,
        ),
        PanelSpec(
            "LoRA adapters by state",
            "Adapters known to the schedulers, by state (on the device, in host memory, "
            "loading, failed), summed over the pods.",
            "short",
            sum_by("tokenline_lora_adapters", "state"),
            stacked=True,
            width=6,
        ),
        PanelSpec(
            "Running / waiting adapters",
            "Per pod, the adapters with requests running and waiting now, from "
            f"{LORA_INFO} (what the endpoint picker's LoRA affinity reads): one line per "
            "pod and set of adapters, named in the legend; a new line starts when they change.",
            "none",
            (
                Query(
                    "count by (pod, max_lora, running_lora_adapters, waiting_lora_adapters) "
                    f"({current})",
                    "{{pod}} running: [{{running_lora_adapters}}] waiting: "
                    "[{{waiting_lora_adapters}}] max {{max_lora}}",
                ),
            ),
            width=6,
        ),
    ]
