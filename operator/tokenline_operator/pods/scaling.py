"""How many stage pods run: the autoscaler (a KEDA ScaledObject or an HPA on the waiting
requests) and the PodDisruptionBudget that keeps voluntary evictions to one pod at a time."""

from __future__ import annotations

from typing import Any

from .. import names
from ..crd.spec import Spec
from ..objects import Capabilities, Manifest, Owner, manifest, metadata, selector_labels
from .parallel import LWS_API_VERSION, multi_node


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


def waiting_query(owner: Owner) -> str:
    """PromQL for the requests waiting in this InferenceService's schedulers."""
    return (
        f'sum({names.WAITING_METRIC}{{namespace="{owner.namespace}",'
        f'inferenceservice="{owner.name}"}})'
    )


def scale_target(owner: Owner, spec: Spec) -> dict[str, str]:
    """What the autoscaler scales: the stage Deployment, or with spec.engine.nodes above 1
    the LeaderWorkerSet in its place (a whole group per replica, through its scale
    subresource, whose selector picks the leaders that report the waiting requests)."""
    if multi_node(spec):
        return {"apiVersion": LWS_API_VERSION, "kind": "LeaderWorkerSet", "name": owner.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.name}


def _autoscaler(owner: Owner, spec: Spec, api_version: str, kind: str, **fields: Any) -> Manifest:
    """An autoscaler of the stage pods; ``fields`` follow its ``scaleTargetRef``."""
    target = scale_target(owner, spec)
    meta = metadata(owner, owner.name)
    return manifest(api_version, kind, meta, spec={"scaleTargetRef": target, **fields})


def scaled_object(owner: Owner, spec: Spec) -> Manifest:
    """A KEDA ScaledObject on the waiting-requests gauge (vLLM production-stack's approach)."""
    auto = spec["autoscaling"]
    trigger = {
        "type": "prometheus",
        "metadata": {
            "serverAddress": auto["prometheusAddress"],
            "query": waiting_query(owner),
            "threshold": str(auto["targetRequestsWaiting"]),
        },
    }
    return _autoscaler(
        owner,
        spec,
        "keda.sh/v1alpha1",
        "ScaledObject",
        minReplicaCount=auto["minReplicas"],
        maxReplicaCount=auto["maxReplicas"],
        pollingInterval=15,
        cooldownPeriod=300,
        triggers=[trigger],
    )


def horizontal_pod_autoscaler(owner: Owner, spec: Spec) -> Manifest:
    """An HPA on the per-pod waiting gauge, served by the Prometheus adapter."""
    auto = spec["autoscaling"]
    target = {"type": "AverageValue", "averageValue": str(auto["targetRequestsWaiting"])}
    return _autoscaler(
        owner,
        spec,
        "autoscaling/v2",
        "HorizontalPodAutoscaler",
        minReplicas=auto["minReplicas"],
        maxReplicas=auto["maxReplicas"],
        metrics=[
            {"type": "Pods", "pods": {"metric": {"name": names.WAITING_METRIC}, "target": target}}
        ],
        behavior={"scaleDown": {"stabilizationWindowSeconds": 300}},
    )


def autoscaler_kind(spec: Spec, caps: Capabilities) -> str | None:
    """``ScaledObject``, ``HorizontalPodAutoscaler`` or None (autoscaling off)."""
    auto = spec["autoscaling"]
    if not auto["enabled"]:
        return None
    if auto["provider"] == "keda" or (auto["provider"] == "auto" and caps.keda):
        return "ScaledObject"
    return "HorizontalPodAutoscaler"
