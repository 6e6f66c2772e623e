"""Pure status computation: phase and conditions from the Deployment."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from tokenline_operator.controller.drift import is_subset
from tokenline_operator.names import INFERENCE_POOL_CRD
from tokenline_operator.status import conditions as status

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def deployment(
    replicas: int = 2,
    *,
    updated: int = 2,
    ready: int = 2,
    available: int = 2,
    total: int | None = None,
    progressing: dict | None = None,
    extra: list[dict] | None = None,
) -> dict[str, Any]:
    conditions = [
        progressing or {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
    ]
    return {
        "metadata": {"generation": 3},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 3,
            "replicas": replicas if total is None else total,
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "availableReplicas": available,
            "conditions": conditions + (extra or []),
        },
    }


def compute(dep: dict | None = None, previous: dict | None = None, now=T0, **kw) -> dict:
    obs = status.Observation(generation=7, desired_replicas=2, deployment=dep, url="http://x", **kw)
    return status.compute(obs, previous, now=now)


def conditions(result: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in result["conditions"]}


def test_all_replicas_available_is_ready():
    result = compute(deployment())
    assert result["phase"] == "Ready"
    assert conditions(result) == {
        "Ready": ("True", "ReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert result["observedGeneration"] == 7
    assert result["readyReplicas"] == 2
    assert all(c["observedGeneration"] == 7 for c in result["conditions"])


def test_new_pods_loading_the_model_are_progressing():
    dep = deployment(
        ready=0,
        available=0,
        updated=2,
        progressing={"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},
    )
    result = compute(dep)
    assert result["phase"] == "Progressing"
    assert conditions(result)["Ready"] == ("False", "NoReplicaReady")
    assert conditions(result)["Progressing"] == ("True", "RollingOut")


def test_rollout_with_old_pods_serving_is_ready_and_progressing():
    dep = deployment(
        updated=1,
        ready=2,
        available=2,
        total=3,
        progressing={"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},
    )
    result = compute(dep)
    assert conditions(result)["Ready"] == ("True", "ReplicasReady")
    assert conditions(result)["Progressing"][0] == "True"
    assert result["phase"] == "Progressing"


def test_stalled_rollout_is_degraded():
    dep = deployment(
        ready=0,
        available=0,
        progressing={
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "ReplicaSet chat-abc has timed out progressing.",
        },
    )
    result = compute(dep)
    assert result["phase"] == "Degraded"
    assert conditions(result)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    assert conditions(result)["Progressing"] == ("False", "RolloutStalled")


def test_replica_lost_after_rollout_is_degraded():
    result = compute(deployment(ready=1, available=1))
    assert conditions(result)["Ready"] == ("True", "PartiallyReady")
    assert conditions(result)["Degraded"] == ("True", "ReplicasUnavailable")


def test_quota_failure_is_degraded():
    failure = {
        "type": "ReplicaFailure",
        "status": "True",
        "reason": "FailedCreate",
        "message": "exceeded quota: gpu",
    }
    result = compute(deployment(ready=0, available=0, updated=0, extra=[failure]))
    assert conditions(result)["Degraded"] == ("True", "ReplicaFailure")


def test_invalid_spec_is_degraded_with_its_message():
    result = compute(None, spec_error="spec.engine.dtype: 'int4' is not one of [...]")
    assert result["phase"] == "Degraded"
    degraded = next(c for c in result["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.engine.dtype" in degraded["message"]


def test_api_failure_is_degraded_but_keeps_reporting_the_deployment():
    result = compute(deployment(), reconcile_error="PATCH ...: 403 Forbidden")
    assert conditions(result)["Degraded"] == ("True", "ReconcileFailed")
    assert conditions(result)["Ready"] == ("True", "ReplicasReady")


@pytest.mark.parametrize("dep", [deployment(), None], ids=["serving", "no-deployment"])
def test_a_pool_asked_for_but_not_served_is_degraded_and_says_how_to_fix_it(dep):
    routing = status.Routing(wanted=True, served=False)
    result = compute(dep, routing=routing, service="chat")
    degraded = next(c for c in result["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InferencePoolUnavailable")
    assert INFERENCE_POOL_CRD in degraded["message"] and "plain Service chat" in degraded["message"]
    assert conditions(result)["Routing"] == ("False", "InferencePoolUnavailable")
    assert result["phase"] == "Degraded"
    # a failed write says more than the pool, a stalled rollout too
    failed = compute(dep, routing=routing, service="chat", reconcile_error="PATCH: 403")
    assert conditions(failed)["Degraded"] == ("True", "ReconcileFailed")
    served = compute(dep, routing=status.Routing(wanted=True, served=True, pool="chat"))
    assert conditions(served)["Degraded"][1] != "InferencePoolUnavailable"


def test_transition_time_moves_only_when_the_status_flips():
    loading = deployment(
        ready=0,
        available=0,
        progressing={"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},
    )
    first = compute(loading, now=T0)
    same = compute(loading, previous=first, now=T1)
    assert not status.differs(first, same)
    flipped = compute(deployment(), previous=first, now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times["Ready"] == "2026-01-01T00:05:00Z"
    assert times["Degraded"] == "2026-01-01T00:00:00Z"  # False before and after


def test_subset_tolerates_api_defaults_and_string_quantities():
    desired = {"spec": {"replicas": 1, "ports": [{"port": 80}], "gpu": 1}}
    live = {
        "spec": {"replicas": 1, "ports": [{"port": 80, "protocol": "TCP"}], "gpu": "1"},
        "status": {},
    }
    assert is_subset(desired, live)
    assert not is_subset(desired, {"spec": {"replicas": 2, "ports": [{"port": 80}], "gpu": 1}})
    assert not is_subset({"a": [1, 2]}, {"a": [1]})
    assert not is_subset({"a": True}, {"a": "True"})
