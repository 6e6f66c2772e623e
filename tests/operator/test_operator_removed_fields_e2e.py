"""A field taken out of the spec is rolled out: the operator applies the children again.

Server-side apply drops the fields its manager no longer sends, but only if the operator
sends the apply at all. The emulator's patch is a merge (a removed key stays stored), so
these tests look at what was sent: the last apply's body, and that nothing more is sent
once the children match.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kmock
import pytest
from operator_testkit import IS_RESOURCE, NAMESPACE, eventually, inference_service, stored

from tokenline_operator import names

pytestmark = pytest.mark.timeout(60)

API = f"/apis/{names.API_VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/chat"
SERVICE = f"/api/v1/namespaces/{NAMESPACE}/services/chat"
MERGE = {"Content-Type": "application/merge-patch+json"}


async def patch_spec(cluster: kmock.KubernetesEmulator, spec: dict[str, Any]) -> None:
    resp = await cluster.patch(
        f"{API}/chat", json={"metadata": {"generation": 2}, "spec": spec}, headers=MERGE
    )
    assert resp.ok, await resp.text()


def applies(cluster: kmock.KubernetesEmulator, path: str) -> list[dict[str, Any]]:
    """The bodies of the operator's applies to one child, oldest first."""
    return [
        r.data
        for r in cluster
        if r.method == "PATCH" and r.url.path == path and isinstance(r.data, dict)
    ]


def child_writes(cluster: kmock.KubernetesEmulator) -> list[str]:
    # kopf's echoes on the owner are left out: the emulator has no resourceVersions
    return [
        f"{r.method} {r.url.path}"
        for r in cluster
        if r.method in ("POST", "PUT", "PATCH", "DELETE") and names.PLURAL not in r.url.path
    ]


async def settled(cluster: kmock.KubernetesEmulator) -> int:
    """Wait until the operator stops writing children; return how many writes it made."""
    seen, quiet_since = len(child_writes(cluster)), asyncio.get_running_loop().time()
    while asyncio.get_running_loop().time() - quiet_since < 0.5:
        await asyncio.sleep(0.1)
        if len(child_writes(cluster)) != seen:
            seen, quiet_since = len(child_writes(cluster)), asyncio.get_running_loop().time()
    return seen


def pod_spec(body: dict[str, Any]) -> dict[str, Any]:
    return body["spec"]["template"]["spec"]


async def test_removed_pod_fields_are_applied_without_them(cluster, operator):
    placement = {
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "serving",
        "serviceAccountName": "puller",
    }
    await cluster.post(API, json=inference_service(**placement))
    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    assert pod_spec(dep)["nodeSelector"] == {"gpu": "h100"}
    await settled(cluster)
    before = len(applies(cluster, DEPLOYMENT))

    await patch_spec(cluster, {key: None for key in placement})

    def applied_without() -> dict[str, Any]:
        sent = applies(cluster, DEPLOYMENT)[before:]
        assert sent
        assert not placement.keys() & pod_spec(sent[-1]).keys()
        return sent[-1]

    await eventually(applied_without)
    await eventually(lambda: stored(cluster, IS_RESOURCE)["status"]["observedGeneration"] == 2)


async def test_removed_limits_and_annotations_are_applied_without_them(cluster, operator):
    await cluster.post(
        API,
        json=inference_service(
            resources={"api": {"limits": {"memory": "16Gi"}}},
            service={"annotations": {"lb": "internal"}},
        ),
    )
    await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    await eventually(lambda: stored(cluster, "v1/services"))
    await settled(cluster)
    deployments, services = len(applies(cluster, DEPLOYMENT)), len(applies(cluster, SERVICE))

    await patch_spec(cluster, {"resources": None, "service": None})

    def limits_gone() -> bool:
        sent = applies(cluster, DEPLOYMENT)[deployments:]
        assert sent
        api = next(c for c in pod_spec(sent[-1])["containers"] if c["name"] == "api")
        return "memory" not in api.get("resources", {}).get("limits", {})

    def annotation_gone() -> bool:
        sent = applies(cluster, SERVICE)[services:]
        assert sent
        return "lb" not in sent[-1]["metadata"].get("annotations", {})

    await eventually(limits_gone)
    await eventually(annotation_gone)


async def test_an_unchanged_spec_sends_no_apply(cluster, operator):
    await cluster.post(API, json=inference_service(nodeSelector={"gpu": "h100"}))
    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    assert names.ANNOTATION_APPLIED_HASH in dep["metadata"]["annotations"]
    seen = await settled(cluster)

    # a change that leaves every child's body as it was (kopf runs the handler again)
    await patch_spec(cluster, {"nodeSelector": {"gpu": "h100"}})
    await eventually(lambda: stored(cluster, IS_RESOURCE)["status"]["observedGeneration"] == 2)
    await asyncio.sleep(1.0)
    assert child_writes(cluster)[seen:] == []
