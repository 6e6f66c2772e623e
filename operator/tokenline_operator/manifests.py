"""Pure builders: an InferenceService (metadata + parsed spec) in, Kubernetes objects out.

No I/O and no kopf here: the handlers, the tests, the chart's sample and the docs all call
these functions. Every object carries an owner reference to its InferenceService, so
Kubernetes' garbage collector removes the children with it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from . import names
from .spec import Spec, desired_replicas, selector_labels, served_model_name

Manifest = dict[str, Any]

#: Seconds the preStop hook waits, so Service endpoints drop the pod before it drains.
PRESTOP_SLEEP_SECONDS = 5
#: Seconds between startup-probe attempts; the threshold follows startupTimeoutSeconds.
STARTUP_PERIOD_SECONDS = 10
#: The endpoint picker's --refresh-metrics-interval and --metrics-staleness-threshold
#: (inference_pool.py passes both, so the preStop sizing below holds for the picker we run).
PICKER_REFRESH_METRICS_INTERVAL_S = 0.05
PICKER_METRICS_STALENESS_S = 2
#: Seconds for a pod's deletion to reach the picker's pod informer (one watch event, which
#: on a busy API server can lag); from then on the picker never chooses the pod.
PICKER_WATCH_DELAY_S = 3


@dataclass(frozen=True)
class Owner:
    """What the builders need to know about the InferenceService itself."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Any) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


@dataclass(frozen=True)
class Capabilities:
    """Optional APIs found in the cluster, which decide the optional children."""

    keda: bool = False
    prometheus_operator: bool = False
    inference_pool: bool = False  # the cluster serves inferencepools.inference.networking.k8s.io


# --- shared pieces -----------------------------------------------------------------------


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(owner: Owner) -> dict[str, str]:
    return {
        **selector_labels(owner.name),
        names.LABEL_INSTANCE: owner.name,
        names.LABEL_COMPONENT: "inference",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
    }


def metadata(owner: Owner, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner),
        "ownerReferences": [owner_reference(owner)],
        **extra,
    }


def routing_enabled(spec: Spec, caps: Capabilities) -> bool:
    """Whether an InferencePool and its picker route to the pods (unset: if the CRD is served)."""
    enabled = spec["routing"]["inferencePool"].get("enabled")
    return caps.inference_pool if enabled is None else bool(enabled)


def picker_name(owner: Owner) -> str:
    return f"{owner.name}-epp"


def picker_selector(owner: Owner) -> dict[str, str]:
    """The picker pods' identity: never the stage pods' (the pool and Service select those)."""
    return {names.LABEL_NAME: names.PICKER_APP, names.LABEL_OWNER: owner.name}


def prestop_sleep_seconds(routing: bool) -> int:
    """How long a stopping pod keeps serving before SIGTERM: until nothing routes to it.

    The Service's endpoints drop it within PRESTOP_SLEEP_SECONDS; with a picker, it stops
    choosing the pod once its informer sees the deletion, plus one metrics refresh, plus the
    staleness threshold after which a picker that missed the event distrusts the pod's metrics.
    """
    if not routing:
        return PRESTOP_SLEEP_SECONDS
    picker = PICKER_WATCH_DELAY_S + PICKER_REFRESH_METRICS_INTERVAL_S + PICKER_METRICS_STALENESS_S
    return max(PRESTOP_SLEEP_SECONDS, math.ceil(picker))


def config_map_name(owner: Owner) -> str:
    return f"{owner.name}-config"


def service_url(owner: Owner, spec: Spec) -> str:
    """The in-cluster base URL; OpenAI clients use it with ``/v1`` appended."""
    port = spec["service"]["port"]
    return f"http://{owner.name}.{owner.namespace}.svc.cluster.local:{port}"


# --- ConfigMap: the engine settings ------------------------------------------------------

