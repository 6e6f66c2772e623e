"""The operator's RBAC rules, written once.

The chart's template reads them from ``charts/tokenline/files/operator-rbac-rules.yaml``, which
``python -m tokenline_operator.chartgen`` writes from :data:`RULES`; a test keeps the two
equal. Each rule says which code needs it.
"""

from __future__ import annotations

from typing import Any

from . import names

READ = ["get", "list", "watch"]


def _managed(group: str, *resources: str) -> dict[str, Any]:
    """A kind of child the operator creates, updates and deletes."""
    return {
        "apiGroups": [group],
        "resources": list(resources),
        "verbs": [*READ, "create", "patch", "delete"],
    }


RULES: list[dict[str, Any]] = [
    # The handlers watch InferenceServices; kopf patches its bookkeeping annotations.
    {"apiGroups": [names.GROUP], "resources": [names.PLURAL], "verbs": [*READ, "patch"]},
    # reconcile.py writes the status.
    {
        "apiGroups": [names.GROUP],
        "resources": [f"{names.PLURAL}/status"],
        "verbs": ["get", "patch"],
    },
    # Owner references with blockOwnerDeletion need this where the API server enforces it.
    {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/finalizers"], "verbs": ["update"]},
    # Children that always exist; Kubernetes' garbage collector deletes them with the owner.
    # The endpoint picker's ConfigMap, Service and Deployment are deleted when routing is off.
    _managed("", "configmaps", "services"),
    _managed("apps", "deployments"),
    # spec.engine.nodes > 1: a LeaderWorkerSet in place of the Deployment.
    _managed("leaderworkerset.x-k8s.io", "leaderworkersets"),
    # spec.routing.inferencePool: the pool, and the picker's identity and Role.
    _managed(names.INFERENCE_POOL_GROUP, "inferencepools"),
    _managed("", "serviceaccounts"),
    _managed("rbac.authorization.k8s.io", "roles", "rolebindings"),
    # What the picker's Role grants: Kubernetes lets the operator grant only what it holds.
    # The handlers watch the stage pods too: their fetch init containers are status.model.
    {"apiGroups": [""], "resources": ["pods"], "verbs": READ},
    {
        "apiGroups": ["inference.networking.x-k8s.io"],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": READ,
    },
    # Optional children, deleted when the spec stops asking for them.
    _managed("policy", "poddisruptionbudgets"),
    _managed("autoscaling", "horizontalpodautoscalers"),
    _managed("keda.sh", "scaledobjects"),
    _managed("monitoring.coreos.com", "podmonitors"),
    # spec.disaggregation: the KV side channel's keys (controller/side_channel_keys.py), made
    # once and deleted when it is turned off; never listed, watched or rewritten.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "delete"]},
    # spec.networkPolicy (on by default); deleted when it is turned off.
    _managed("networking.k8s.io", "networkpolicies"),
    # kopf posts Events (InvalidSpec, handler failures) on the InferenceService.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # kopf notices CRDs (KEDA, Prometheus operator) installed after it started.
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    # kopf resolves namespace patterns (--namespace 'team-*').
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]


def rules() -> list[dict[str, Any]]:
    """A copy of the rules, safe to change."""
    return [{key: list(value) for key, value in rule.items()} for rule in RULES]


def cluster_role(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, **({"labels": labels} if labels else {})},
        "rules": rules(),
    }
