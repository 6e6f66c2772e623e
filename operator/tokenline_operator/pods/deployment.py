"""The stage pods: a Deployment of one pod with four stage containers, their probes,
environment and volumes.

Pure builders: an InferenceService (owner + parsed spec) in, Kubernetes objects out; no I/O
and no kopf. Each container reads its stage's settings from the ConfigMap (:mod:`config`).
"""

from __future__ import annotations

import json
import math
from typing import Any

from .. import names
from ..crd import extra_args
from ..crd.spec import Spec, desired_replicas, tls_enabled
from ..objects import Manifest, Owner, config_map_name, labels, metadata, selector_labels
from . import lora, model, parallel, router
from .config import STAGE_SETTINGS, config_hash, config_map_data, env_name

#: Seconds the preStop hook waits, so Service endpoints drop the pod before it drains.
PRESTOP_SLEEP_SECONDS = 5
#: Seconds between startup-probe attempts; the threshold follows startupTimeoutSeconds.
STARTUP_PERIOD_SECONDS = 10
#: The endpoint picker's --refresh-metrics-interval and --metrics-staleness-threshold
#: (routing/inference_pool.py passes both, so the preStop sizing below holds for the picker
#: we run).
PICKER_REFRESH_METRICS_INTERVAL_S = 0.05
PICKER_METRICS_STALENESS_S = 2
#: Seconds for a pod's deletion to reach the picker's pod informer (one watch event, which
#: on a busy API server can lag); from then on the picker never chooses the pod.
PICKER_WATCH_DELAY_S = 3


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


def ring_endpoints() -> dict[str, str]:
    """Each stage's inbox: an IPC socket in the pod's shared ring volume.

    No network reaches it, and only containers that mount the volume, as the stages' user,
    can connect; the default loopback ports would be open to every process in the pod's
    network namespace, injected sidecars included.
    """
    return {stage: f"ipc://{names.RING_DIR}/{stage}.sock" for stage in names.STAGES}


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
        {"name": env_name("model-cache-dir"), "value": names.MODEL_CACHE_DIR},
        {"name": "HF_HOME", "value": names.HF_HOME},
    ]
    env += [
        {"name": env_name(f"{peer}-endpoint"), "value": endpoint}
        for peer, endpoint in ring_endpoints().items()
    ]
    if stage == "scheduler":
        # Triton's default is under $HOME, read-only here; a volume of their own keeps
        # generated kernels out of /tmp and the model cache.
        env += [
            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": names.INDUCTOR_CACHE_DIR},
            {"name": "TRITON_CACHE_DIR", "value": names.TRITON_CACHE_DIR},
        ]
        env += _kv_events_env(spec)
    env += lora.stage_env(spec, stage)
    if stage == "api" and spec["server"].get("apiKeySecret"):
        env.append({"name": env_name("api-key-file"), "value": names.API_KEY_FILE})
    if stage == "api" and tls_enabled(spec):
        env += [
            {"name": env_name("ssl-certfile"), "value": names.TLS_CERT_FILE},
            {"name": env_name("ssl-keyfile"), "value": names.TLS_KEY_FILE},
        ]
    secret = spec["model"].get("hfTokenSecret")
    if secret and not model.uri_of(spec):  # with a uri, only the fetch container downloads
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}},
            }
        )
    return env


