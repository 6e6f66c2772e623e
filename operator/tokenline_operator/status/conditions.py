"""Pure status: what the children say, as the InferenceService's phase and conditions.

Conditions follow the Kubernetes convention: one entry per type, ``lastTransitionTime``
changes only when ``status`` does, reasons are CamelCase words a human can grep for.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from ..names import INFERENCE_POOL_CRD
from .model import condition as model_condition

Condition = dict[str, Any]


@dataclass(frozen=True)
class Routing:
    """How requests reach the pods: an InferencePool and its picker, or the plain Service."""

    wanted: bool  # spec.routing.inferencePool.enabled, or its default from the cluster
    served: bool  # the cluster serves inferencepools.inference.networking.k8s.io
    pool: str | None = None  # the InferencePool's name, once applied
    picker: dict[str, Any] | None = None  # the live picker Deployment


def routing_condition(routing: Routing, service: str) -> tuple[bool, str, str]:
    """The Routing condition: True once the InferencePool's picker has a ready replica."""
    plain = f"requests reach the pods through the plain Service {service} (round-robin)."
    if not routing.wanted:
        why = (
            "spec.routing.inferencePool.enabled is false"
            if routing.served
            else f"The cluster does not serve {INFERENCE_POOL_CRD}"
        )
        return False, "PlainService", f"{why}: {plain}"
    if not routing.served:
        return (
            False,
            "InferencePoolUnavailable",
            f"spec.routing.inferencePool.enabled is true but the cluster does not serve "
            f"{INFERENCE_POOL_CRD}: {plain}",
        )
    ready = ((routing.picker or {}).get("status") or {}).get("readyReplicas", 0)
    picker = f"{routing.pool}-epp"
    if routing.pool and ready:
        return (
            True,
            "InferencePool",
            f"A Gateway's HTTPRoute to InferencePool {routing.pool} routes each request to the "
            f"pod its endpoint picker {picker} scores best (queue, KV cache, prefix).",
        )
    return False, "PickerNotReady", f"The endpoint picker {picker} has no ready replica yet."


@dataclass(frozen=True)
class Observation:
    """Everything the status is computed from."""

    generation: int | None
    desired_replicas: int | None
    deployment: dict[str, Any] | None
    routing: Routing | None = None
    service: str | None = None  # the plain Service's name
    url: str | None = None
    selector: str | None = None
    #: status.model: the served name, and with spec.model.uri its delivery (status/model.py)
    model: dict[str, Any] | None = None
    #: Why the spec cannot be served (Degraded, reason InvalidSpec), if it cannot.
    spec_error: str | None = None
    #: Why the last reconcile failed (Degraded, reason ReconcileFailed), if it did.
    reconcile_error: str | None = None


