"""The alert rules, as a plain Prometheus rules file (``groups:``).

The Helm chart wraps these groups into a PrometheusRule; ``promtool check rules`` accepts the
file as it is. Thresholds are module constants so that tests and docs can name them.
"""

from __future__ import annotations

from tokenline.monitoring.promql import CONTAINER, INFERENCESERVICE, POD, SERVICE_LABELS, by

LEAKED_UIDS_FOR = "5m"
STAGE_DOWN_FOR = "2m"
TTFT_P99_THRESHOLD_SECONDS = 2.0
TTFT_FOR = "10m"
ERROR_RATIO_THRESHOLD = 0.05
ERROR_RATIO_FOR = "5m"
KV_CACHE_SATURATED_RATIO = 0.95
KV_CACHE_FOR = "10m"
WAITING_QUEUE_MIN = 10
WAITING_QUEUE_FOR = "10m"
KV_TRANSFER_FAILURE_RATIO = 0.05
KV_TRANSFER_FOR = "10m"
WINDOW = "5m"

_WHERE = "{{ $labels.namespace }}/{{ $labels.inferenceservice }}"


def _per_service(aggregation: str, expr: str, *labels: str) -> str:
    """``expr`` aggregated per InferenceService and ``labels``."""
    return f"{aggregation} {by(*SERVICE_LABELS, *labels)} ({expr})"


def _rate(series: str) -> str:
    return f"rate({series}[{WINDOW}])"


def _alert(
    name: str, expr: str, duration: str, severity: str, summary: str, description: str
) -> dict[str, object]:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


def leaked_uids() -> dict[str, object]:
    return _alert(
        "TokenlineLeakedUids",
        f"{_per_service('max', 'tokenline_leaked_uids', POD, 'stage')} > 0",
        LEAKED_UIDS_FOR,
        "warning",
        "tokenline stage holds leaked request state",
        f"Stage {{{{ $labels.stage }}}} of {_WHERE} pod {{{{ $labels.pod }}}} holds "
        f"{{{{ $value }}}} uids past their terminal event or deadline.",
    )


def stage_down() -> dict[str, object]:
    return _alert(
        "TokenlineStageDown",
        f'up{{{INFERENCESERVICE}!=""}} == 0',
        STAGE_DOWN_FOR,
        "critical",
        "tokenline stage is not scraped",
        f"Prometheus cannot scrape container {{{{ $labels.{CONTAINER} }}}} of {_WHERE} pod "
        "{{ $labels.pod }} ({{ $labels.instance }}).",
    )


def ttft_p99_high() -> dict[str, object]:
    rate = _rate("tokenline_time_to_first_token_seconds_bucket")
    buckets = _per_service("sum", rate, "model", "le")
    return _alert(
        "TokenlineTimeToFirstTokenHigh",
        f"histogram_quantile(0.99, {buckets}) > {TTFT_P99_THRESHOLD_SECONDS}",
        TTFT_FOR,
        "warning",
        "tokenline time to first token p99 is high",
        f"p99 time to first token of model {{{{ $labels.model }}}} on {_WHERE} is "
        f"{{{{ $value | humanizeDuration }}}} (threshold {TTFT_P99_THRESHOLD_SECONDS:g}s).",
    )


def error_ratio_high() -> dict[str, object]:
    errors = _per_service("sum", _rate('tokenline_requests_total{finish_reason="error"}'), "model")
    total = _per_service("sum", _rate("tokenline_requests_total"), "model")
    return _alert(
        "TokenlineErrorRatioHigh",
        f"{errors} / {total} > {ERROR_RATIO_THRESHOLD}",
        ERROR_RATIO_FOR,
        "critical",
        "tokenline requests are failing",
        f"{{{{ $value | humanizePercentage }}}} of requests for model {{{{ $labels.model }}}} on "
        f"{_WHERE} end with an error (threshold {ERROR_RATIO_THRESHOLD:.0%}).",
    )


def kv_cache_saturated() -> dict[str, object]:
    usage = _per_service("max", "tokenline_kv_cache_usage_ratio", POD, "model")
    waiting = _per_service("sum", "tokenline_num_requests_waiting", POD, "model")
    return _alert(
        "TokenlineKVCacheSaturated",
        f"({usage} > {KV_CACHE_SATURATED_RATIO}) and ({waiting} > 0)",
        KV_CACHE_FOR,
        "warning",
        "tokenline KV cache is full while requests wait",
        f"KV cache of model {{{{ $labels.model }}}} on {_WHERE} pod {{{{ $labels.pod }}}} is "
        f"{{{{ $value | humanizePercentage }}}} full and requests are waiting for admission.",
    )


def waiting_queue_growing() -> dict[str, object]:
    waiting = _per_service("sum", "tokenline_num_requests_waiting", "model")
    growing = _per_service("sum", f"deriv(tokenline_num_requests_waiting[{WINDOW}])", "model")
    return _alert(
        "TokenlineWaitingQueueGrowing",
        f"({waiting} > {WAITING_QUEUE_MIN}) and ({growing} > 0)",
        WAITING_QUEUE_FOR,
        "warning",
        "tokenline waiting queue keeps growing",
        f"{{{{ $value }}}} requests for model {{{{ $labels.model }}}} on {_WHERE} wait for "
        "admission and the queue keeps growing: capacity is below demand.",
    )


def kv_transfer_failing() -> dict[str, object]:
    """Decode pods' KV reads failing (issue 49): each failed read is prefilled again locally
    or fails its request, so P/D costs more than it saves. Reads that succeed are the pull
    histogram's observations; failed ones are counted by reason only."""
    failed = _per_service("sum", _rate("tokenline_kv_transfer_failures_total"))
    succeeded = _per_service("sum", _rate("tokenline_kv_transfer_seconds_count"))
    return _alert(
        "TokenlineKVTransferFailing",
        f"{failed} / ({failed} + {succeeded}) > {KV_TRANSFER_FAILURE_RATIO}",
        KV_TRANSFER_FOR,
        "warning",
        "tokenline decode pods cannot read prefill pods' KV",
        f"{{{{ $value | humanizePercentage }}}} of KV reads on {_WHERE} fail (threshold "
        f"{KV_TRANSFER_FAILURE_RATIO:.0%}): decode pods prefill those prompts again or fail "
        "them. See tokenline_kv_transfer_failures_total by reason.",
    )


def rules() -> dict[str, object]:
    """The rules file as a mapping, ready for YAML."""
    return {
        "groups": [
            {
                "name": "tokenline",
                "rules": [
                    leaked_uids(),
                    stage_down(),
                    ttft_p99_high(),
                    error_ratio_high(),
                    kv_cache_saturated(),
                    waiting_queue_growing(),
                    kv_transfer_failing(),
                ],
            }
        ]
    }
