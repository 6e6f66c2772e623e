"""Names shared by the CRD, the manifest builders, the handlers and the chart.

Everything here is a contract: the chart's RBAC, the dashboards' label matchers and the
PodMonitor relabelling all depend on these strings.
"""

from __future__ import annotations

from tokenline.protocol import STAGES as RING_STAGES
from tokenline.settings import BY_FLAG, DEFAULT_METRICS_PORTS

GROUP = "tokenline.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("tlis",)
CRD_NAME = f"{PLURAL}.{GROUP}"

#: The field manager the operator applies children with (server-side apply).
FIELD_MANAGER = "tokenline-operator"

# Labels on every child object and on the pods.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER = f"{GROUP}/inferenceservice"
MANAGED_BY = "tokenline-operator"

# Annotations the operator writes.
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
#: On every child: a hash of the body last applied, so that a field the spec no longer sets
#: (which a subset check cannot see) still makes the operator apply again.
ANNOTATION_APPLIED_HASH = f"{GROUP}/applied-hash"
#: Prefix of kopf's own bookkeeping annotations on InferenceService objects.
KOPF_ANNOTATIONS_PREFIX = GROUP

# The four stages of one pod, in ring order; their metrics ports and port names.
STAGES: tuple[str, ...] = RING_STAGES
API_PORT: int = BY_FLAG["port"].default
METRICS_PORTS: dict[str, int] = dict(DEFAULT_METRICS_PORTS)
PORT_NAMES = {
    "api": "http",
    "tokenizer": "tok-metrics",
    "scheduler": "sched-metrics",
    "detokenizer": "detok-metrics",
}

#: The metric the autoscalers read (a gauge exported by the scheduler stage).
WAITING_METRIC = "tokenline_num_requests_waiting"

# Paths inside the stage containers. The root filesystem is read-only: every path a stage
# writes to is a volume.
MODEL_CACHE_DIR = "/var/cache/tokenline"
HF_HOME = f"{MODEL_CACHE_DIR}/huggingface"
#: The ring's IPC sockets: a volume every container of the pod shares, and no port at all.
RING_DIR = "/run/tokenline"
#: torch.compile's caches (inductor's generated code, Triton's kernels), the scheduler's only.
COMPILE_CACHE_DIR = "/var/cache/torch"
INDUCTOR_CACHE_DIR = f"{COMPILE_CACHE_DIR}/inductor"
TRITON_CACHE_DIR = f"{COMPILE_CACHE_DIR}/triton"
#: Where the api finds its keys file (spec.server.apiKeySecret), one key per line.
API_KEY_DIR = "/etc/tokenline/api-key"
API_KEY_FILE = f"{API_KEY_DIR}/api-keys"
#: Where the api finds its certificate and key (spec.server.tlsSecret).
TLS_DIR = "/etc/tokenline/tls"
TLS_CERT_FILE = f"{TLS_DIR}/tls.crt"
TLS_KEY_FILE = f"{TLS_DIR}/tls.key"
#: spec.model.uri: where the model lies in every container of the pod (read-only in the stages).
MODELS_DIR = "/models"
#: The init container that fetches (hf://, s3://, https://) or checks (pvc://, oci://, a
#: directory) the model; its termination message is the model's status.
FETCH_CONTAINER = "fetch"
#: oci:// without image volumes: the init container, from the model image, that copies it out.
OCI_COPY_CONTAINER = "oci-copy"
#: Where a model image ("modelcar", as KServe's) keeps the model: /models inside the image.
OCI_IMAGE_MODEL_DIR = "/models"
#: The label every namespace carries with its own name (Kubernetes sets it since 1.21).
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"

#: The uid and gid the image's non-root user has (see the Dockerfile).
RUN_AS_USER = 10001

# The Gateway API Inference Extension: an InferencePool and its endpoint picker (EPP).
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_API_VERSION = f"{INFERENCE_POOL_GROUP}/v1"
INFERENCE_POOL_CRD = f"inferencepools.{INFERENCE_POOL_GROUP}"
#: app.kubernetes.io/name of the picker's pods (the stage pods have "tokenline").
PICKER_APP = "tokenline-endpoint-picker"
#: The upstream release whose picker flags and EndpointPickerConfig the builders follow.
PICKER_VERSION = "v1.5.0"
PICKER_IMAGE = f"registry.k8s.io/gateway-api-inference-extension/epp:{PICKER_VERSION}"
#: What the picker reads on the api port (tokenline/api/endpoint_metrics.py serves them):
#: copies of the scheduler's gauges under their own names, so dashboards do not count twice.
ENDPOINT_METRICS = {
    "queuedRequestsSpec": "tokenline_endpoint_requests_waiting",
    "runningRequestsSpec": "tokenline_endpoint_requests_running",
    "kvUsageSpec": "tokenline_endpoint_kv_cache_usage_ratio",
    "cacheInfoSpec": "tokenline_endpoint_cache_config_info",
}
CACHE_INFO_LABELS = {
    "cacheBlockSizeLabelName": "block_size",
    "cacheNumBlocksLabelName": "num_gpu_blocks",
}

# KV-cache events (spec.router.kvEvents): the scheduler publishes vLLM's wire format on a port
# of its own, and answers replay requests on another; llm-d's picker subscribes to each pod.
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
KV_EVENTS_PORT_NAMES = {KV_EVENTS_PORT: "kv-events", KV_REPLAY_PORT: "kv-replay"}
#: Pods that publish KV-cache events carry it ("true"), so a subscriber can select them.
LABEL_KV_EVENTS = f"{GROUP}/kv-events"
#: The topic prefix every pod's events carry (``kv@<pod IP>@<served model>``), as llm-d reads.
KV_EVENTS_TOPIC_PREFIX = "kv@"
#: llm-d's inference scheduler: the Inference Extension's picker with llm-d's plugins, among
#: them the precise-prefix-cache scorer; its EndpointPickerConfig follows this release.
LLMD_PICKER_VERSION = "v0.7.0"
LLMD_PICKER_IMAGE = f"ghcr.io/llm-d/llm-d-inference-scheduler:{LLMD_PICKER_VERSION}"

# Prefill/decode disaggregation (spec.disaggregation), in llm-d's contract: two Deployments
# whose pods carry llm-d's role label, one InferencePool over both, llm-d's picker choosing a
# decode pod and, for a long enough uncached prompt, a prefill pod, and llm-d's routing
# sidecar on each decode pod, which asks the prefill pod first and hands its KV to the api.
LABEL_LLMD_ROLE = "llm-d.ai/role"
LLMD_ROLES = ("prefill", "decode")
#: The llm-d release of the P/D picker and the routing sidecar (one release ships both): the
#: first whose sidecar also disaggregates /v1/responses; their flags and configuration follow it.
LLMD_PD_VERSION = "v0.8.0"
LLMD_PD_PICKER_IMAGE = f"ghcr.io/llm-d/llm-d-inference-scheduler:{LLMD_PD_VERSION}"
ROUTING_SIDECAR_IMAGE = f"ghcr.io/llm-d/llm-d-routing-sidecar:{LLMD_PD_VERSION}"
#: The decode pod's api port behind the sidecar (the sidecar takes API_PORT); llm-d's
#: guides use the same, and it stays clear of the stages' metrics ports (API_PORT + 1..3).
SIDECAR_TARGET_PORT = 8200
#: The port vLLM's NixlConnector side channel listens on (VLLM_NIXL_SIDE_CHANNEL_PORT).
KV_SIDE_CHANNEL_PORT = 5600
KV_SIDE_CHANNEL_PORT_NAME = "kv-side"