#: Which stage reads which setting; each container gets exactly its own flags as TOKENLINE_*.
STAGE_SETTINGS: dict[str, tuple[str, ...]] = {
    "common": (
        "TOKENLINE_MODEL",
        "TOKENLINE_SERVED_MODEL_NAME",
        "TOKENLINE_REVISION",
        "TOKENLINE_LOG_LEVEL",
        "TOKENLINE_MAX_MODEL_LEN",
        "TOKENLINE_DRAIN_TIMEOUT",
    ),
    "api": (
        "TOKENLINE_REQUEST_TIMEOUT",
        "TOKENLINE_SLOW_CLIENT_TIMEOUT",
        "TOKENLINE_MAX_WAITING",
        "TOKENLINE_ALLOWED_ORIGIN",
    ),
    "tokenizer": (),
    "scheduler": (
        "TOKENLINE_DEVICE",
        "TOKENLINE_DTYPE",
        "TOKENLINE_KV_CACHE_MEMORY",
        "TOKENLINE_GPU_MEMORY_UTILIZATION",
        "TOKENLINE_MAX_NUM_SEQS",
        "TOKENLINE_MAX_NUM_BATCHED_TOKENS",
        "TOKENLINE_COMPILE",
        "TOKENLINE_NO_PREFIX_CACHING",
    ),
    "detokenizer": (),
}


def engine_settings(spec: Spec) -> dict[str, str]:
    """The ConfigMap's data: every stage flag the spec sets, as TOKENLINE_* strings."""
    model, engine, server = spec["model"], spec["engine"], spec["server"]
    device = engine["device"]
    if device == "auto" and engine["gpus"] == 0:
        device = "cpu"  # no GPU requested: do not let the runner find one by accident
    settings: dict[str, Any] = {
        "TOKENLINE_MODEL": model["name"],
        "TOKENLINE_SERVED_MODEL_NAME": served_model_name(spec),
        "TOKENLINE_REVISION": model.get("revision"),
        "TOKENLINE_LOG_LEVEL": server["logLevel"],
        "TOKENLINE_REQUEST_TIMEOUT": server["requestTimeoutSeconds"],
        "TOKENLINE_SLOW_CLIENT_TIMEOUT": server["slowClientTimeoutSeconds"],
        "TOKENLINE_DRAIN_TIMEOUT": server["drainTimeoutSeconds"],
        "TOKENLINE_MAX_WAITING": server["maxWaiting"],
        # The mirror is comma-separated (no origin the schema admits holds a comma); only
        # when set, so pods made before the field existed do not roll.
        "TOKENLINE_ALLOWED_ORIGIN": ",".join(server.get("allowedOrigins") or []) or None,
        "TOKENLINE_MAX_MODEL_LEN": engine.get("maxModelLen"),
        "TOKENLINE_DEVICE": device,
        "TOKENLINE_DTYPE": engine["dtype"],
        "TOKENLINE_KV_CACHE_MEMORY": engine.get("kvCacheMemory"),
        "TOKENLINE_GPU_MEMORY_UTILIZATION": engine["gpuMemoryUtilization"],
        "TOKENLINE_MAX_NUM_SEQS": engine["maxNumSeqs"],
        "TOKENLINE_MAX_NUM_BATCHED_TOKENS": engine.get("maxNumBatchedTokens"),
        # only when on: a new key would change the settings' hash and roll every pod
        "TOKENLINE_COMPILE": "true" if engine["compile"] else None,
        # only when off, for the same reason
        "TOKENLINE_NO_PREFIX_CACHING": None if engine["prefixCaching"] else "1",
    }
    return {key: str(value) for key, value in settings.items() if value is not None}


def config_map(owner: Owner, spec: Spec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, config_map_name(owner)),
        "data": engine_settings(spec),
    }


