"""The InferenceService CustomResourceDefinition, built once in Python.

The chart ships the rendered copy (``charts/tokenline/crds/``); a test keeps the two equal,
and ``python -m tokenline_operator.chartgen`` rewrites it. The same schema drives the
operator's own defaulting and validation (:mod:`tokenline_operator.spec`), so an object that
reached the operator without the API server's defaulting (an older CRD, a test emulator) is
read exactly as the API server would have stored it.
"""

from __future__ import annotations

import copy
from typing import Any

from . import names

Schema = dict[str, Any]

# Kubernetes' own quantity pattern (as controller-gen renders resource.Quantity).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
#: Byte sizes the scheduler's --kv-cache-memory accepts: 8GiB, 512MiB, 8000000000.
BYTES_PATTERN = r"^[0-9]+(\.[0-9]+)?([KMGT]i?B?)?$"
#: Prometheus durations: 15s, 1m, 1m30s.
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: A browser origin as the Origin header spells it (`scheme://host[:port]`: lower case, no
#: path, no trailing slash), or `*`; anything else never equals a request's Origin.
ORIGIN_PATTERN = (
    r"^(\*|[a-z][a-z0-9+.-]*://"
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*|\[[0-9a-f:.]+\])"
    r"(:[0-9]{1,5})?)$"
)
#: Most origins the api allows (the list is compared per request).
MAX_ALLOWED_ORIGINS = 64


def _string(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _integer(description: str, **extra: Any) -> Schema:
    return {"type": "integer", "description": description, **extra}


def _string_map(description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {"type": "string"},
    }


def _quantity(description: str = "A Kubernetes quantity, e.g. 500m, 2, 4Gi.") -> Schema:
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": True,
    }


def _int_or_string(description: str) -> Schema:
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
    }


def _resources(description: str, requests: dict[str, str]) -> Schema:
    quantities = {"type": "object", "additionalProperties": _quantity()}
    return {
        "type": "object",
        "description": description,
        "default": {"requests": dict(requests)},
        "properties": {
            "requests": {**quantities, "description": "Minimum resources the stage needs."},
            "limits": {**quantities, "description": "Maximum resources the stage may use."},
        },
    }


MODEL = {
    "type": "object",
    "description": "The model to serve.",
    "required": ["name"],
    "properties": {
        "name": _string(
            "`tiny` (the offline tiny model), a directory inside the pod, or a Hugging Face id.",
            minLength=1,
        ),
        "servedName": _string(
            "The name /v1/models lists and requests use; defaults to `name`.", minLength=1
        ),
        "revision": _string("A Hugging Face revision: branch, tag or commit.", minLength=1),
        "hfTokenSecret": {
            "type": "object",
            "description": "A Secret holding a Hugging Face token, for gated models.",
            "required": ["name"],
            "properties": {
                "name": _string("The Secret's name.", minLength=1),
                "key": _string("The key inside the Secret.", default="HF_TOKEN", minLength=1),
            },
        },
        "cache": {
            "type": "object",
            "description": (
                "Where downloaded weights live: an emptyDir per pod by default, or an "
                "existing PersistentVolumeClaim shared by the replicas."
            ),
            "properties": {
                "sizeLimit": _quantity("The emptyDir's size limit, e.g. 50Gi."),
                "claimName": _string("An existing PersistentVolumeClaim to mount.", minLength=1),
            },
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.sizeLimit) && has(self.claimName))",
                    "message": "set either sizeLimit (emptyDir) or claimName (PVC), not both",
                }
            ],
        },
    },
}

ENGINE = {
    "type": "object",
    "description": "Settings of the scheduler/runner stage.",
    "default": {},
    "properties": {
        "gpus": _integer(
            "GPUs (nvidia.com/gpu) the scheduler container requests; 0 runs on CPU.",
            default=1,
            minimum=0,
            maximum=8,
        ),
        "device": _string("Where the model runs.", enum=["auto", "cpu", "cuda"], default="auto"),
        "dtype": _string(
            "Weights' data type.",
            enum=["auto", "float32", "bfloat16", "float16"],
            default="auto",
        ),
        "maxModelLen": _integer(
            "Longest prompt plus completion, in tokens; defaults to the model's own limit.",
            minimum=1,
        ),
        "kvCacheMemory": _string(
            "KV cache budget in bytes, e.g. 8GiB; defaults to what gpuMemoryUtilization leaves.",
            pattern=BYTES_PATTERN,
        ),
        "gpuMemoryUtilization": {
            "type": "number",
            "description": "Fraction of GPU memory the runner may use.",
            "default": 0.9,
            "minimum": 0.05,
            "maximum": 1,
        },
        "maxNumSeqs": _integer("Sequences decoded together at most.", default=256, minimum=1),
        "maxNumBatchedTokens": _integer(
            "Tokens one forward step may hold at most; defaults to the scheduler's own for its "
            "device: 2048 on a GPU, 128 on CPU.",
            minimum=1,
        ),
        "compile": {
            "type": "boolean",
            "description": "torch.compile each layer's projections, norm and MLP (fewer kernel "
            "launches on a GPU); the first steps wait for compilation.",
            "default": False,
        },
        "prefixCaching": {
            "type": "boolean",
            "description": "Keep the KV of computed prompt prefixes and reuse it for prompts that "
            "start the same way (system prompts, conversations, tool definitions).",
            "default": True,
        },
    },
}

