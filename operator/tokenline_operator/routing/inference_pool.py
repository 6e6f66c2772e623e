"""Pure builders for routing through the Gateway API Inference Extension.

An ``InferencePool`` (``inference.networking.k8s.io/v1``) selects the stage pods on the api
port; its endpoint picker (EPP) answers the gateway's ext-proc calls with the pod to use,
scored by queue depth, KV cache use and prefix affinity from what it scrapes on each pod's
api port (its EndpointPickerConfig: :mod:`picker_config`). The picker's flags and
EndpointPickerConfig follow the upstream release
``names.PICKER_VERSION``: from v1.4 it refuses the old metric-name flags and reads
``engineConfigs`` of its ``core-metrics-extractor`` plugin instead.

With ``spec.router.kvEvents`` (and sha256_cbor block names, its default) the picker is llm-d's
inference scheduler (``names.LLMD_PICKER_IMAGE``, the same flags, built on the extension) and
its prefix scorer llm-d's precise-prefix-cache-scorer, configured as llm-d's
precise-prefix-cache-aware guide documents for pod discovery: it subscribes to each pod's
``tcp://<pod IP>:5557``, keeps the ``kv@`` topics, and hashes prompts with the pods' block size
and hash seed (see :mod:`tokenline_operator.pods.router`).

Every object is owned by the InferenceService, like the other children.
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from .. import names
from ..crd import disaggregation
from ..crd.spec import Spec, tls_enabled
from ..objects import (
    Capabilities,
    Manifest,
    Owner,
    manifest,
    owner_reference,
    picker_name,
    picker_selector,
)
from ..pods import router
from ..pods.deployment import PICKER_METRICS_STALENESS_S, PICKER_REFRESH_METRICS_INTERVAL_S
from . import picker_config
from .network import api_pods, network_peer
from .picker_config import endpoint_picker_config

#: The picker's ports (its defaults in the pinned release, passed explicitly).
PICKER_HEALTH_PORT = 9003
PICKER_METRICS_PORT = 9090
PICKER_CONFIG_DIR = "/config"
PICKER_CONFIG_FILE = "config.yaml"
#: Kinds of the routing children, in the order they are applied (the picker's identity and
#: configuration before the picker, the picker before the pool that points at it).
KINDS = (
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Deployment",
    "Service",
    "NetworkPolicy",
    "InferencePool",
)


def routing_enabled(spec: Spec, caps: Capabilities) -> bool:
    """Whether an InferencePool and its picker route to the pods (unset: if the CRD is
    served and the api speaks plain HTTP, the only protocol the pool's gateway sends)."""
    enabled = spec["routing"]["inferencePool"].get("enabled")
    if enabled is None:
        return caps.inference_pool and not tls_enabled(spec)
    return bool(enabled)


def _picker_settings(spec: Spec) -> dict[str, Any]:
    return spec["routing"]["inferencePool"]


def labels(owner: Owner) -> dict[str, str]:
    return {
        **picker_selector(owner),
        names.LABEL_INSTANCE: owner.name,
        names.LABEL_COMPONENT: "endpoint-picker",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
    }


def _metadata(owner: Owner, name: str, component_labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": component_labels,
        "ownerReferences": [owner_reference(owner)],
    }


def _picker_object(owner: Owner, api_version: str, kind: str, **body: Any) -> Manifest:
    """One of the picker's objects, all named ``-epp`` and labelled as the picker."""
    return manifest(api_version, kind, _metadata(owner, picker_name(owner), labels(owner)), **body)


def child_name(owner: Owner, kind: str) -> str:
    """The pool is named like the InferenceService (HTTPRoutes name it); the rest ``-epp``."""
    return owner.name if kind == "InferencePool" else picker_name(owner)


# --- the picker's configuration -----------------------------------------------------------


def picker_image(spec: Spec) -> str:
    """llm-d's inference scheduler when it routes prefill and decode apart or on KV-cache
    events, else the upstream EPP (a pooling pool's too: its body-blind parser is upstream's)."""
    if picker_config.pooling(spec):
        return _picker_settings(spec)["image"]
    if disaggregation.enabled(spec):
        return spec["disaggregation"]["pickerImage"]
    if router.precise_routing(spec):
        return spec["router"]["kvEvents"]["pickerImage"]
    return _picker_settings(spec)["image"]


def picker_config_text(spec: Spec) -> str:
    return yaml.safe_dump(endpoint_picker_config(spec), sort_keys=False)


def picker_config_hash(spec: Spec) -> str:
    return hashlib.sha256(picker_config_text(spec).encode()).hexdigest()[:16]


def picker_config_map(owner: Owner, spec: Spec) -> Manifest:
    text = picker_config_text(spec)
    return _picker_object(owner, "v1", "ConfigMap", data={PICKER_CONFIG_FILE: text})


# --- the picker's identity and permissions ------------------------------------------------


def picker_service_account(owner: Owner) -> Manifest:
    return _picker_object(owner, "v1", "ServiceAccount")


#: What the picker reads (the upstream chart's Role): the pods it routes to, its pool, and
#: the optional objectives and rewrites of the pool's models.
PICKER_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": [names.INFERENCE_POOL_GROUP],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "watch"],
    },
    {
        "apiGroups": ["inference.networking.x-k8s.io"],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": ["get", "list", "watch"],
    },
]


