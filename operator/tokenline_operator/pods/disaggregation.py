"""``spec.disaggregation``: prefill and decode pods, each a Deployment of its own, in llm-d's
contract.

Both Deployments are the stage pods of :mod:`deployment`, changed where the role asks:

- the pods carry ``llm-d.ai/role: prefill|decode`` (the picker's prefill-filter and
  decode-filter read it; the Deployments' selectors add it, so each owns only its pods);
- the scheduler takes ``--kv-transfer-config`` with vLLM's keys (``kv_producer`` on prefill
  pods, ``kv_consumer`` on decode pods) and opens the NIXL side channel on the pod IP
  (``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT``, vLLM's variables), authenticated with the
  service's own keys (:mod:`side_channel_keys`);
- each role has its own replicas, tensor parallelism and scheduler resources; a setting that
  differs from the shared ConfigMap's is set in the container itself;
- on decode pods llm-d's routing sidecar takes the serving port and the api moves behind it.

The Service sends plain traffic to the decode pods only (they serve a request whole when no
prefill pod is named); the InferencePool selects both roles.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .. import names
from ..crd.disaggregation import enabled
from ..crd.spec import Spec
from ..objects import Manifest, Owner
from . import side_channel_keys
from .config import config_map_data
from .deployment import deployment, prestop_sleep_seconds

__all__ = ["DEPLOYMENT_KEYS", "as_deployment", "deployments", "enabled", "role_deployment"]

#: The keys of the two Deployments among the children (controller/manifests.py).
DEPLOYMENT_KEYS = {"prefill": "PrefillDeployment", "decode": "DecodeDeployment"}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
CONNECTOR = "NixlConnector"
#: The sidecar's name for NixlConnector's protocol (llm-d's nixlv2: the decode pod pulls).
SIDECAR_CONNECTOR = "nixlv2"
SIDECAR_CONTAINER = "routing-sidecar"
#: The api container's port name behind the sidecar ("http" is the sidecar's, so the Service,
#: the InferencePool and the NetworkPolicy keep pointing at the pod's serving port).
API_PORT_NAME = "api"


def deployment_name(owner: Owner, role: str) -> str:
    return f"{owner.name}-{role}"


def role_labels(role: str) -> dict[str, str]:
    return {names.LABEL_LLMD_ROLE: role}


def role_spec(spec: Spec, role: str) -> Spec:
    """The spec one role's pods are built from: its tensor parallelism and resources."""
    settings = spec["disaggregation"][role]
    result = copy.deepcopy(spec)
    size = settings.get("tensorParallelSize")
    if size is not None:
        engine = result["engine"]
        engine["tensorParallelSize"] = size
        # gpus above 1 stand for the ranks of one pod (one node with disaggregation): follow
        # the role's size down as well as up, or a smaller prefill asks for idle GPUs
        if engine["gpus"] > 1:
            engine["gpus"] = size
    if settings.get("resources"):
        result["resources"]["scheduler"] = copy.deepcopy(settings["resources"])
    result["replicas"] = settings["replicas"]
    return result


def kv_transfer_config(spec: Spec, role: str) -> str:
    """The scheduler's --kv-transfer-config: vLLM's JSON for the role's side of the transfer."""
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR,
        "kv_role": KV_ROLES[role],
        "kv_connector_extra_config": {"side_channel_keys": side_channel_keys.KEYS_DIR},
    }
    if role == "decode":
        config["kv_load_failure_policy"] = spec["disaggregation"]["kvLoadFailurePolicy"]
    return json.dumps(config, separators=(",", ":"))


def _container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def _set_role_settings(pod_spec: dict[str, Any], shared: dict[str, str], own: dict[str, str]):
    """Settings whose value differs from the shared ConfigMap's, written into the containers
    (the role's tensor parallelism): the ConfigMap holds one value per key for both roles."""
    differing = {key: value for key, value in own.items() if shared.get(key) != value}
    for container in pod_spec["containers"]:
        for entry in container["env"]:
            if entry["name"] in differing:
                entry.pop("valueFrom", None)
                entry["value"] = differing[entry["name"]]


