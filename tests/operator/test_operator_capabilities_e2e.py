"""A CRD installed or removed after an InferenceService was reconciled still reaches it.

Installing the InferencePool CRD changes no InferenceService, so no watch event reconciles
them: the operator's discovery loop (every 0.2 s in these tests, ``discovery_interval``)
notices, and reconciles those made under other capabilities, each once. The emulated
cluster installs and removes the CRD the way an API server does: the resource enters or
leaves discovery, the CRD object comes or goes (kopf watches CRDs), and a removed CRD takes
its objects with it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import inference_pool_schema
import kmock
import pytest
from operator_testkit import IS_RESOURCE, NAMESPACE, absent, eventually, inference_service, stored

from tokenline_operator import names
from tokenline_operator.controller import resync
from tokenline_operator.kube import Kube

pytestmark = pytest.mark.timeout(30)

API = f"/apis/{names.API_VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}"
POOLS = f"{names.INFERENCE_POOL_API_VERSION}/inferencepools"
POOLS_DISCOVERY = f"/apis/{names.INFERENCE_POOL_API_VERSION}"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
MERGE = {"Content-Type": "application/merge-patch+json"}
#: Seconds the loop gets to notice a change: many of its intervals, few for a test.
NOTICE_WITHIN = 5.0
#: Each routing child: its resource in the emulator, and its name.
ROUTING_CHILDREN = {
    "ServiceAccount": ("v1/serviceaccounts", "chat-epp"),
    "Role": ("rbac.authorization.k8s.io/v1/roles", "chat-epp"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1/rolebindings", "chat-epp"),
    "ConfigMap": ("v1/configmaps", "chat-epp"),
    "Deployment": ("apps/v1/deployments", "chat-epp"),
    "Service": ("v1/services", "chat-epp"),
    "InferencePool": (POOLS, "chat"),
}


def condition(cluster: kmock.KubernetesEmulator, kind: str, name: str = "chat") -> dict:
    obj = stored(cluster, IS_RESOURCE, name)
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


def reasons(cluster: kmock.KubernetesEmulator) -> tuple[str, str]:
    """The Routing condition's reason and the Degraded condition's status."""
    return condition(cluster, "Routing")["reason"], condition(cluster, "Degraded")["status"]


async def install_pool_crd(cluster: kmock.KubernetesEmulator) -> None:
    cluster.resources[POOLS] = kmock.ResourceInfo(
        kind="InferencePool",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        subresources={"status"},
    )
    resp = await cluster.post(CRDS, json=inference_pool_schema.crd())
    assert resp.ok, await resp.text()


async def remove_pool_crd(cluster: kmock.KubernetesEmulator) -> None:
    del cluster.resources[POOLS]
    resp = await cluster.delete(f"{CRDS}/{names.INFERENCE_POOL_CRD}")
    assert resp.ok, await resp.text()
    del cluster.objects[POOLS, NAMESPACE, "chat"]  # an API server deletes them with their CRD


def capability_reconciles(operator: dict[str, Any]) -> float:
    (family,) = operator["metrics"].reconciles.collect()
    return sum(
        s.value
        for s in family.samples
        if s.name.endswith("_total") and s.labels["trigger"] == resync.TRIGGER
    )


def pool_discoveries(cluster: kmock.KubernetesEmulator) -> int:
    return sum(1 for r in cluster if r.method == "GET" and r.url.path == POOLS_DISCOVERY)


#: spec.routing.inferencePool.enabled, and the (Routing reason, Degraded status) without the CRD
WITHOUT_THE_CRD = pytest.mark.parametrize(
    ("enabled", "without"),
    [(True, ("InferencePoolUnavailable", "True")), (None, ("PlainService", "False"))],
    ids=["enabled", "unset"],
)


def routing(enabled: bool | None) -> dict[str, Any]:
    return {"inferencePool": {"enabled": enabled}} if enabled is not None else {}


async def routed(cluster: kmock.KubernetesEmulator) -> None:
    """Every routing child is there, the status says so, and the picker becomes ready."""
    for resource, name in ROUTING_CHILDREN.values():
        await eventually(lambda r=resource, n=name: stored(cluster, r, n), within=NOTICE_WITHIN)
    assert inference_pool_schema.violations(stored(cluster, POOLS)) == []
    await eventually(lambda: reasons(cluster) == ("PickerNotReady", "False"))
    await patch(
        cluster,
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/chat-epp/status",
        {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
    )
    await eventually(lambda: condition(cluster, "Routing")["status"] == "True")


@WITHOUT_THE_CRD
async def test_a_pool_crd_installed_later_brings_the_pool_and_its_picker(
    cluster, operator, enabled, without
):
    await apply(cluster, inference_service(routing=routing(enabled)))
    await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    assert await eventually(lambda: reasons(cluster) == without and reasons(cluster))
    assert names.INFERENCE_POOL_CRD in condition(cluster, "Routing")["message"]
    assert all(absent(cluster, r, n) for r, n in ROUTING_CHILDREN.values())

    # Installed: the pool and its picker come, and the status says so, with no edit.
    await install_pool_crd(cluster)
    await routed(cluster)

    # kopf noticed the CRD too, and watches the pools now: one deleted by hand comes back.
    await eventually(lambda: pool_watches(cluster))
    resp = await cluster.delete(
        f"/apis/{names.INFERENCE_POOL_API_VERSION}/namespaces/{NAMESPACE}/inferencepools/chat"
    )
    assert resp.ok, await resp.text()
    await eventually(lambda: stored(cluster, POOLS))


@WITHOUT_THE_CRD
async def test_a_pool_crd_removed_later_takes_the_picker_and_the_status_says_so(
    cluster, operator, enabled, without
):
    await install_pool_crd(cluster)
    await apply(cluster, inference_service(routing=routing(enabled)))
    await routed(cluster)

    # An API server refuses new pools once their CRD is going; the emulator would take one
    # from a reconcile already under way (the children's echoes), so the CRD goes when none is.
    await quiet(cluster)
    await remove_pool_crd(cluster)
    await eventually(lambda: reasons(cluster) == without, within=NOTICE_WITHIN)
    assert names.INFERENCE_POOL_CRD in condition(cluster, "Routing")["message"]
    await eventually(lambda: all(absent(cluster, r, n) for r, n in ROUTING_CHILDREN.values()))
    assert stored(cluster, "apps/v1/deployments") and stored(cluster, "v1/services")

    # Nothing broke on the way: a spec change still reaches the Deployment.
    await patch(cluster, f"{API}/chat", {"metadata": {"generation": 2}, "spec": {"replicas": 3}})
    await eventually(lambda: stored(cluster, "apps/v1/deployments")["spec"]["replicas"] == 3)


async def test_an_unchanged_cluster_costs_one_discovery_per_interval_and_no_reconcile(
    cluster, operator, discovery_interval
):
    for name in ("a", "b", "c"):
        await apply(cluster, inference_service(name))
    for name in ("a", "b", "c"):
        await eventually(lambda n=name: condition(cluster, "Routing", n))
    await asyncio.sleep(2 * discovery_interval)  # every one reconciled at least once

    reconciles, discoveries = capability_reconciles(operator), pool_discoveries(cluster)
    window = 10 * discovery_interval
    await asyncio.sleep(window)
    looks = pool_discoveries(cluster) - discoveries
    # One look per interval for the three of them (a loaded machine may fall behind).
    assert 1 <= looks <= window / discovery_interval + 1, looks
    assert capability_reconciles(operator) == reconciles == 0


async def test_callers_that_find_discovery_expired_together_share_one_request(cluster):
    kube = await Kube.connect(discovery_ttl=60)
    try:
        answers = await asyncio.gather(*(kube.serves("InferencePool") for _ in range(20)))
        assert answers == [False] * 20
        assert pool_discoveries(cluster) == 1
        assert await kube.serves("InferencePool") is False
        assert pool_discoveries(cluster) == 1  # cached

        await install_pool_crd(cluster)
        assert await kube.serves("InferencePool") is False  # cached, not yet stale
        assert await kube.serves("InferencePool", max_age=0) is True
        assert pool_discoveries(cluster) == 2
    finally:
        await kube.close()


async def quiet(cluster: kmock.KubernetesEmulator, for_s: float = 0.5) -> None:
    """Wait until the operator has sent nothing but discovery polls for ``for_s`` seconds:
    no reconcile is in flight."""
    loop = asyncio.get_running_loop()

    def requests() -> int:
        # /apis/<group>/<version> is discovery; watch streams stay open and count once
        return sum(1 for r in cluster if len(r.url.path.strip("/").split("/")) != 3)

    seen, since = requests(), loop.time()
    while loop.time() - since < for_s:
        await asyncio.sleep(0.05)
        if requests() != seen:
            seen, since = requests(), loop.time()


def pool_watches(cluster: kmock.KubernetesEmulator) -> bool:
    return any(r.url.path == f"/apis/{POOLS}" and r.params.get("watch") == "true" for r in cluster)


async def apply(cluster: kmock.KubernetesEmulator, body: dict) -> None:
    resp = await cluster.post(API, json=body)
    assert resp.ok, await resp.text()


async def patch(cluster: kmock.KubernetesEmulator, path: str, body: dict) -> None:
    resp = await cluster.patch(path, json=body, headers=MERGE)
    assert resp.ok, await resp.text()


def test_the_interval_comes_from_the_flag_or_the_environment(monkeypatch):
    from tokenline_operator import cli

    monkeypatch.delenv("TOKENLINE_DISCOVERY_INTERVAL", raising=False)
    assert cli.build_parser().parse_args([]).discovery_interval == resync.DEFAULT_INTERVAL
    monkeypatch.setenv("TOKENLINE_DISCOVERY_INTERVAL", "2.5")
    assert cli.build_parser().parse_args([]).discovery_interval == 2.5
    assert cli.build_parser().parse_args(["--discovery-interval", "0"]).discovery_interval == 0