def picker_role(owner: Owner) -> Manifest:
    return _picker_object(
        owner,
        "rbac.authorization.k8s.io/v1",
        "Role",
        rules=[{key: list(value) for key, value in rule.items()} for rule in PICKER_RULES],
    )


def picker_role_binding(owner: Owner) -> Manifest:
    return _picker_object(
        owner,
        "rbac.authorization.k8s.io/v1",
        "RoleBinding",
        roleRef={
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": picker_name(owner),
        },
        subjects=[
            {"kind": "ServiceAccount", "name": picker_name(owner), "namespace": owner.namespace}
        ],
    )


# --- the picker ---------------------------------------------------------------------------


def picker_args(owner: Owner, spec: Spec) -> list[str]:
    settings = _picker_settings(spec)
    return [
        "--pool-name",
        owner.name,
        "--pool-namespace",
        owner.namespace,
        "--pool-group",
        names.INFERENCE_POOL_GROUP,
        "--config-file",
        f"{PICKER_CONFIG_DIR}/{PICKER_CONFIG_FILE}",
        "--grpc-port",
        str(settings["extProcPort"]),
        "--grpc-health-port",
        str(PICKER_HEALTH_PORT),
        "--metrics-port",
        str(PICKER_METRICS_PORT),
        "--refresh-metrics-interval",
        f"{round(PICKER_REFRESH_METRICS_INTERVAL_S * 1000)}ms",
        "--metrics-staleness-threshold",
        f"{PICKER_METRICS_STALENESS_S}s",
        # Its /metrics is for Prometheus; the NetworkPolicy decides who reaches it, and
        # authenticating scrapes would need cluster-wide TokenReview permissions.
        "--metrics-endpoint-auth=false",
        "--tracing=false",
        "--zap-encoder",
        "json",
    ]


def _grpc_probe(period: int, **extra: Any) -> dict[str, Any]:
    return {
        "grpc": {"port": PICKER_HEALTH_PORT, "service": "inference-extension"},
        "periodSeconds": period,
        **extra,
    }