def config_hash(data: dict[str, str]) -> str:
    """A short digest of the settings: a change rolls the pods (env is read at start)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# --- Deployment: one pod, four stage containers ------------------------------------------


def ring_endpoints() -> dict[str, str]:
    """Each stage's inbox: an IPC socket in the pod's shared ring volume.

    No network reaches it, and only containers that mount the volume, as the stages' user,
    can connect; the default loopback ports would be open to every process in the pod's
    network namespace, injected sidecars included.
    """
    return {stage: f"ipc://{names.RING_DIR}/{stage}.sock" for stage in names.STAGES}


def tls_enabled(spec: Spec) -> bool:
    """Whether the api serves HTTPS itself (``spec.server.tlsSecret``)."""
    return bool(spec["server"].get("tlsSecret"))


def _stage_env(owner: Owner, spec: Spec, stage: str, settings: dict[str, str]) -> list[dict]:
    keys = [*STAGE_SETTINGS["common"], *STAGE_SETTINGS[stage]]
    env: list[dict[str, Any]] = [
        {
            "name": key,
            "valueFrom": {"configMapKeyRef": {"name": config_map_name(owner), "key": key}},
        }
        for key in keys
        if key in settings
    ]
    env += [
        {"name": "TOKENLINE_MODEL_CACHE_DIR", "value": names.MODEL_CACHE_DIR},
        {"name": "HF_HOME", "value": names.HF_HOME},
    ]
    env += [
        {"name": f"TOKENLINE_{peer.upper()}_ENDPOINT", "value": endpoint}
        for peer, endpoint in ring_endpoints().items()
    ]
    if stage == "scheduler":
        # Triton's default is under $HOME, read-only here; a volume of their own keeps
        # generated kernels out of /tmp and the model cache.
        env += [
            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": names.INDUCTOR_CACHE_DIR},
            {"name": "TRITON_CACHE_DIR", "value": names.TRITON_CACHE_DIR},
        ]
    if stage == "api" and spec["server"].get("apiKeySecret"):
        env.append({"name": "TOKENLINE_API_KEY_FILE", "value": names.API_KEY_FILE})
    if stage == "api" and tls_enabled(spec):
        env += [
            {"name": "TOKENLINE_SSL_CERTFILE", "value": names.TLS_CERT_FILE},
            {"name": "TOKENLINE_SSL_KEYFILE", "value": names.TLS_KEY_FILE},
        ]
    secret = spec["model"].get("hfTokenSecret")
    if secret:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}},
            }
        )
    return env


def _http_probe(
    path: str, port: str, *, period: int, failures: int, timeout: int = 5, https: bool = False
) -> dict:
    get: dict[str, Any] = {"path": path, "port": port}
    if https:
        get["scheme"] = "HTTPS"  # the kubelet does not verify the certificate
    return {
        "httpGet": get,
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _container(
    owner: Owner, spec: Spec, stage: str, settings: dict[str, str], prestop: int
) -> dict:
    port_name = names.PORT_NAMES[stage]
    startup_failures = -(-spec["server"]["startupTimeoutSeconds"] // STARTUP_PERIOD_SECONDS)
    if stage == "api":
        args = ["api", "--host", "0.0.0.0", "--port", str(names.API_PORT)]
        port = names.API_PORT
        https = tls_enabled(spec)
        # /ready answers 200 only once every stage answers and the model is loaded.
        startup = _http_probe(
            "/ready",
            port_name,
            period=STARTUP_PERIOD_SECONDS,
            failures=startup_failures,
            https=https,
        )
        readiness = _http_probe("/ready", port_name, period=5, failures=3, https=https)
        liveness = _http_probe("/health", port_name, period=10, failures=3, https=https)
    else:
        port = names.METRICS_PORTS[stage]
        args = [stage, "--metrics-port", str(port)]
        startup = _http_probe(
            "/metrics", port_name, period=STARTUP_PERIOD_SECONDS, failures=startup_failures
        )
        readiness = None
        liveness = _http_probe("/metrics", port_name, period=10, failures=3)

    resources = json.loads(json.dumps(spec["resources"][stage]))  # a deep copy of plain data
    gpus = spec["engine"]["gpus"]
    if stage == "scheduler" and gpus > 0:
        resources.setdefault("limits", {})["nvidia.com/gpu"] = gpus
        resources.setdefault("requests", {})["nvidia.com/gpu"] = gpus

    mounts = [
        {"name": "model-cache", "mountPath": names.MODEL_CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "ring", "mountPath": names.RING_DIR},
    ]
    if stage == "scheduler":
        mounts += [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "compile-cache", "mountPath": names.COMPILE_CACHE_DIR},
        ]
    # Whole directories, never subPath: only these receive a rotated Secret's new contents.
    if stage == "api" and spec["server"].get("apiKeySecret"):
        mounts.append({"name": "api-key", "mountPath": names.API_KEY_DIR, "readOnly": True})
    if stage == "api" and tls_enabled(spec):
        mounts.append({"name": "tls", "mountPath": names.TLS_DIR, "readOnly": True})

    container: dict[str, Any] = {
        "name": stage,
        "image": spec["image"],
        "args": args,
        "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}],
        "env": _stage_env(owner, spec, stage, settings),
        "resources": resources,
        "volumeMounts": mounts,
        "startupProbe": startup,
        "livenessProbe": liveness,
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(prestop)]}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if readiness:
        container["readinessProbe"] = readiness
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def _volumes(spec: Spec) -> list[dict[str, Any]]:
    cache = spec["model"].get("cache", {})
    if "claimName" in cache:
        model_cache: dict[str, Any] = {"persistentVolumeClaim": {"claimName": cache["claimName"]}}
    else:
        model_cache = {
            "emptyDir": {"sizeLimit": cache["sizeLimit"]} if "sizeLimit" in cache else {}
        }
    volumes: list[dict[str, Any]] = [
        {"name": "model-cache", **model_cache},
        {"name": "tmp", "emptyDir": {}},
        # Socket files take no space; memory keeps them off the node's disk.
        {"name": "ring", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        {"name": "compile-cache", "emptyDir": {}},
    ]
    server = spec["server"]
    if server.get("apiKeySecret"):
        secret = server["apiKeySecret"]
        volumes.append(
            _secret_volume("api-key", secret["name"], {secret["key"]: names.API_KEY_FILE})
        )
    if server.get("tlsSecret"):
        volumes.append(
            _secret_volume(
                "tls",
                server["tlsSecret"]["name"],
                {"tls.crt": names.TLS_CERT_FILE, "tls.key": names.TLS_KEY_FILE},
            )
        )
    return volumes


#: Owner and group may read: the files belong to root and to the pod's fsGroup, the stages'.
SECRET_FILE_MODE = 0o440


def _secret_volume(name: str, secret: str, files: dict[str, str]) -> dict[str, Any]:
    """A Secret's keys as files; ``files`` maps each key to its path in the container."""
    items = [{"key": key, "path": path.rsplit("/", 1)[1]} for key, path in files.items()]
    return {
        "name": name,
        "secret": {"secretName": secret, "items": items, "defaultMode": SECRET_FILE_MODE},
    }