def _deployment_condition(deployment: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in deployment.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return {}


def _routing_problem(obs: Observation) -> str | None:
    """Why the routing the spec asks for is not served, if it is not."""
    if obs.routing is None or not obs.routing.wanted or obs.routing.served:
        return None
    return (
        f"spec.routing.inferencePool.enabled is true but the cluster does not serve "
        f"{INFERENCE_POOL_CRD}: install the Gateway API Inference Extension's CRDs (the "
        "operator notices within its discovery interval) or set "
        "spec.routing.inferencePool.enabled to false. Meanwhile requests reach the pods "
        f"through the plain Service {obs.service}."
    )


def _assess(
    obs: Observation,
) -> tuple[tuple[bool, str, str], tuple[bool, str, str], tuple[bool, str, str]]:
    """(Ready, Progressing, Degraded), each as (status, reason, message)."""
    if obs.spec_error:
        return (
            (False, "InvalidSpec", "The spec cannot be served; see the Degraded condition."),
            (False, "InvalidSpec", "Nothing rolls out until the spec is fixed."),
            (True, "InvalidSpec", obs.spec_error),
        )
    dep = obs.deployment
    no_pool = _routing_problem(obs)
    if dep is None:
        if obs.reconcile_error:
            degraded = (True, "ReconcileFailed", obs.reconcile_error)
        elif no_pool:
            degraded = (True, "InferencePoolUnavailable", no_pool)
        else:
            degraded = (False, "AsExpected", "No problem found.")
        return (
            (False, "DeploymentMissing", "The Deployment does not exist yet."),
            (True, "Creating", "Creating the children."),
            degraded,
        )

    status = dep.get("status", {})
    meta = dep.get("metadata", {})
    desired = dep.get("spec", {}).get("replicas", obs.desired_replicas or 1)
    updated = status.get("updatedReplicas", 0)
    available = status.get("availableReplicas", 0)
    ready_count = status.get("readyReplicas", 0)
    total = status.get("replicas", 0)
    observed = status.get("observedGeneration")
    generation = meta.get("generation")
    synced = generation is None or (observed is not None and observed >= generation)
    progress_cond = _deployment_condition(dep, "Progressing")
    failure_cond = _deployment_condition(dep, "ReplicaFailure")
    stalled = progress_cond.get("status") == "False"
    # New pods exist but have not become available yet (they may be loading the model).
    settling = progress_cond.get("reason") != "NewReplicaSetAvailable" and available < updated
    rolling = not synced or updated < desired or total > updated or settling

    if ready_count >= desired:
        ready = (True, "ReplicasReady", f"{ready_count}/{desired} replicas are ready.")
    elif ready_count > 0:
        ready = (True, "PartiallyReady", f"{ready_count}/{desired} replicas are ready.")
    else:
        ready = (False, "NoReplicaReady", f"0/{desired} replicas are ready.")

    if stalled:
        progressing = (False, "RolloutStalled", progress_cond.get("message", "Rollout stalled."))
    elif rolling:
        progressing = (
            True,
            "RollingOut",
            f"{updated}/{desired} replicas updated, {available} available.",
        )
    else:
        progressing = (False, "RolloutComplete", "Every replica runs the current spec.")

    if obs.reconcile_error:
        degraded = (True, "ReconcileFailed", obs.reconcile_error)
    elif stalled:
        degraded = (
            True,
            progress_cond.get("reason", "ProgressDeadlineExceeded"),
            progress_cond.get("message", "The rollout stalled."),
        )
    elif failure_cond.get("status") == "True":
        degraded = (True, "ReplicaFailure", failure_cond.get("message", "Pods cannot be created."))
    elif ready_count < desired and not rolling:
        degraded = (True, "ReplicasUnavailable", f"Only {ready_count}/{desired} replicas ready.")
    elif no_pool:
        degraded = (True, "InferencePoolUnavailable", no_pool)
    else:
        degraded = (False, "AsExpected", "No problem found.")
    return ready, progressing, degraded


def _phase(ready: bool, progressing: bool, degraded: bool, has_deployment: bool) -> str:
    if degraded:
        return "Degraded"
    if ready and not progressing:
        return "Ready"
    if has_deployment or progressing:
        return "Progressing"
    return "Pending"


def _merge_condition(
    previous: list[Condition],
    kind: str,
    value: tuple[bool, str, str],
    generation: int | None,
    now: str,
) -> Condition:
    status, reason, message = value
    text = "True" if status else "False"
    old = next((c for c in previous if c.get("type") == kind), None)
    since = (
        old["lastTransitionTime"]
        if old and old.get("status") == text and old.get("lastTransitionTime")
        else now
    )
    cond: Condition = {
        "type": kind,
        "status": text,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def compute(
    obs: Observation, previous: dict[str, Any] | None, now: datetime.datetime | None = None
) -> dict[str, Any]:
    """The whole ``status`` the InferenceService should have."""
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    prev_conditions = (previous or {}).get("conditions") or []
    ready, progressing, degraded = _assess(obs)
    if not degraded[0] and (obs.model or {}).get("state") == "Failed":
        failed = obs.model or {}
        degraded = (
            True,
            "ModelFailed",
            f"The model cannot be delivered ({failed.get('reason')}): {failed.get('message')}",
        )
    conditions = [
        _merge_condition(prev_conditions, "Ready", ready, obs.generation, stamp),
        _merge_condition(prev_conditions, "Progressing", progressing, obs.generation, stamp),
        _merge_condition(prev_conditions, "Degraded", degraded, obs.generation, stamp),
    ]
    if obs.model is not None and "state" in obs.model:
        delivered = model_condition(obs.model)
        conditions.append(
            _merge_condition(prev_conditions, "ModelReady", delivered, obs.generation, stamp)
        )
    if obs.routing is not None:
        routing = routing_condition(obs.routing, obs.service or "")
        conditions.append(
            _merge_condition(prev_conditions, "Routing", routing, obs.generation, stamp)
        )
    dep_status = (obs.deployment or {}).get("status", {})
    result: dict[str, Any] = {
        "phase": _phase(ready[0], progressing[0], degraded[0], obs.deployment is not None),
        "conditions": conditions,
        "replicas": dep_status.get("replicas", 0),
        "readyReplicas": dep_status.get("readyReplicas", 0),
    }
    if obs.generation is not None:
        result["observedGeneration"] = obs.generation
    for key in ("url", "selector", "model"):
        value = getattr(obs, key)
        if value is not None:
            result[key] = value
    return result


def differs(current: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    """Whether writing ``desired`` would change anything (avoids no-op status writes)."""
    current = current or {}
    return any(current.get(key) != value for key, value in desired.items())
