"""The Prometheus metrics contract (names and labels fixed by DESIGN.md).

Each stage is its own process, so every metric lives on the process-wide default registry and
a stage exports the ones it owns. Dashboards and alerts depend on these names.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sized
from http.server import ThreadingHTTPServer

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

# vLLM's bucket edges, so existing dashboards and habits carry over.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STAGE_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                         2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# fmt: on

# ── every stage ────────────────────────────────────────────────────────────────────────────────
LIVE_UIDS = Gauge(
    "tokenline_live_uids", "Request uids a stage currently holds state for.", ["stage"]
)
LEAKED_UIDS = Gauge(
    "tokenline_leaked_uids",
    "Uids held past their terminal event or past deadline plus grace (reclaimed when found).",
    ["stage"],
)
LEAKS_RECLAIMED = Counter(
    "tokenline_leaked_uids_reclaimed", "Leaked uids found and reclaimed.", ["stage"]
)
BUFFER_DEPTH = Gauge(
    "tokenline_buffer_depth", "Items held in a stage's queue or buffer.", ["stage", "buffer"]
)
STAGE_LATENCY = Histogram(
    "tokenline_stage_latency_seconds",
    "Time a request spends inside a stage.",
    ["stage"],
    buckets=STAGE_LATENCY_BUCKETS,
)
MALFORMED_FRAMES = Counter(
    "tokenline_malformed_frames", "Frames that failed to decode and were dropped.", ["stage"]
)
CACHE_ENTRIES = Gauge(
    "tokenline_cache_entries",
    "Entries held by a bounded cache or history (grammars, schema checks, tombstones, ...); "
    "each has a limit, so this levels off under any traffic.",
    ["stage", "cache"],
)
LATE_REPLIES = Counter(
    "tokenline_late_messages",
    "Messages that arrived for a uid the stage no longer holds; dropped.",
    ["stage"],
)

# ── api ────────────────────────────────────────────────────────────────────────────────────────
TIME_TO_FIRST_TOKEN = Histogram(
    "tokenline_time_to_first_token_seconds",
    "Time from request arrival to its first output token.",
    ["model"],
    buckets=TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "tokenline_inter_token_latency_seconds",
    "Time between two output tokens of one request.",
    ["model"],
    buckets=INTER_TOKEN_BUCKETS,
)
E2E_LATENCY = Histogram(
    "tokenline_e2e_request_latency_seconds",
    "Time from request arrival to its terminal reply.",
    ["model"],
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUESTS = Counter(
    "tokenline_requests", "Finished requests by finish reason.", ["model", "finish_reason"]
)
PROMPT_TOKENS = Counter("tokenline_prompt_tokens", "Prompt tokens of finished requests.", ["model"])
GENERATION_TOKENS = Counter("tokenline_generation_tokens", "Generated tokens.", ["model"])
REASONING_TOKENS = Histogram(
    "tokenline_request_reasoning_tokens",
    "Thinking tokens of each finished choice that thought (--reasoning-parser), markers included.",
    ["model"],
    buckets=(16, 64, 256, 1024, 4096, 16384, 65536),
)
REQUEST_ERRORS = Counter("tokenline_request_errors", "Requests that ended in an error.", ["code"])
ABORTS = Counter("tokenline_aborts", "Aborts started by the api, by reason.", ["reason"])

# ── scheduler ──────────────────────────────────────────────────────────────────────────────────
QUEUE_TIME = Histogram(
    "tokenline_request_queue_time_seconds",
    "Time a request waits in the scheduler before its first step.",
    ["model"],
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUESTS_RUNNING = Gauge(
    "tokenline_num_requests_running", "Requests in the decode batch.", ["model"]
)
REQUESTS_WAITING = Gauge(
    "tokenline_num_requests_waiting", "Requests waiting for admission.", ["model"]
)
KV_CACHE_USAGE = Gauge(
    "tokenline_kv_cache_usage_ratio",
    "Fraction of KV cache blocks referenced by requests (cached, unreferenced ones are free).",
    ["model"],
)
PREFIX_CACHE_QUERIES = Counter(
    "tokenline_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["model"]
)
PREFIX_CACHE_HITS = Counter(
    "tokenline_prefix_cache_hits", "Prompt tokens found in the prefix cache.", ["model"]
)
KV_EVENTS_DROPPED = Counter(
    "tokenline_kv_events_dropped",
    "KV-cache event batches not sent because a subscriber was at the high-water mark "
    "(a sequence gap it can replay).",
)
STEP_PHASE_TIME = Histogram(
    "tokenline_step_phase_seconds",
    "Time of each phase of an engine step that ran the model: schedule, inputs (the flat "
    "batch and attention metadata), forward, sample, outputs (the policy's update and the "
    "step's messages). Everything but forward is host work a GPU waits through.",
    ["phase"],
    buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
             0.025, 0.05, 0.1, 0.25, 1.0),
)  # fmt: skip
STEP_SEQUENCES = Histogram(
    "tokenline_step_sequences",
    "Sequences in an engine step that ran the model (its batch).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)
LORA_REQUESTS = Counter(
    "tokenline_lora_requests", "Requests admitted for each LoRA adapter.", ["adapter"]
)
LORA_GENERATED_TOKENS = Counter(
    "tokenline_lora_generated_tokens", "Tokens generated by each LoRA adapter.", ["adapter"]
)
LORA_ADAPTERS = Gauge(
    "tokenline_lora_adapters",
    "LoRA adapters by state: resident (in a device slot), host (loaded in host memory), "
    "draining (unloaded, finishing the requests they hold).",
    ["state"],
)
# Priority and fair share (--scheduling-policy priority, --tenant-weights), by tenant (the API
# key's name or the gateway's fairness header; "default" when neither) and priority level
TENANT_REQUESTS = Gauge(
    "tokenline_tenant_requests",
    "Requests in the scheduler, by tenant, priority and state (running, waiting).",
    ["tenant", "priority", "state"],
)
TENANT_QUEUE_TIME = Histogram(
    "tokenline_tenant_queue_seconds",
    "Time from arrival at the scheduler to the first step that ran a request.",
    ["tenant", "priority"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
TENANT_TOKENS = Counter(
    "tokenline_tenant_generation_tokens", "Tokens generated, by tenant and priority.",
    ["tenant", "priority"],
)  # fmt: skip
TENANT_PREEMPTIONS = Counter(
    "tokenline_tenant_preemptions",
    "Running requests preempted (their KV given up, recomputed later), by tenant and priority.",
    ["tenant", "priority"],
)
# Speculative decoding, in vLLM's names and meaning: verifications that had proposals, the
# tokens proposed, those the target kept, and those kept at each proposal position (0: first)
SPEC_DRAFTS = Counter(
    "vllm:spec_decode_num_drafts", "Verification steps that checked proposals.", ["model_name"]
)
SPEC_DRAFT_TOKENS = Counter(
    "vllm:spec_decode_num_draft_tokens", "Tokens proposed for verification.", ["model_name"]
)
SPEC_ACCEPTED_TOKENS = Counter(
    "vllm:spec_decode_num_accepted_tokens",
    "Proposed tokens the target model kept.",
    ["model_name"],
)
SPEC_ACCEPTED_PER_POSITION = Counter(
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "Proposed tokens kept, by position among a step's proposals (0: the first).",
    ["model_name", "position"],
)
# Prefill/decode disaggregation (scheduler/kv_transfer/): prompts' KV lent and read over NIXL.
KV_TRANSFER_BYTES = Counter(
    "tokenline_kv_transfer_bytes",
    "Prompt KV moved between prefill and decode pods: sent (read from this pod's loans) or "
    "received (read by this pod).",
    ["direction"],
)
KV_TRANSFER_SECONDS = Histogram(
    "tokenline_kv_transfer_seconds",
    "Time a decode request waited for its prompt's KV, handshake included, per read.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
KV_TRANSFER_FAILURES = Counter(
    "tokenline_kv_transfer_failures",
    "Prompt KV reads that failed, by reason (unreachable, unauthenticated, refused, timeout, "
    "transfer, stuck, expired, claim_refused).",
    ["reason"],
)
KV_BLOCKS_HELD_FOR_TRANSFER = Gauge(
    "tokenline_kv_blocks_held_for_transfer",
    "KV blocks a prefill pod keeps for decode pods to read (until read or the lease ends).",
)
GRAMMAR_COMPILE_TIME = Histogram(
    "tokenline_grammar_compile_seconds",
    "Time to build a new grammar's matcher (response_format, tools), off the step loop.",
    ["stage"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


def track_cache(stage: str, cache: str, sized: Sized | Callable[[], int]) -> None:
    """Export the size of ``sized`` as ``tokenline_cache_entries{stage, cache}``, read at each
    scrape. An object is held weakly, so a gauge never keeps a discarded stage alive (tests
    build many); a function (``lambda: f.cache_info().currsize``) is called as it is. The
    latest object tracked under a name is the one exported."""
    if callable(sized) and not hasattr(sized, "__len__"):
        size = sized
    else:
        ref = weakref.ref(sized)

        def size() -> int:
            held = ref()
            return 0 if held is None else len(held)

    CACHE_ENTRIES.labels(stage=stage, cache=cache).set_function(size)


def serve_metrics(port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve the default registry on ``host:port`` from a daemon thread."""
    server = ThreadingHTTPServer((host, port), MetricsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
