"""The spec sections of the children around the stage pods: the Service, the autoscaler, the
PodMonitor, the NetworkPolicy and the InferencePool with its picker (see :mod:`definition`)."""

from __future__ import annotations

import copy
from typing import Any

from .. import names
from .schema import (
    DNS_LABEL_PATTERN,
    DURATION_PATTERN,
    boolean,
    integer,
    resources,
    string,
    string_map,
)

SERVICE = {
    "type": "object",
    "description": "The Service in front of the API stage.",
    "default": {},
    "properties": {
        "type": string(
            "The Service type.", enum=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP"
        ),
        "port": integer("The Service port.", default=8000, minimum=1, maximum=65535),
        "annotations": string_map("Annotations for the Service (e.g. for a load balancer)."),
    },
}

AUTOSCALING = {
    "type": "object",
    "description": (
        "Scale on tokenline_num_requests_waiting: a KEDA ScaledObject when KEDA is "
        "installed, else a HorizontalPodAutoscaler fed by the Prometheus adapter."
    ),
    "default": {},
    "properties": {
        "enabled": boolean("Create an autoscaler.", default=False),
        "minReplicas": integer("Fewest replicas.", default=1, minimum=1),
        "maxReplicas": integer("Most replicas.", default=4, minimum=1),
        "targetRequestsWaiting": integer(
            "Waiting requests per replica the autoscaler aims for.", default=8, minimum=1
        ),
        "provider": string(
            "`auto` picks KEDA when its CRDs exist, else a HorizontalPodAutoscaler.",
            enum=["auto", "keda", "hpa"],
            default="auto",
        ),
        "prometheusAddress": string(
            "The Prometheus KEDA queries.",
            default="http://prometheus-operated.monitoring.svc:9090",
            minLength=1,
        ),
    },
    "x-kubernetes-validations": [
        {
            "rule": "self.minReplicas <= self.maxReplicas",
            "message": "minReplicas must not exceed maxReplicas",
        }
    ],
}

MONITORING = {
    "type": "object",
    "description": "Prometheus scraping of every stage.",
    "default": {},
    "properties": {
        "podMonitor": boolean(
            "Create a PodMonitor when the monitoring.coreos.com CRDs exist.", default=True
        ),
        "interval": string("Scrape interval.", default="15s", pattern=DURATION_PATTERN),
        "labels": string_map("Extra labels on the PodMonitor, e.g. for Prometheus' selector."),
    },
}

#: Most peers one NetworkPolicy rule lists (a bound keeps the CEL rules' cost estimate small).
MAX_PEERS = 32
CIDR_PATTERN = r"^[0-9a-fA-F:.]+/[0-9]{1,3}$"

NETWORK_PEER = {
    "type": "object",
    "description": (
        "Who may connect: pods of a namespace (by name or by labels; neither means the "
        "InferenceService's own), optionally only those with podLabels; or an IP range."
    ),
    "properties": {
        "namespace": string(
            "A namespace, by name.", pattern=DNS_LABEL_PATTERN, minLength=1, maxLength=63
        ),
        "namespaceLabels": string_map("Namespaces with these labels ({} means every one)."),
        "podLabels": string_map("Only pods with these labels."),
        "cidr": string(
            "An IP range, e.g. 10.0.0.0/8 (a load balancer's or a node network's).",
            pattern=CIDR_PATTERN,
        ),
    },
    "x-kubernetes-validations": [
        {
            "rule": "!has(self.cidr) || !(has(self.namespace) || has(self.namespaceLabels) "
            "|| has(self.podLabels))",
            "message": "cidr cannot be combined with namespace, namespaceLabels or podLabels",
        },
        {
            "rule": "!(has(self.namespace) && has(self.namespaceLabels))",
            "message": "set either namespace or namespaceLabels, not both",
        },
    ],
}

NETWORK_POLICY = {
    "type": "object",
    "description": (
        "A NetworkPolicy for the pods: only the peers named here reach the api port and the "
        "metrics ports, nothing reaches anything else. Egress is not restricted."
    ),
    "default": {},
    "properties": {
        "enabled": boolean("Create the NetworkPolicy.", default=True),
        "apiFrom": {
            "type": "array",
            "description": (
                "Who may call the API (the OpenAI routes, /health, /ready); unset or empty: "
                "every pod of the InferenceService's own namespace. Name the namespace of a "
                "Gateway or Ingress controller that exposes it."
            ),
            "maxItems": MAX_PEERS,
            # A copy each: a shared node would be written to the CRD's YAML as an alias.
            "items": copy.deepcopy(NETWORK_PEER),
        },
        "metricsFrom": {
            "type": "array",
            "description": (
                "Who may scrape every stage's /metrics (the api's too, on the api port); an "
                "empty list closes the metrics ports."
            ),
            "default": [{"namespace": "monitoring"}],
            "maxItems": MAX_PEERS,
            "items": copy.deepcopy(NETWORK_PEER),
        },
        "kvEventsFrom": {
            "type": "array",
            "description": (
                "With router.kvEvents: who besides the InferencePool's picker may subscribe "
                f"to the KV-cache events (port {names.KV_EVENTS_PORT}) and ask for a replay "
                f"(port {names.KV_REPLAY_PORT}), e.g. a Dynamo-style router's namespace; "
                "unset or empty: the picker only."
            ),
            "maxItems": MAX_PEERS,
            "items": copy.deepcopy(NETWORK_PEER),
        },
    },
}

