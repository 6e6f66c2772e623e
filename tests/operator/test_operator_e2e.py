"""The operator end to end: kopf against kmock's Kubernetes emulator.

The emulator stores what it is sent and streams watch events, but runs no controllers: the
tests play the Deployment controller (writing its status) and the user (``kubectl apply``,
``kubectl edit``, ``kubectl delete``) through the same HTTP API the operator uses.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import kmock
import pytest
from operator_testkit import IS_RESOURCE, NAMESPACE, eventually, inference_service, stored

from tokenline_operator import names

pytestmark = pytest.mark.timeout(60)

API = f"/apis/{names.API_VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
MERGE = {"Content-Type": "application/merge-patch+json"}
WRITES = ("POST", "PUT", "PATCH", "DELETE")


def condition(obj: dict, kind: str) -> dict:
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


async def apply(cluster: kmock.KubernetesEmulator, body: dict) -> None:
    resp = await cluster.post(API, json=body)
    assert resp.ok, await resp.text()


async def patch(cluster: kmock.KubernetesEmulator, path: str, body: dict) -> None:
    resp = await cluster.patch(path, json=body, headers=MERGE)
    assert resp.ok, await resp.text()


async def mark_available(cluster: kmock.KubernetesEmulator, replicas: int = 1) -> None:
    """Play the Deployment controller: every replica updated, ready and available."""
    await patch(
        cluster,
        f"{DEPLOYMENTS}/chat/status",
        {
            "status": {
                "observedGeneration": 1,
                "replicas": replicas,
                "updatedReplicas": replicas,
                "readyReplicas": replicas,
                "availableReplicas": replicas,
                "conditions": [
                    {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                    {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
                ],
            }
        },
    )


async def test_apply_creates_owned_children(cluster, operator):
    await apply(cluster, inference_service(engine={"gpus": 1}))

    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    svc = await eventually(lambda: stored(cluster, "v1/services"))
    cm = await eventually(lambda: stored(cluster, "v1/configmaps", "chat-config"))
    for obj in (dep, svc, cm):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == (names.KIND, "chat", "uid-chat")
        assert ref["controller"] is True
        assert obj["metadata"]["labels"][names.LABEL_MANAGED_BY] == names.MANAGED_BY

    assert cm["data"]["TOKENLINE_MODEL"] == "Qwen/Qwen2.5-0.5B-Instruct"
    pod = dep["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert list(containers) == list(names.STAGES)
    assert {c["image"] for c in containers.values()} == {"tokenline:test"}
    assert containers["scheduler"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert dep["spec"]["replicas"] == 1
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]

    status = await eventually(lambda: stored(cluster, IS_RESOURCE)["status"])
    assert status["phase"] == "Progressing"
    assert condition({"status": status}, "Ready")["status"] == "False"
    assert status["url"] == f"http://chat.{NAMESPACE}.svc.cluster.local:8000"
    # kopf and the reconciler both authenticate with the kubeconfig's credentials.
    operator_requests = [
        r for r in cluster if not r.headers.get("User-Agent", "").startswith("kmock")
    ]
    agents = {
        r.headers.get("User-Agent", "").split("/")[0]: r.headers.get("Authorization")
        for r in operator_requests
    }
    assert len(agents) == 2 and set(agents.values()) == {"Bearer test-token"}, agents
    # kopf lists and watches only the operator's children (a server-side label selector).
    child_watches = [r for r in operator_requests if r.url.path == "/apis/apps/v1/deployments"]
    assert child_watches
    assert {r.params.get("labelSelector") for r in child_watches} == {
        f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
    }
    # One replica: no disruption budget; no autoscaling: no autoscaler.
    for optional in ("policy/v1/poddisruptionbudgets", "autoscaling/v2/horizontalpodautoscalers"):
        with pytest.raises(KeyError):
            stored(cluster, optional)


async def test_available_deployment_makes_the_service_ready(cluster, operator):
    await apply(cluster, inference_service())
    await eventually(lambda: stored(cluster, "apps/v1/deployments"))

    await mark_available(cluster)

    def ready() -> dict:
        obj = stored(cluster, IS_RESOURCE)
        assert condition(obj, "Ready")["status"] == "True"
        return obj["status"]

    status = await eventually(ready)
    assert status["phase"] == "Ready"
    assert status["readyReplicas"] == 1
    assert status["observedGeneration"] == 1
    assert condition({"status": status}, "Progressing")["reason"] == "RolloutComplete"
    assert condition({"status": status}, "Degraded")["status"] == "False"


async def test_model_change_updates_the_deployment(cluster, operator):
    await apply(cluster, inference_service())
    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    old_hash = dep["spec"]["template"]["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH]

    await patch(
        cluster,
        f"{API}/chat",
        {"metadata": {"generation": 2}, "spec": {"model": {"name": "Qwen/Qwen3-8B"}}},
    )

    def rolled() -> dict:
        cm = stored(cluster, "v1/configmaps", "chat-config")
        assert cm["data"]["TOKENLINE_MODEL"] == "Qwen/Qwen3-8B"
        dep = stored(cluster, "apps/v1/deployments")
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations[names.ANNOTATION_CONFIG_HASH] != old_hash
        return dep

    await eventually(rolled)
    status = await eventually(
        lambda: stored(cluster, IS_RESOURCE)["status"]["observedGeneration"] == 2
    )
    assert status


async def test_deleted_child_is_recreated(cluster, operator):
    await apply(cluster, inference_service())
    await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    await eventually(lambda: stored(cluster, "v1/services"))

    for path in (f"{DEPLOYMENTS}/chat", f"/api/v1/namespaces/{NAMESPACE}/services/chat"):
        resp = await cluster.delete(path)
        assert resp.ok, await resp.text()

    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    await eventually(lambda: stored(cluster, "v1/services"))
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"


async def test_hand_edited_child_is_restored(cluster, operator):
    await apply(cluster, inference_service())
    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    tampered = [dict(c, image="evil:latest") for c in dep["spec"]["template"]["spec"]["containers"]]

    await patch(
        cluster, f"{DEPLOYMENTS}/chat", {"spec": {"template": {"spec": {"containers": tampered}}}}
    )

    def restored() -> bool:
        containers = stored(cluster, "apps/v1/deployments")["spec"]["template"]["spec"]
        return {c["image"] for c in containers["containers"]} == {"tokenline:test"}

    await eventually(restored)


async def test_invalid_spec_shows_degraded_and_an_event(cluster, operator):
    await apply(cluster, inference_service(engine={"dtype": "int4"}))

    def degraded() -> dict:
        obj = stored(cluster, IS_RESOURCE)
        assert condition(obj, "Degraded")["status"] == "True"
        return obj["status"]

    status = await eventually(degraded)
    assert status["phase"] == "Degraded"
    cond = condition({"status": status}, "Degraded")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.engine.dtype" in cond["message"]

    def invalid_spec_event() -> dict | None:
        events = [
            e.raw
            for (res, _, _), e in cluster.objects.items()
            if res.plural == "events" and not e.deleted and e.raw.get("reason") == "InvalidSpec"
        ]
        return events[0] if events else None

    event = await eventually(invalid_spec_event)
    assert event["type"] == "Warning"
    assert event["involvedObject"]["uid"] == "uid-chat"
    with pytest.raises(KeyError):
        stored(cluster, "apps/v1/deployments")

    # Fixing the spec is enough: the failure was permanent for that spec only.
    await patch(cluster, f"{API}/chat", {"spec": {"engine": {"dtype": "bfloat16"}}})
    await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    await eventually(
        lambda: condition(stored(cluster, IS_RESOURCE), "Degraded")["status"] == "False"
    )


@pytest.mark.parametrize("optional_apis", [{"keda", "monitoring"}])
async def test_keda_and_prometheus_operator_children(cluster, operator):
    await apply(
        cluster,
        inference_service(autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 6}),
    )

    scaled = await eventually(lambda: stored(cluster, "keda.sh/v1alpha1/scaledobjects"))
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"
    assert names.WAITING_METRIC in trigger["metadata"]["query"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 6)
    monitor = await eventually(lambda: stored(cluster, "monitoring.coreos.com/v1/podmonitors"))
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert ports == set(names.PORT_NAMES.values())
    await eventually(lambda: stored(cluster, "policy/v1/poddisruptionbudgets"))
    # The autoscaler owns the replica count.
    assert "replicas" not in stored(cluster, "apps/v1/deployments")["spec"]
    with pytest.raises(KeyError):
        stored(cluster, "autoscaling/v2/horizontalpodautoscalers")


async def test_hpa_without_keda_and_removal_when_disabled(cluster, operator):
    await apply(cluster, inference_service(autoscaling={"enabled": True}))
    hpa = await eventually(lambda: stored(cluster, "autoscaling/v2/horizontalpodautoscalers"))
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == names.WAITING_METRIC

    await patch(cluster, f"{API}/chat", {"spec": {"autoscaling": {"enabled": False}}})

    def hpa_gone() -> bool:
        try:
            stored(cluster, "autoscaling/v2/horizontalpodautoscalers")
        except KeyError:
            return True
        return False

    await eventually(hpa_gone)
    await eventually(lambda: stored(cluster, "apps/v1/deployments")["spec"]["replicas"] == 1)


async def test_reconcile_settles_without_writes(cluster, operator):
    await apply(cluster, inference_service(replicas=2))
    await eventually(lambda: stored(cluster, "policy/v1/poddisruptionbudgets"))
    await mark_available(cluster, replicas=2)
    await eventually(lambda: stored(cluster, IS_RESOURCE)["status"]["phase"] == "Ready")

    def kopf_bookkeeping(request: Any) -> bool:
        """kopf's own annotations on the InferenceService, which it echoes (see below)."""
        body = request.data if isinstance(request.data, dict) else {}
        return (
            request.method == "PATCH"
            and request.url.path == f"{API}/chat"
            and set(body) == {"metadata"}
            and set(body["metadata"]) == {"annotations"}
            and all(
                k.startswith(names.KOPF_ANNOTATIONS_PREFIX) for k in body["metadata"]["annotations"]
            )
        )

    def writes() -> list[tuple[str, str]]:
        return [
            (r.method, str(r.url))
            for r in cluster
            if r.method in WRITES and not kopf_bookkeeping(r)
        ]

    # The emulator has no resourceVersions, so kopf cannot skip the echoes of its own
    # patches as it does on a real API server, and on a loaded machine they can go on past
    # any quiet period: they are left out, and the reconciler's writes (children, status)
    # must die out.
    seen, quiet_since = len(writes()), asyncio.get_running_loop().time()
    while asyncio.get_running_loop().time() - quiet_since < 0.5:
        await asyncio.sleep(0.1)
        if len(writes()) != seen:
            seen, quiet_since = len(writes()), asyncio.get_running_loop().time()

    await asyncio.sleep(1.0)
    late = writes()[seen:]
    assert not late