def _kv_side_channel(scheduler: dict[str, Any], spec: Spec, role: str) -> None:
    scheduler["args"] = [*scheduler["args"], "--kv-transfer-config", kv_transfer_config(spec, role)]
    scheduler["env"] = [
        *scheduler["env"],
        # the decode side reads blocks from the address the prefill pod advertises: its own IP
        {
            "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(names.KV_SIDE_CHANNEL_PORT)},
    ]
    scheduler["ports"] = [
        *scheduler["ports"],
        {
            "name": names.KV_SIDE_CHANNEL_PORT_NAME,
            "containerPort": names.KV_SIDE_CHANNEL_PORT,
            "protocol": "TCP",
        },
    ]


def sidecar_args(spec: Spec) -> list[str]:
    """llm-d's routing sidecar flags: it serves the pod's port, proxies to the api behind it,
    speaks plain HTTP (TLS ends at the Gateway) and NIXL's P/D protocol."""
    sidecar = spec["disaggregation"]["sidecar"]
    return [
        f"--port={names.API_PORT}",
        f"--vllm-port={names.SIDECAR_TARGET_PORT}",
        f"--kv-connector={SIDECAR_CONNECTOR}",
        "--secure-proxy=false",
        *sidecar.get("args", []),
    ]


def sidecar_container(spec: Spec, routing: bool) -> dict[str, Any]:
    sidecar = spec["disaggregation"]["sidecar"]
    # Outlive the api's drain: streams the api still finishes pass through the sidecar.
    stay = prestop_sleep_seconds(routing) + spec["server"]["drainTimeoutSeconds"]
    container: dict[str, Any] = {
        "name": SIDECAR_CONTAINER,
        "image": sidecar["image"],
        "args": sidecar_args(spec),
        "ports": [
            {"name": names.PORT_NAMES["api"], "containerPort": names.API_PORT, "protocol": "TCP"}
        ],
        "resources": copy.deepcopy(sidecar["resources"]),
        # the sidecar answers /health itself (every other path goes to the api)
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": names.PORT_NAMES["api"]},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(stay)]}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def _behind_sidecar(pod_spec: dict[str, Any], spec: Spec, routing: bool) -> None:
    """The decode pod: the api on the sidecar's target port, the sidecar on the pod's port."""
    api = _container(pod_spec, "api")
    args = api["args"]
    args[args.index("--port") + 1] = str(names.SIDECAR_TARGET_PORT)
    api["ports"] = [
        {"name": API_PORT_NAME, "containerPort": names.SIDECAR_TARGET_PORT, "protocol": "TCP"}
    ]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in api:
            api[probe]["httpGet"]["port"] = API_PORT_NAME
    pod_spec["containers"] = [sidecar_container(spec, routing), *pod_spec["containers"]]


def role_deployment(
    owner: Owner, spec: Spec, role: str, *, routing: bool = False, image_volumes: bool = False
) -> Manifest:
    """One role's Deployment, ``<name>-prefill`` or ``<name>-decode``."""
    own = role_spec(spec, role)
    result = deployment(owner, own, routing=routing, image_volumes=image_volumes)
    result["metadata"]["name"] = deployment_name(owner, role)
    body = result["spec"]
    body["replicas"] = spec["disaggregation"][role]["replicas"]
    body["selector"]["matchLabels"] |= role_labels(role)
    template = body["template"]
    template["metadata"]["labels"] |= role_labels(role)
    pod_spec = template["spec"]
    _set_role_settings(pod_spec, config_map_data(spec), config_map_data(own))
    scheduler = _container(pod_spec, "scheduler")
    _kv_side_channel(scheduler, spec, role)
    side_channel_keys.mount(owner, pod_spec, scheduler)
    if role == "decode":
        _behind_sidecar(pod_spec, spec, routing)
    return result


def deployments(
    owner: Owner, spec: Spec, *, routing: bool = False, image_volumes: bool = False
) -> dict[str, Manifest]:
    """Both roles' Deployments, by their keys among the children."""
    return {
        DEPLOYMENT_KEYS[role]: role_deployment(
            owner, spec, role, routing=routing, image_volumes=image_volumes
        )
        for role in names.LLMD_ROLES
    }


# --- the status ---------------------------------------------------------------------------


def _synced(dep: dict[str, Any]) -> bool:
    generation = dep.get("metadata", {}).get("generation")
    observed = dep.get("status", {}).get("observedGeneration")
    return generation is None or (observed is not None and observed >= generation)


def _condition(deps: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The roles' condition of one type, the worst first (a stalled or failing role)."""
    found = [
        c for d in deps for c in d.get("status", {}).get("conditions") or [] if c["type"] == kind
    ]
    if kind == "Progressing":
        found.sort(
            key=lambda c: (c.get("status") != "False", c.get("reason") == "NewReplicaSetAvailable")
        )
    else:
        found.sort(key=lambda c: c.get("status") != "True")
    return found[0] if found else None


def as_deployment(prefill: dict[str, Any] | None, decode: dict[str, Any] | None) -> dict | None:
    """Both roles read as the one Deployment the status code knows.

    Replicas add up; nothing counts as ready while no decode pod is, since decode pods
    are what serves (a prefill pod only ever answers a decode pod's sidecar).
    """
    deps = [d for d in (prefill, decode) if d is not None]
    if not deps:
        return None
    status: dict[str, Any] = {
        key: sum(d.get("status", {}).get(key, 0) for d in deps)
        for key in ("replicas", "updatedReplicas", "availableReplicas")
    }
    decode_ready = (decode or {}).get("status", {}).get("readyReplicas", 0)
    status["readyReplicas"] = (
        sum(d.get("status", {}).get("readyReplicas", 0) for d in deps) if decode_ready else 0
    )
    # both roles' generations as one: synced only once each has seen its own spec
    status["observedGeneration"] = 1 if len(deps) == 2 and all(map(_synced, deps)) else 0
    conditions = [_condition(deps, kind) for kind in ("Progressing", "ReplicaFailure")]
    status["conditions"] = [c for c in conditions if c is not None]
    replicas = sum(d.get("spec", {}).get("replicas", 0) for d in deps)
    return {"metadata": {"generation": 1}, "spec": {"replicas": replicas}, "status": status}