ROUTING = {
    "type": "object",
    "description": "How requests reach the pods beyond the plain Service.",
    "default": {},
    "properties": {
        "inferencePool": {
            "type": "object",
            "description": (
                "An InferencePool (Gateway API Inference Extension) over the pods' api port and "
                "its endpoint picker, which scores pods by queue, KV cache use and prefix "
                "affinity; route to it with an HTTPRoute whose backendRef is the InferencePool. "
                "A pooling model's (model.runner: pooling) picker reads no request body and "
                "scores by queue and KV cache, so /rerank and /score are routed as well as "
                "/v1/embeddings; with disaggregation it is llm-d's P/D picker."
            ),
            "default": {},
            "properties": {
                "enabled": boolean(
                    "Create the InferencePool and the picker. Unset: on when the cluster "
                    f"serves {names.INFERENCE_POOL_CRD} and the api serves plain HTTP (no "
                    "server.tlsSecret); false: the plain Service only."
                ),
                "image": string(
                    "The endpoint picker image (its flags and configuration follow "
                    f"{names.PICKER_VERSION}).",
                    default=names.PICKER_IMAGE,
                    minLength=1,
                ),
                "extProcPort": integer(
                    "The picker Service's ext-proc (gRPC) port, which the gateway calls.",
                    default=9002,
                    minimum=1,
                    maximum=65535,
                ),
                "failureMode": string(
                    "What the gateway does while the picker does not answer: FailOpen picks a "
                    "pod itself, FailClose refuses the request.",
                    enum=["FailOpen", "FailClose"],
                    default="FailOpen",
                ),
                "resources": resources(
                    "The picker container's resources.", {"cpu": "500m", "memory": "512Mi"}
                ),
            },
        },
    },
}

#: PYTHONHASHSEED takes 0..4294967295; nine digits at most keep a seed inside that range.
#: The gateway sends an InferencePool's requests as plain HTTP (its appProtocol has no https),
#: while server.tlsSecret makes the api answer HTTPS only: every request would fail.
TLS_ROUTING_RULE = {
    "rule": "!has(self.server.tlsSecret) || !has(self.routing.inferencePool.enabled) || "
    "!self.routing.inferencePool.enabled",
    "message": "server.tlsSecret makes the api serve HTTPS only, and an InferencePool's "
    "gateway speaks plain HTTP to the pods: terminate TLS at the Gateway and unset "
    "server.tlsSecret, or set routing.inferencePool.enabled to false (clients then reach the "
    "HTTPS Service directly)",
}


def routing_problems(spec: dict[str, Any]) -> list[str]:
    """:data:`TLS_ROUTING_RULE` in Python, for where no API server ran it."""
    asked = spec["routing"]["inferencePool"].get("enabled") is True
    if asked and spec["server"].get("tlsSecret"):
        return [f"spec: {TLS_ROUTING_RULE['message']}"]
    return []


HASH_SEED_PATTERN = r"^(0|[1-9][0-9]{0,8})$"

ROUTER = {
    "type": "object",
    "description": "What the pods tell cache-aware routers about themselves.",
    "default": {},
    "properties": {
        "kvEvents": {
            "type": "object",
            "description": (
                "KV-cache events in vLLM's wire format: every pod's scheduler publishes the "
                f"blocks it stores and evicts (ZMQ PUB on port {names.KV_EVENTS_PORT}, replay "
                f"on {names.KV_REPLAY_PORT}, topic kv@<pod IP>@<served model name>) and "
                f"carries the label {names.LABEL_KV_EVENTS}=true. With the InferencePool, its "
                "picker becomes llm-d's inference scheduler with the precise-prefix-cache "
                "scorer, which subscribes to every pod and routes a prompt to the pod that "
                "holds its longest prefix."
            ),
            "default": {},
            "properties": {
                "enabled": boolean("Publish KV-cache events.", default=False),
                "hashSeed": string(
                    "PYTHONHASHSEED of the schedulers, the seed of sha256_cbor block hashes; "
                    "the picker's hashSeed repeats it, so its hashes of a prompt match the "
                    "pods' (a decimal integer).",
                    default="42",
                    pattern=HASH_SEED_PATTERN,
                ),
                "pickerImage": string(
                    "The picker image with the InferencePool and events on (llm-d's inference "
                    "scheduler; its configuration follows "
                    f"{names.LLMD_PICKER_VERSION}); routing.inferencePool.image otherwise.",
                    default=names.LLMD_PICKER_IMAGE,
                    minLength=1,
                ),
                "tokenizer": string(
                    "The Hugging Face id whose tokenizer the picker loads to hash prompts; "
                    "defaults to the model's Hub id (model.name, or the hf:// uri's), else "
                    "the served name.",
                    minLength=1,
                ),
            },
        },
    },
}