def termination_grace_seconds(spec: Spec, routing: bool = False) -> int:
    """preStop sleep + the stages' drain + a margin to exit: longer than the drain timeout."""
    return prestop_sleep_seconds(routing) + spec["server"]["drainTimeoutSeconds"] + 15


def deployment(
    owner: Owner, spec: Spec, *, manage_replicas: bool = True, routing: bool = False
) -> Manifest:
    """The Deployment; ``manage_replicas=False`` leaves ``replicas`` to an autoscaler,
    ``routing`` sizes the preStop hook for an endpoint picker."""
    settings = engine_settings(spec)
    prestop = prestop_sleep_seconds(routing)
    pod_spec: dict[str, Any] = {
        "containers": [_container(owner, spec, stage, settings, prestop) for stage in names.STAGES],
        "volumes": _volumes(spec),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec, routing),
        # Service links would inject e.g. TOKENLINE_PORT=tcp://... for a Service called
        # "tokenline", which the stages would read as their --port flag.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": names.RUN_AS_USER,
            "runAsGroup": names.RUN_AS_USER,
            "fsGroup": names.RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if spec.get("imagePullSecrets"):
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec["imagePullSecrets"]]
    if spec.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(spec["nodeSelector"])
    if spec.get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in spec["tolerations"]]
    for field in ("priorityClassName", "serviceAccountName"):
        if spec.get(field):
            pod_spec[field] = spec[field]

    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(owner.name)},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec["rollout"]["maxSurge"],
                "maxUnavailable": spec["rollout"]["maxUnavailable"],
            },
        },
        # A rollout counts as stalled only after a pod had its whole startup allowance.
        "progressDeadlineSeconds": spec["server"]["startupTimeoutSeconds"] + 600,
        "template": {
            "metadata": {
                "labels": labels(owner),
                "annotations": {names.ANNOTATION_CONFIG_HASH: config_hash(settings)},
            },
            "spec": pod_spec,
        },
    }
    if manage_replicas:
        deployment_spec["replicas"] = desired_replicas(spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, owner.name),
        "spec": deployment_spec,
    }