def picker_deployment(owner: Owner, spec: Spec) -> Manifest:
    settings = _picker_settings(spec)
    container: dict[str, Any] = {
        "name": "epp",
        "image": picker_image(spec),
        "args": picker_args(owner, spec),
        "ports": [
            {"name": "grpc", "containerPort": settings["extProcPort"], "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": PICKER_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": PICKER_METRICS_PORT, "protocol": "TCP"},
        ],
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "resources": {key: dict(value) for key, value in settings["resources"].items()},
        "readinessProbe": _grpc_probe(2),
        "livenessProbe": _grpc_probe(10, initialDelaySeconds=5),
        "volumeMounts": [
            {"name": "config", "mountPath": PICKER_CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    secret = spec["model"].get("hfTokenSecret")
    if secret and router.precise_routing(spec):
        # the precise scorer downloads the model's tokenizer: a gated model needs the token
        container["env"].append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}},
            }
        )
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return _picker_object(
        owner,
        "apps/v1",
        "Deployment",
        spec={
            # One picker: the prefix scorer's index lives in its memory, and several would
            # need the picker's leader election (the upstream chart's choice as well).
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": picker_selector(owner)},
            "template": {
                # the picker reads its configuration once, at start: a changed one (LoRA
                # affinity turned on, another prefix scorer) must restart it
                "metadata": {
                    "labels": labels(owner),
                    "annotations": {names.ANNOTATION_CONFIG_HASH: picker_config_hash(spec)},
                },
                "spec": {
                    "serviceAccountName": picker_name(owner),
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": picker_name(owner)}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": names.RUN_AS_USER,
                        "runAsGroup": names.RUN_AS_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                },
            },
        },
    )


def picker_service(owner: Owner, spec: Spec) -> Manifest:
    port = _picker_settings(spec)["extProcPort"]
    return _picker_object(
        owner,
        "v1",
        "Service",
        spec={
            "type": "ClusterIP",
            "selector": picker_selector(owner),
            "ports": [
                {
                    "name": "grpc-ext-proc",
                    "port": port,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                },
                {
                    "name": "http-metrics",
                    "port": PICKER_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    )


def picker_network_policy(owner: Owner, spec: Spec) -> Manifest:
    """ext-proc from the api's peers (the gateway calls both), metrics from ``metricsFrom``."""
    policy = spec["networkPolicy"]
    gateway = [network_peer(p) for p in policy.get("apiFrom") or [{}]]
    ext_proc = [{"protocol": "TCP", "port": _picker_settings(spec)["extProcPort"]}]
    ingress = [{"from": gateway, "ports": ext_proc}]
    scrapers = [network_peer(p) for p in policy["metricsFrom"]]
    if scrapers:  # a rule without peers would admit everyone
        ingress.append(
            {"from": scrapers, "ports": [{"protocol": "TCP", "port": PICKER_METRICS_PORT}]}
        )
    return _picker_object(
        owner,
        "networking.k8s.io/v1",
        "NetworkPolicy",
        spec={
            "podSelector": {"matchLabels": picker_selector(owner)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    )


# --- the pool -----------------------------------------------------------------------------


def inference_pool(owner: Owner, spec: Spec) -> Manifest:
    settings = _picker_settings(spec)
    return {
        "apiVersion": names.INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": _metadata(owner, owner.name, labels(owner)),
        "spec": {
            # the api pods; with spec.disaggregation both roles (unlike the Service's
            # selector), because the picker chooses the prefill and the decode pod itself
            "selector": {"matchLabels": api_pods(owner, spec)},
            "targetPorts": [{"number": names.API_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker_name(owner),
                "port": {"number": settings["extProcPort"]},
                "failureMode": settings["failureMode"],
            },
        },
    }


def children(owner: Owner, spec: Spec) -> list[Manifest]:
    """Every routing child, in ``KINDS`` order (the NetworkPolicy with spec.networkPolicy)."""
    built = {
        "ServiceAccount": picker_service_account(owner),
        "Role": picker_role(owner),
        "RoleBinding": picker_role_binding(owner),
        "ConfigMap": picker_config_map(owner, spec),
        "Deployment": picker_deployment(owner, spec),
        "Service": picker_service(owner, spec),
        "InferencePool": inference_pool(owner, spec),
    }
    if spec["networkPolicy"]["enabled"]:
        built["NetworkPolicy"] = picker_network_policy(owner, spec)
    return [built[kind] for kind in KINDS if kind in built]