async def test_liveness_and_metrics(cluster, operator):
    await apply(cluster, inference_service())
    await eventually(lambda: stored(cluster, IS_RESOURCE).get("status"))

    async with aiohttp.ClientSession() as session, session.get(operator["health"]) as resp:
        assert resp.status == 200
        assert "reconciles" in await resp.json()

    metrics = operator["metrics"]
    samples = {
        (s.name, s.labels.get("result")): s.value
        for family in metrics.registry.collect()
        for s in family.samples
    }
    assert samples[("tokenline_operator_reconciles_total", "ok")] >= 1
    assert samples[("tokenline_operator_reconcile_duration_seconds_count", None)] >= 1


NETWORK_POLICIES = "networking.k8s.io/v1/networkpolicies"
NETWORK_POLICY_PATH = f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies"


async def test_network_policy_is_owned_reconciled_and_removed(cluster, operator):
    await apply(
        cluster,
        inference_service(
            networkPolicy={
                "apiFrom": [{"namespace": "gateway"}],
                "metricsFrom": [{"namespace": "observability"}],
            }
        ),
    )
    policy = await eventually(lambda: stored(cluster, NETWORK_POLICIES))
    (ref,) = policy["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"]) == (names.KIND, "uid-chat", True)
    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    assert policy["spec"]["podSelector"] == dep["spec"]["selector"]
    api, metrics = policy["spec"]["ingress"]
    gateway = {"namespaceSelector": {"matchLabels": {names.LABEL_NAMESPACE_NAME: "gateway"}}}
    assert api["from"] == [gateway]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {
        names.LABEL_NAMESPACE_NAME: "observability"
    }

    # Opened by hand: the operator closes it again.
    await patch(cluster, f"{NETWORK_POLICY_PATH}/chat", {"spec": {"ingress": [{"from": [{}]}]}})
    await eventually(lambda: stored(cluster, NETWORK_POLICIES)["spec"]["ingress"][0] == api)

    # Deleted by hand: recreated.
    resp = await cluster.delete(f"{NETWORK_POLICY_PATH}/chat")
    assert resp.ok, await resp.text()
    await eventually(lambda: stored(cluster, NETWORK_POLICIES)["spec"]["ingress"][0] == api)

    # Turned off: deleted, and the rest stays.
    await patch(cluster, f"{API}/chat", {"spec": {"networkPolicy": {"enabled": False}}})

    def policy_gone() -> bool:
        try:
            stored(cluster, NETWORK_POLICIES)
        except KeyError:
            return True
        return False

    await eventually(policy_gone)
    assert stored(cluster, "apps/v1/deployments")


async def test_a_network_policy_the_api_refuses_shows_in_the_status(cluster, operator):
    """Like every child's: the Deployment still rolls out, Degraded says what failed."""
    refusal = {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403}
    for method in ("post", "patch"):
        cluster[f"{method} {NETWORK_POLICY_PATH}"] << 403 << refusal
        cluster[f"{method} {NETWORK_POLICY_PATH}/chat"] << 403 << refusal
    await apply(cluster, inference_service())
    await eventually(lambda: stored(cluster, "apps/v1/deployments"))

    def degraded() -> dict:
        cond = condition(stored(cluster, IS_RESOURCE), "Degraded")
        assert cond["status"] == "True"
        return cond

    cond = await eventually(degraded)
    assert cond["reason"] == "ReconcileFailed"
    assert "networkpolicies" in cond["message"] and "403" in cond["message"]
    assert stored(cluster, IS_RESOURCE)["status"]["phase"] == "Degraded"
