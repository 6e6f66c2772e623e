"""spec.engine.nodes above 1 with the rest of the operator: the InferencePool, the status,
the LeaderWorkerSet's DNS and the autoscaler (pure builders; the LWS controller's side is
written from its API: leaderworkerset.x-k8s.io/v1)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from tokenline_operator.controller import manifests
from tokenline_operator.crd import spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.pods import parallel
from tokenline_operator.routing import inference_pool
from tokenline_operator.status import conditions

OWNER = Owner(name="chat", namespace="serving", uid="uid-chat")
MULTI_NODE = {"gpus": 1, "tensorParallelSize": 8, "nodes": 2}
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def parse(**fields: Any) -> spec.Spec:
    raw = {"model": {"name": "m"}, "engine": MULTI_NODE, **fields}
    return spec.parse(OWNER.name, raw, default_image="i:1")


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def group_templates(children: dict[str, Any]) -> dict[str, dict[str, Any]]:
    group = children["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    return {"leader": group["leaderTemplate"], "worker": group["workerTemplate"]}


# --- 2: the InferencePool routes to leaders only -----------------------------------------


def test_the_pool_selects_the_leaders_that_run_the_api_not_the_workers():
    children = manifests.children(OWNER, parse(), Capabilities(inference_pool=True))
    pool = next(o for o in inference_pool.children(OWNER, parse()) if o["kind"] == "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    templates = group_templates(children)
    assert matches(selector, templates["leader"]["metadata"]["labels"])
    assert not matches(selector, templates["worker"]["metadata"]["labels"])
    assert [c["name"] for c in templates["worker"]["spec"]["containers"]] == ["scheduler"]
    # the same pods as the plain Service's
    assert selector == children["Service"]["spec"]["selector"]


def test_a_one_node_pool_still_selects_every_stage_pod():
    one = spec.parse(OWNER.name, {"model": {"name": "m"}}, default_image="i:1")
    pool = next(o for o in inference_pool.children(OWNER, one) if o["kind"] == "InferencePool")
    assert parallel.LABEL_ROLE not in pool["spec"]["selector"]["matchLabels"]


# --- 3: a healthy LeaderWorkerSet reads Ready --------------------------------------------


def lws_status(lws_conditions: list[dict[str, str]], ready: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {
            "replicas": 1,
            "readyReplicas": ready,
            "updatedReplicas": 1,
            "conditions": lws_conditions,
        },
    }


def compute(lws: dict[str, Any]) -> dict[str, Any]:
    obs = conditions.Observation(
        generation=1, desired_replicas=1, deployment=parallel.as_deployment(lws), url="http://x"
    )
    return conditions.compute(obs, None, now=T0)


def by_type(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_an_available_leader_worker_set_is_ready_not_degraded():
    # what LWS writes once every group is ready: Progressing turns False beside Available
    healthy = lws_status(
        [
            {"type": "Available", "status": "True", "reason": "AllGroupsReady"},
            {"type": "Progressing", "status": "False", "reason": "GroupsProgressing"},
            {"type": "UpdateInProgress", "status": "False", "reason": "GroupsUpdating"},
        ]
    )
    status = compute(healthy)
    assert status["phase"] == "Ready", status
    assert by_type(status)["Degraded"] == ("False", "AsExpected")
    assert by_type(status)["Progressing"] == ("False", "RolloutComplete")


def test_a_leader_worker_set_still_starting_is_progressing_not_stalled():
    starting = lws_status(
        [
            {"type": "Available", "status": "False", "reason": "AllGroupsReady"},
            {"type": "Progressing", "status": "True", "reason": "GroupsProgressing"},
        ],
        ready=0,
    )
    status = compute(starting)
    assert status["phase"] == "Progressing", status
    assert by_type(status)["Degraded"][0] == "False"


# --- 4: the workers can resolve their leader ---------------------------------------------


def test_the_groups_dns_does_not_depend_on_the_name_the_operator_service_holds():
    """LWS makes its Shared headless Service, named after the LeaderWorkerSet, only when the
    name is free; the operator's Service holds it. Per-group subdomains take other names."""
    children = manifests.children(OWNER, parse(replicas=3), Capabilities())
    lws = children["LeaderWorkerSet"]
    service_names = {o["metadata"]["name"] for o in children.values() if o["kind"] == "Service"}
    assert lws["metadata"]["name"] in service_names  # the clash the policy avoids
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    # UniquePerReplica: group g's pods live in subdomain <lws>-<g>, and LWS_LEADER_ADDRESS
    # is <lws>-<g>.<lws>-<g>.<namespace>; no operator Service may hold a subdomain's name.
    name = lws["metadata"]["name"]
    subdomains = {f"{name}-{group}" for group in range(lws["spec"]["replicas"])}
    assert not subdomains & service_names
    for template in group_templates(children).values():
        scheduler = next(c for c in template["spec"]["containers"] if c["name"] == "scheduler")
        args = scheduler["args"]
        assert args[args.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
        # the kubelet expands $(VAR) only for variables it knows: LWS injects this one, and
        # nothing in the template may shadow it
        assert "LWS_LEADER_ADDRESS" not in {e["name"] for e in scheduler.get("env", [])}


# --- 5: the autoscaler scales the LeaderWorkerSet ----------------------------------------


@pytest.mark.parametrize(
    ("caps", "kind"),
    [
        (Capabilities(keda=True), "ScaledObject"),
        (Capabilities(), "HorizontalPodAutoscaler"),
    ],
    ids=["keda", "hpa"],
)
def test_autoscaling_a_multi_node_service_targets_its_leader_worker_set(caps, kind):
    parsed = parse(autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3})
    children = manifests.children(OWNER, parsed, caps)
    target = children[kind]["spec"]["scaleTargetRef"]
    lws = children["LeaderWorkerSet"]
    assert target == {
        "apiVersion": lws["apiVersion"],
        "kind": "LeaderWorkerSet",
        "name": lws["metadata"]["name"],
    }
    assert "Deployment" not in children
    assert "replicas" not in lws["spec"]  # the autoscaler owns it


def test_autoscaling_a_one_node_service_still_targets_its_deployment():
    one = spec.parse(
        OWNER.name,
        {"model": {"name": "m"}, "autoscaling": {"enabled": True}},
        default_image="i:1",
    )
    children = manifests.children(OWNER, one, Capabilities())
    target = children["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "chat")