# --- Service, PodDisruptionBudget ---------------------------------------------------------


def service(owner: Owner, spec: Spec) -> Manifest:
    svc = spec["service"]
    meta = metadata(owner, owner.name)
    if svc.get("annotations"):
        meta["annotations"] = dict(svc["annotations"])
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": svc["type"],
            "selector": selector_labels(owner.name),
            "ports": [
                {
                    "name": "http",
                    "port": svc["port"],
                    "targetPort": names.PORT_NAMES["api"],
                    "protocol": "TCP",
                    "appProtocol": "https" if tls_enabled(spec) else "http",
                }
            ],
        },
    }


def wants_disruption_budget(spec: Spec) -> bool:
    if spec["autoscaling"]["enabled"]:
        return spec["autoscaling"]["maxReplicas"] > 1
    return spec["replicas"] > 1


def pod_disruption_budget(owner: Owner, spec: Spec) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, owner.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
        },
    }


# --- autoscalers --------------------------------------------------------------------------


def waiting_query(owner: Owner) -> str:
    """PromQL for the requests waiting in this InferenceService's schedulers."""
    return (
        f'sum({names.WAITING_METRIC}{{namespace="{owner.namespace}",'
        f'inferenceservice="{owner.name}"}})'
    )


def scaled_object(owner: Owner, spec: Spec) -> Manifest:
    """A KEDA ScaledObject on the waiting-requests gauge (vLLM production-stack's approach)."""
    auto = spec["autoscaling"]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": metadata(owner, owner.name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name},
            "minReplicaCount": auto["minReplicas"],
            "maxReplicaCount": auto["maxReplicas"],
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": auto["prometheusAddress"],
                        "query": waiting_query(owner),
                        "threshold": str(auto["targetRequestsWaiting"]),
                    },
                }
            ],
        },
    }


def horizontal_pod_autoscaler(owner: Owner, spec: Spec) -> Manifest:
    """An HPA on the per-pod waiting gauge, served by the Prometheus adapter."""
    auto = spec["autoscaling"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(owner, owner.name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name},
            "minReplicas": auto["minReplicas"],
            "maxReplicas": auto["maxReplicas"],
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": names.WAITING_METRIC},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": str(auto["targetRequestsWaiting"]),
                        },
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


def autoscaler_kind(spec: Spec, caps: Capabilities) -> str | None:
    """``ScaledObject``, ``HorizontalPodAutoscaler`` or None (autoscaling off)."""
    auto = spec["autoscaling"]
    if not auto["enabled"]:
        return None
    if auto["provider"] == "keda" or (auto["provider"] == "auto" and caps.keda):
        return "ScaledObject"
    return "HorizontalPodAutoscaler"


# --- PodMonitor ---------------------------------------------------------------------------


def pod_monitor(owner: Owner, spec: Spec) -> Manifest:
    mon = spec["monitoring"]
    meta = metadata(owner, owner.name)
    meta["labels"] = {**meta["labels"], **mon.get("labels", {})}
    relabel = [
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_tokenline_dev_inferenceservice"],
            "targetLabel": "inferenceservice",
        }
    ]
    endpoints = []
    for stage in names.STAGES:
        endpoint: dict[str, Any] = {
            "port": names.PORT_NAMES[stage],
            "path": "/metrics",
            "interval": mon["interval"],
            "relabelings": relabel,
        }
        if stage == "api" and tls_enabled(spec):
            # Prometheus scrapes pod IPs, which no certificate names: encrypted, unverified.
            endpoint["scheme"] = "https"
            endpoint["tlsConfig"] = {"insecureSkipVerify": True}
        endpoints.append(endpoint)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "podMetricsEndpoints": endpoints,
        },
    }