def _kv_events_env(spec: Spec) -> list[dict[str, Any]]:
    """The scheduler's KV-cache events (router.kvEvents): both endpoints bound on every
    address of the pod, the pod's IP for the default topic ``kv@<POD_IP>@<served model>`` that
    llm-d parses, and with sha256_cbor the seed of the block hashes, which the picker repeats."""
    env: list[dict[str, Any]] = []
    if router.kv_events_enabled(spec):
        env += [
            {"name": env_name("kv-events-endpoint"), "value": router.kv_events_endpoint()},
            {"name": env_name("kv-events-replay-endpoint"), "value": router.kv_replay_endpoint()},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ]
    seed = router.hash_seed(spec)
    if seed is not None:
        env.append({"name": "PYTHONHASHSEED", "value": seed})
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
    owner: Owner,
    spec: Spec,
    stage: str,
    settings: dict[str, str],
    prestop: int,
    delivery: model.Delivery | None = None,
    image_volumes: bool = False,
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

    # the flags spec.engine.extraArgs carries for this stage (checked when the spec was read)
    args += extra_args.stage_args(spec["engine"].get("extraArgs") or [], stage)

    resources = json.loads(json.dumps(spec["resources"][stage]))  # a deep copy of plain data
    gpus = parallel.gpus_per_pod(spec)
    if stage == "scheduler" and gpus > 0:
        resources.setdefault("limits", {})["nvidia.com/gpu"] = gpus
        resources.setdefault("requests", {})["nvidia.com/gpu"] = gpus

    mounts = [
        {"name": "model-cache", "mountPath": names.MODEL_CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "ring", "mountPath": names.RING_DIR},
    ]
    if delivery is not None:
        mounts += [dict(m) for m in delivery.stage_mounts]  # the model, read-only
    if stage == "scheduler":
        mounts += [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "compile-cache", "mountPath": names.COMPILE_CACHE_DIR},
        ]
        mounts += lora.scheduler_mounts(spec, image_volumes)
    # Whole directories, never subPath: only these receive a rotated Secret's new contents.
    if stage == "api" and spec["server"].get("apiKeySecret"):
        mounts.append({"name": "api-key", "mountPath": names.API_KEY_DIR, "readOnly": True})
    if stage == "api" and tls_enabled(spec):
        mounts.append({"name": "tls", "mountPath": names.TLS_DIR, "readOnly": True})

    ports = [{"name": port_name, "containerPort": port, "protocol": "TCP"}]
    if stage == "scheduler" and router.kv_events_enabled(spec):
        ports += [
            {"name": name, "containerPort": number, "protocol": "TCP"}
            for number, name in names.KV_EVENTS_PORT_NAMES.items()
        ]

    container: dict[str, Any] = {
        "name": stage,
        "image": spec["image"],
        "args": args,
        "ports": ports,
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


def _volumes(
    owner: Owner, spec: Spec, delivery: model.Delivery | None = None, image_volumes: bool = False
) -> list[dict[str, Any]]:
    cache = spec["model"].get("cache", {})
    if delivery is not None:
        # the cache holds the fetched model (the "models" volume); this is scratch only
        model_cache: dict[str, Any] = {"emptyDir": {}}
    elif "claimName" in cache:
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
        # NCCL's buffers between the ranks of a pod live in /dev/shm
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": parallel.shm_size(spec)}},
        {"name": "compile-cache", "emptyDir": {}},
    ]
    if delivery is not None:
        volumes += delivery.volumes
    volumes += lora.volumes(owner, spec, image_volumes)
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


def pod_labels(owner: Owner, spec: Spec) -> dict[str, str]:
    """The pods' labels; with router.kvEvents, one a subscriber selects publishers by."""
    result = labels(owner)
    if router.kv_events_enabled(spec):
        result[names.LABEL_KV_EVENTS] = "true"
    return result


def termination_grace_seconds(spec: Spec, routing: bool = False) -> int:
    """preStop sleep + the stages' drain + a margin to exit: longer than the drain timeout."""
    return prestop_sleep_seconds(routing) + spec["server"]["drainTimeoutSeconds"] + 15


def deployment(
    owner: Owner,
    spec: Spec,
    *,
    manage_replicas: bool = True,
    routing: bool = False,
    image_volumes: bool = False,
) -> Manifest:
    """The Deployment; ``manage_replicas=False`` leaves ``replicas`` to an autoscaler,
    ``routing`` sizes the preStop hook for an endpoint picker, ``image_volumes`` mounts an
    oci:// model as an image volume (else an init container copies it out)."""
    settings = config_map_data(spec)
    prestop = prestop_sleep_seconds(routing)
    delivery = model.delivery(spec, image_volumes)
    pod_spec: dict[str, Any] = {
        "containers": [
            _container(owner, spec, stage, settings, prestop, delivery, image_volumes)
            for stage in names.STAGES
        ],
        "volumes": _volumes(owner, spec, delivery, image_volumes),
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
    if delivery is not None:
        # one download (or check) per pod, before any stage starts
        pod_spec["initContainers"] = delivery.init_containers
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
                "labels": pod_labels(owner, spec),
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