SERVER = {
    "type": "object",
    "description": "Lifecycle settings of the API stage and of the pod.",
    "default": {},
    "properties": {
        "requestTimeoutSeconds": _integer("Per-request deadline.", default=600, minimum=1),
        "slowClientTimeoutSeconds": _integer(
            "How long a paused stream may stay unread before it is aborted.",
            default=30,
            minimum=1,
        ),
        "drainTimeoutSeconds": _integer(
            "How long in-flight requests get after SIGTERM.", default=30, minimum=0
        ),
        "maxWaiting": _integer(
            "Waiting requests before the API answers 429/503.", default=256, minimum=0
        ),
        "startupTimeoutSeconds": _integer(
            "How long a new pod may take to download and load the model before it is restarted.",
            default=1800,
            minimum=30,
        ),
        "logLevel": _string(
            "Log level of every stage.",
            enum=["debug", "info", "warning", "error"],
            default="info",
        ),
        "allowedOrigins": {
            "type": "array",
            "description": (
                "Browser origins whose pages may call the API (CORS), e.g. "
                "https://app.example.com, or * for any; unset or empty: no CORS headers. "
                "Write each as the browser sends it: lower case, no path or trailing slash, "
                "no default port."
            ),
            "maxItems": MAX_ALLOWED_ORIGINS,
            "items": _string("An origin, scheme://host[:port], or *.", pattern=ORIGIN_PATTERN),
        },
        "apiKeySecret": {
            "type": "object",
            "description": (
                "A Secret whose key holds the API keys, one per line: every route but /health, "
                "/ready and /metrics then needs `Authorization: Bearer <key>`. A changed Secret "
                "takes effect without a restart."
            ),
            "required": ["name"],
            "properties": {
                "name": _string("The Secret's name.", minLength=1),
                "key": _string("The key inside the Secret.", default="api-keys", minLength=1),
            },
        },
        "tlsSecret": {
            "type": "object",
            "description": (
                "A kubernetes.io/tls Secret (tls.crt, tls.key): the api serves HTTPS with it. "
                "Leave it unset to terminate TLS at a Gateway or Ingress instead."
            ),
            "required": ["name"],
            "properties": {"name": _string("The Secret's name.", minLength=1)},
        },
    },
}

RESOURCES = {
    "type": "object",
    "description": "Requests and limits per stage container (the GPU comes from engine.gpus).",
    "default": {},
    "properties": {
        "api": _resources("The api container.", {"cpu": "500m", "memory": "1Gi"}),
        "tokenizer": _resources("The tokenizer container.", {"cpu": "1", "memory": "2Gi"}),
        "scheduler": _resources("The scheduler container.", {"cpu": "2", "memory": "8Gi"}),
        "detokenizer": _resources("The detokenizer container.", {"cpu": "500m", "memory": "1Gi"}),
    },
}