# --- NetworkPolicy ------------------------------------------------------------------------


def _selector(labels: dict[str, str]) -> dict[str, Any]:
    # The API server drops an empty matchLabels: writing one would look like drift forever.
    return {"matchLabels": dict(labels)} if labels else {}


def network_peer(peer: dict[str, Any]) -> dict[str, Any]:
    """A spec peer as a NetworkPolicyPeer; without a namespace, the pods' own namespace."""
    if "cidr" in peer:
        return {"ipBlock": {"cidr": peer["cidr"]}}
    result: dict[str, Any] = {}
    if "namespace" in peer:
        result["namespaceSelector"] = _selector({names.LABEL_NAMESPACE_NAME: peer["namespace"]})
    elif "namespaceLabels" in peer:
        result["namespaceSelector"] = _selector(peer["namespaceLabels"])
    if "podLabels" in peer or not result:
        result["podSelector"] = _selector(peer.get("podLabels", {}))
    return result


def _ports(*numbers: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": number} for number in numbers]


def network_policy(owner: Owner, spec: Spec, routing: bool = False) -> Manifest:
    """Ingress to the api port from ``apiFrom``, to every metrics port from ``metricsFrom``,
    and with ``routing`` to the api port from the endpoint picker (it scrapes /metrics there).

    The ring never crosses the pod (IPC), so no rule is needed for it; the kubelet's probes
    come from the node, which NetworkPolicy implementations let through.
    """
    policy = spec["networkPolicy"]
    api_peers = [network_peer(p) for p in policy.get("apiFrom") or [{}]]
    ingress = [{"from": api_peers, "ports": _ports(names.API_PORT)}]
    if routing:
        picker = {"podSelector": _selector(picker_selector(owner))}
        ingress.append({"from": [picker], "ports": _ports(names.API_PORT)})
    metrics_peers = [network_peer(p) for p in policy["metricsFrom"]]
    # A rule without peers would admit everyone: an empty metricsFrom adds no rule.
    if metrics_peers:
        # The api's own /metrics is served on the api port.
        ports = _ports(names.API_PORT, *names.METRICS_PORTS.values())
        ingress.append({"from": metrics_peers, "ports": ports})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, owner.name),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner.name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


# --- the whole set ------------------------------------------------------------------------

#: Kinds that exist only in some configurations; the reconciler deletes them when unwanted.
OPTIONAL_KINDS = (
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ScaledObject",
    "PodMonitor",
    "NetworkPolicy",
)


def children(owner: Owner, spec: Spec, caps: Capabilities) -> dict[str, Manifest]:
    """Every child the spec asks for, by kind (one object per kind)."""
    autoscaler = autoscaler_kind(spec, caps)
    routing = routing_enabled(spec, caps)
    result: dict[str, Manifest] = {
        "ConfigMap": config_map(owner, spec),
        "Deployment": deployment(owner, spec, manage_replicas=autoscaler is None, routing=routing),
        "Service": service(owner, spec),
    }
    if wants_disruption_budget(spec):
        result["PodDisruptionBudget"] = pod_disruption_budget(owner, spec)
    if autoscaler == "ScaledObject":
        result["ScaledObject"] = scaled_object(owner, spec)
    elif autoscaler == "HorizontalPodAutoscaler":
        result["HorizontalPodAutoscaler"] = horizontal_pod_autoscaler(owner, spec)
    if spec["monitoring"]["podMonitor"] and caps.prometheus_operator:
        result["PodMonitor"] = pod_monitor(owner, spec)
    if spec["networkPolicy"]["enabled"]:
        result["NetworkPolicy"] = network_policy(owner, spec, routing)
    return result
