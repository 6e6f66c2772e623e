"""The InferenceService CustomResourceDefinition, built once in Python.

The chart ships the generated copy (``charts/tokenline/crds/``); a test keeps the two equal,
and ``python -m tokenline_operator.chartgen`` rewrites it. The same schema drives the
operator's own defaulting and validation (:mod:`.spec`), so an object that
reached the operator without the API server's defaulting (an older CRD, a test emulator) is
read exactly as the API server would have stored it.
"""

from __future__ import annotations

import copy
from typing import Any

from .. import names
from . import disaggregation
from .children import (
    AUTOSCALING,
    MONITORING,
    NETWORK_POLICY,
    ROUTER,
    ROUTING,
    SERVICE,
    TLS_ROUTING_RULE,
)
from .lora import LORA, SERVED_NAME_RULE
from .model_uri import uri_schema
from .schema import (
    Schema,
    alternative_rules,
    int_or_string,
    integer,
    quantity,
    required_settings,
    resources,
    secret_reference,
    setting_fields,
    string,
    string_map,
)

MODEL = {
    "type": "object",
    "description": (
        "The model to serve: `name` (tiny, a directory inside the pod or a Hugging Face id the "
        "stages download themselves) or `uri` (fetched once per pod by an init container and "
        "read by every stage from /models, read-only). Exactly one of the two."
    ),
    "required": required_settings("model"),
    "properties": {
        **setting_fields("model"),
        "uri": uri_schema(),
        "hfTokenSecret": secret_reference(
            "A Secret holding a Hugging Face token, for gated models (hf:// and `name`); it "
            "reaches the containers through secretKeyRef, never as a plain value.",
            key_default="HF_TOKEN",
        ),
        "s3Secret": secret_reference(
            "For s3://: a Secret with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(and AWS_SESSION_TOKEN for temporary credentials), given to the fetch init "
            "container through secretKeyRef. Unset: the pod's own identity (IRSA, workload "
            "identity) or ?anonymous=true for public buckets."
        ),
        "cache": {
            "type": "object",
            "description": (
                "Where downloaded weights live: an emptyDir per pod by default, or a "
                "PersistentVolumeClaim (ReadWriteMany) or a node's hostPath shared by the "
                "replicas. With `uri`, each model has its own folder there (named after the "
                "URI), and one already complete is not downloaded again; replicas that start "
                "together download it once (a lock, the others wait)."
            ),
            "properties": {
                "sizeLimit": quantity("The emptyDir's size limit, e.g. 50Gi."),
                "claimName": string("An existing PersistentVolumeClaim to mount.", minLength=1),
                "hostPath": string(
                    "A directory on the node (spec.model.uri only), writable by uid "
                    f"{names.RUN_AS_USER}; not admitted where pods must be 'restricted'.",
                    pattern="^/.*",
                ),
            },
            "x-kubernetes-validations": [
                {
                    "rule": "[has(self.sizeLimit), has(self.claimName), has(self.hostPath)]"
                    ".filter(x, x).size() <= 1",
                    "message": "set one of sizeLimit (emptyDir), claimName (PVC) or hostPath",
                }
            ],
        },
        "lora": LORA,
    },
    "x-kubernetes-validations": [
        *alternative_rules("model"),
        {
            "rule": "!has(self.uri) || !has(self.revision)",
            "message": "with uri, pin the revision in it: hf://ORG/NAME@REVISION",
        },
        {
            "rule": "!has(self.cache) || !has(self.cache.hostPath) || has(self.uri)",
            "message": "cache.hostPath needs uri (name downloads into each pod's own cache)",
        },
        SERVED_NAME_RULE,
    ],
}

ENGINE = {
    "type": "object",
    "description": "Settings of the scheduler/runner stage.",
    "default": {},
    "properties": {
        "gpus": integer(
            "GPUs (nvidia.com/gpu) the scheduler container requests; 0 runs on CPU.",
            default=1,
            minimum=0,
            maximum=8,
        ),
        **setting_fields("engine"),
        "extraArgs": {
            "type": "array",
            "description": "Flags of `vllm serve` (or tokenline's own) for the stages' command "
            'lines, one token per item: ["--lora-modules", "a=/p/a"]. Read by the stages\' '
            "parser before any pod is made; a flag it refuses, or one a field of this spec sets, "
            "is a Degraded condition. Each stage gets the flags it takes.",
            "maxItems": 256,
            "items": {"type": "string", "maxLength": 65536},
        },
    },
    # Tensor parallelism (pods/parallel.py): ranks spread evenly over the nodes, and a node holds
    # at most as many as the gpus field allows (8).
    "x-kubernetes-validations": [
        {
            "rule": "self.tensorParallelSize % self.nodes == 0",
            "message": "tensorParallelSize must be a multiple of nodes (each node holds "
            "tensorParallelSize / nodes ranks)",
        },
        {
            "rule": "self.tensorParallelSize <= 8 * self.nodes",
            "message": "at most 8 GPUs per node: tensorParallelSize / nodes must not exceed 8; "
            "add nodes",
        },
        {
            "rule": "self.tensorParallelSize == 1 || self.gpus <= 1 || "
            "self.gpus == self.tensorParallelSize / self.nodes",
            "message": "gpus, when set above 1, must equal tensorParallelSize / nodes (the GPUs "
            "of one pod)",
        },
    ],
}