SERVICE = {
    "type": "object",
    "description": "The Service in front of the API stage.",
    "default": {},
    "properties": {
        "type": _string(
            "The Service type.", enum=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP"
        ),
        "port": _integer("The Service port.", default=8000, minimum=1, maximum=65535),
        "annotations": _string_map("Annotations for the Service (e.g. for a load balancer)."),
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
        "enabled": {"type": "boolean", "description": "Create an autoscaler.", "default": False},
        "minReplicas": _integer("Fewest replicas.", default=1, minimum=1),
        "maxReplicas": _integer("Most replicas.", default=4, minimum=1),
        "targetRequestsWaiting": _integer(
            "Waiting requests per replica the autoscaler aims for.", default=8, minimum=1
        ),
        "provider": _string(
            "`auto` picks KEDA when its CRDs exist, else a HorizontalPodAutoscaler.",
            enum=["auto", "keda", "hpa"],
            default="auto",
        ),
        "prometheusAddress": _string(
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
        "podMonitor": {
            "type": "boolean",
            "description": "Create a PodMonitor when the monitoring.coreos.com CRDs exist.",
            "default": True,
        },
        "interval": _string("Scrape interval.", default="15s", pattern=DURATION_PATTERN),
        "labels": _string_map("Extra labels on the PodMonitor, e.g. for Prometheus' selector."),
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
        "namespace": _string(
            "A namespace, by name.", pattern=DNS_LABEL_PATTERN, minLength=1, maxLength=63
        ),
        "namespaceLabels": _string_map("Namespaces with these labels ({} means every one)."),
        "podLabels": _string_map("Only pods with these labels."),
        "cidr": _string(
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
        "enabled": {
            "type": "boolean",
            "description": "Create the NetworkPolicy.",
            "default": True,
        },
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
                "affinity; route to it with an HTTPRoute whose backendRef is the InferencePool."
            ),
            "default": {},
            "properties": {
                "enabled": {
                    "type": "boolean",
                    "description": (
                        "Create the InferencePool and the picker. Unset: on when the cluster "
                        f"serves {names.INFERENCE_POOL_CRD}; false: the plain Service only."
                    ),
                },
                "image": _string(
                    "The endpoint picker image (its flags and configuration follow "
                    f"{names.PICKER_VERSION}).",
                    default=names.PICKER_IMAGE,
                    minLength=1,
                ),
                "extProcPort": _integer(
                    "The picker Service's ext-proc (gRPC) port, which the gateway calls.",
                    default=9002,
                    minimum=1,
                    maximum=65535,
                ),
                "failureMode": _string(
                    "What the gateway does while the picker does not answer: FailOpen picks a "
                    "pod itself, FailClose refuses the request.",
                    enum=["FailOpen", "FailClose"],
                    default="FailOpen",
                ),
                "resources": _resources(
                    "The picker container's resources.", {"cpu": "500m", "memory": "512Mi"}
                ),
            },
        },
    },
}

TOLERATION = {
    "type": "object",
    "properties": {
        "key": {"type": "string"},
        "operator": {"type": "string", "enum": ["Exists", "Equal"]},
        "value": {"type": "string"},
        "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer"},
    },
}

ROLLOUT = {
    "type": "object",
    "description": (
        "The Deployment's rolling update. The default never drops below the desired replicas; "
        "on a cluster without a spare GPU use maxSurge 0 and maxUnavailable 1."
    ),
    "default": {},
    "properties": {
        "maxSurge": {**_int_or_string("Extra pods during a rollout."), "default": 1},
        "maxUnavailable": {**_int_or_string("Pods that may be down in a rollout."), "default": 0},
    },
}

SPEC = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": MODEL,
        "image": _string("The tokenline image; defaults to the operator's own image.", minLength=1),
        "imagePullPolicy": _string(
            "When to pull the image.", enum=["Always", "IfNotPresent", "Never"]
        ),
        "imagePullSecrets": {
            "type": "array",
            "description": "Names of Secrets to pull the image with.",
            "items": {"type": "string"},
        },
        "replicas": _integer(
            "Pods serving the model (ignored while autoscaling is enabled).", default=1, minimum=1
        ),
        "engine": ENGINE,
        "server": SERVER,
        "resources": RESOURCES,
        "nodeSelector": _string_map("Node labels the pods must match, e.g. a GPU product."),
        "tolerations": {
            "type": "array",
            "description": "Tolerations for the pods, e.g. for tainted GPU nodes.",
            "items": TOLERATION,
        },
        "priorityClassName": _string("The pods' PriorityClass.", minLength=1),
        "serviceAccountName": _string(
            "The pods' ServiceAccount (for image pulls or workload identity).", minLength=1
        ),
        "rollout": ROLLOUT,
        "service": SERVICE,
        "autoscaling": AUTOSCALING,
        "monitoring": MONITORING,
        "networkPolicy": NETWORK_POLICY,
        "routing": ROUTING,
    },
}

CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string"},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"},
    },
}

STATUS = {
    "type": "object",
    "properties": {
        "phase": {"type": "string", "enum": ["Pending", "Progressing", "Ready", "Degraded"]},
        "observedGeneration": {"type": "integer"},
        "replicas": {"type": "integer"},
        "readyReplicas": {"type": "integer"},
        "selector": {"type": "string"},
        "url": {"type": "string"},
        "model": {"type": "string", "description": "The served model name."},
        "conditions": {
            "type": "array",
            "items": CONDITION,
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    },
}

PRINTER_COLUMNS = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    },
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1},
]


def spec_schema() -> Schema:
    """The spec's OpenAPI schema (a copy: callers may not change the CRD by accident)."""
    return copy.deepcopy(SPEC)


def custom_resource_definition() -> dict[str, Any]:
    """The CRD manifest."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": names.CRD_NAME,
            "labels": {names.LABEL_NAME: "tokenline"},
        },
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": names.KIND,
                "listKind": f"{names.KIND}List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": list(names.SHORT_NAMES),
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An OpenAI-compatible LLM endpoint served by tokenline.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": copy.deepcopy(STATUS),
                            },
                        }
                    },
                }
            ],
        },
    }