SERVER = {
    "type": "object",
    "description": "Lifecycle settings of the API stage and of the pod.",
    "default": {},
    "properties": {
        **setting_fields("server"),
        "startupTimeoutSeconds": integer(
            "How long a new pod may take to download and load the model before it is restarted.",
            default=1800,
            minimum=30,
        ),
        "apiKeySecret": secret_reference(
            "A Secret whose key holds the API keys, one per line (a line `NAME KEY` names its "
            "key: the name is the request's tenant): every route but /health, "
            "/ready and /metrics then needs `Authorization: Bearer <key>`. A changed Secret "
            "takes effect without a restart.",
            key_default="api-keys",
        ),
        "tlsSecret": secret_reference(
            "A kubernetes.io/tls Secret (tls.crt, tls.key): the api serves HTTPS with it. "
            "Leave it unset to terminate TLS at a Gateway or Ingress instead."
        ),
    },
}

SCHEDULING = {
    "type": "object",
    "description": "Who runs first when the pool is busy: requests' priority (with policy "
    "priority; lower runs earlier, vLLM's meaning, the opposite of the Gateway API's "
    "InferenceObjective priority) and fair share between tenants (the API key's name, else the "
    "fairness header the gateway sets).",
    "default": {},
    "properties": {**setting_fields("scheduling")},
}

RESOURCES = {
    "type": "object",
    "description": "Requests and limits per stage container (the GPU comes from engine.gpus).",
    "default": {},
    "properties": {
        "api": resources("The api container.", {"cpu": "500m", "memory": "1Gi"}),
        "tokenizer": resources("The tokenizer container.", {"cpu": "1", "memory": "2Gi"}),
        "scheduler": resources("The scheduler container.", {"cpu": "2", "memory": "8Gi"}),
        "detokenizer": resources("The detokenizer container.", {"cpu": "500m", "memory": "1Gi"}),
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
        "maxSurge": int_or_string("Extra pods during a rollout.", default=1),
        "maxUnavailable": int_or_string("Pods that may be down in a rollout.", default=0),
    },
}

SPEC = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": MODEL,
        "image": string("The tokenline image; defaults to the operator's own image.", minLength=1),
        "imagePullPolicy": string(
            "When to pull the image.", enum=["Always", "IfNotPresent", "Never"]
        ),
        "imagePullSecrets": {
            "type": "array",
            "description": "Names of Secrets to pull the image with.",
            "items": {"type": "string"},
        },
        "replicas": integer(
            "Pods serving the model (ignored while autoscaling is enabled).", default=1, minimum=1
        ),
        "engine": ENGINE,
        "server": SERVER,
        "scheduling": SCHEDULING,
        "resources": RESOURCES,
        "nodeSelector": string_map("Node labels the pods must match, e.g. a GPU product."),
        "tolerations": {
            "type": "array",
            "description": "Tolerations for the pods, e.g. for tainted GPU nodes.",
            "items": TOLERATION,
        },
        "priorityClassName": string("The pods' PriorityClass.", minLength=1),
        "serviceAccountName": string(
            "The pods' ServiceAccount (for image pulls or workload identity).", minLength=1
        ),
        "rollout": ROLLOUT,
        "service": SERVICE,
        "autoscaling": AUTOSCALING,
        "monitoring": MONITORING,
        "networkPolicy": NETWORK_POLICY,
        "routing": ROUTING,
        "router": ROUTER,
        "disaggregation": disaggregation.schema(),
    },
    "x-kubernetes-validations": copy.deepcopy([*disaggregation.RULES, TLS_ROUTING_RULE]),
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

MODEL_STATUS = {
    "type": "object",
    "description": (
        "The model: the name it is served under and, with spec.model.uri, where its delivery "
        "stands (read from the pods' fetch init containers)."
    ),
    "properties": {
        "servedName": {"type": "string", "description": "The name /v1/models lists."},
        "uri": {"type": "string", "description": "spec.model.uri, without secrets."},
        "state": {
            "type": "string",
            "enum": ["Pending", "Downloading", "Verifying", "Ready", "Failed"],
        },
        "revision": {"type": "string", "description": "The Hub commit the files come from."},
        "digest": {"type": "string", "description": "sha256 over the files or the archive."},
        "size": {"type": "integer", "format": "int64", "description": "Bytes of the model."},
        "reason": {"type": "string", "description": "Why it is not Ready (CamelCase)."},
        "message": {"type": "string"},
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
        "model": MODEL_STATUS,
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
    {"name": "Model", "type": "string", "jsonPath": ".status.model.servedName"},
    {"name": "Model State", "type": "string", "jsonPath": ".status.model.state"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1},
    {"name": "URI", "type": "string", "jsonPath": ".status.model.uri", "priority": 1},
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
