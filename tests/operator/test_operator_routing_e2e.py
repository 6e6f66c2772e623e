"""spec.routing.inferencePool end to end: kopf against kmock, with and without the CRD.

With the Inference Extension's InferencePool resource served, the operator creates the pool
and its endpoint picker, owned, valid against the extension's CRD, following the spec and
removed when routing is turned off; without it, the status says routing is a plain Service.
"""

from __future__ import annotations

import asyncio
import logging

import inference_pool_schema
import kmock
import pytest
import yaml
from operator_testkit import IS_RESOURCE, NAMESPACE, absent, eventually, inference_service, stored

from tokenline_operator import names
from tokenline_operator.routing import inference_pool, picker_config

pytestmark = pytest.mark.timeout(60)

API = f"/apis/{names.API_VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}"
POOLS = "inference.networking.k8s.io/v1/inferencepools"
MERGE = {"Content-Type": "application/merge-patch+json"}
#: Each routing child: its resource in the emulator, and its name.
ROUTING_CHILDREN = {
    "ServiceAccount": ("v1/serviceaccounts", "chat-epp"),
    "Role": ("rbac.authorization.k8s.io/v1/roles", "chat-epp"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1/rolebindings", "chat-epp"),
    "ConfigMap": ("v1/configmaps", "chat-epp"),
    "Deployment": ("apps/v1/deployments", "chat-epp"),
    "Service": ("v1/services", "chat-epp"),
    "NetworkPolicy": ("networking.k8s.io/v1/networkpolicies", "chat-epp"),
    "InferencePool": (POOLS, "chat"),
}


def condition(cluster: kmock.KubernetesEmulator, kind: str) -> dict:
    obj = stored(cluster, IS_RESOURCE)
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


async def apply(cluster: kmock.KubernetesEmulator, body: dict) -> None:
    resp = await cluster.post(API, json=body)
    assert resp.ok, await resp.text()


async def patch(cluster: kmock.KubernetesEmulator, path: str, body: dict) -> None:
    resp = await cluster.patch(path, json=body, headers=MERGE)
    assert resp.ok, await resp.text()


@pytest.mark.parametrize("optional_apis", [{"inferencepool"}])
async def test_the_pool_and_picker_are_created_owned_valid_and_follow_the_spec(cluster, operator):
    await apply(cluster, inference_service(networkPolicy={"apiFrom": [{"namespace": "gw"}]}))

    live = {}
    for kind, (resource, name) in ROUTING_CHILDREN.items():
        live[kind] = await eventually(lambda r=resource, n=name: stored(cluster, r, n))
        (ref,) = live[kind]["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == (names.KIND, "chat", "uid-chat")
        assert ref["controller"] is True
    pool = live["InferencePool"]
    assert inference_pool_schema.violations(pool) == []
    stages = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    pod_labels = stages["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": names.API_PORT}]
    assert pool["spec"]["endpointPickerRef"]["name"] == live["Service"]["metadata"]["name"]
    config = yaml.safe_load(live["ConfigMap"]["data"][inference_pool.PICKER_CONFIG_FILE])
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    assert (
        extractor["parameters"]["engineConfigs"][0]["kvUsageSpec"]
        == (names.ENDPOINT_METRICS["kvUsageSpec"])
    )
    assert live["RoleBinding"]["subjects"][0]["name"] == live["ServiceAccount"]["metadata"]["name"]
    picker = live["Deployment"]["spec"]["template"]["spec"]
    assert picker["serviceAccountName"] == "chat-epp"

    # Until the picker has a ready replica, the condition says so.
    assert (await eventually(lambda: condition(cluster, "Routing")))["reason"] == "PickerNotReady"
    await patch(
        cluster,
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/chat-epp/status",
        {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
    )
    await eventually(lambda: condition(cluster, "Routing")["status"] == "True")
    assert condition(cluster, "Routing")["reason"] == "InferencePool"

    # A new ext-proc port and failure mode reach the pool, the Service and the picker.
    await patch(
        cluster,
        f"{API}/chat",
        {
            "metadata": {"generation": 2},
            "spec": {
                "routing": {"inferencePool": {"extProcPort": 9102, "failureMode": "FailClose"}}
            },
        },
    )

    def moved() -> bool:
        ref = stored(cluster, POOLS)["spec"]["endpointPickerRef"]
        svc = stored(cluster, "v1/services", "chat-epp")
        dep = stored(cluster, "apps/v1/deployments", "chat-epp")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        return (
            ref["port"] == {"number": 9102}
            and ref["failureMode"] == "FailClose"
            and svc["spec"]["ports"][0]["port"] == 9102
            and args[args.index("--grpc-port") + 1] == "9102"
        )

    await eventually(moved)
    assert inference_pool_schema.violations(stored(cluster, POOLS)) == []

    # A pool deleted by hand comes back.
    resp = await cluster.delete(
        f"/apis/{POOLS.rsplit('/', 1)[0]}/namespaces/{NAMESPACE}/inferencepools/chat"
    )
    assert resp.ok, await resp.text()
    await eventually(lambda: stored(cluster, POOLS))

    # Turned off: every routing child goes, the plain Service and the stages stay.
    await patch(
        cluster, f"{API}/chat", {"spec": {"routing": {"inferencePool": {"enabled": False}}}}
    )

    def all_gone() -> bool:
        return all(absent(cluster, r, n) for r, n in ROUTING_CHILDREN.values())

    await eventually(all_gone)
    assert stored(cluster, "v1/services") and stored(cluster, "apps/v1/deployments")
    await eventually(lambda: condition(cluster, "Routing")["reason"] == "PlainService")
    assert "enabled is false" in condition(cluster, "Routing")["message"]


async def test_without_the_crd_the_condition_says_plain_service(cluster, operator):
    await apply(cluster, inference_service())
    await eventually(lambda: stored(cluster, "apps/v1/deployments"))

    cond = await eventually(lambda: condition(cluster, "Routing"))
    assert (cond["status"], cond["reason"]) == ("False", "PlainService")
    assert names.INFERENCE_POOL_CRD in cond["message"]
    assert "plain Service chat" in cond["message"]
    for resource, name in ROUTING_CHILDREN.values():
        assert absent(cluster, resource, name)


def _reconciles(operator: dict) -> float:
    (family,) = operator["metrics"].reconciles.collect()
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


async def test_asking_for_a_pool_the_cluster_cannot_serve_is_degraded_but_serves(
    cluster, operator, caplog
):
    caplog.set_level(logging.DEBUG)
    await apply(cluster, inference_service(routing={"inferencePool": {"enabled": True}}))
    await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    await eventually(lambda: stored(cluster, "v1/services"))

    degraded = await eventually(
        lambda: (
            condition(cluster, "Degraded")["status"] == "True" and condition(cluster, "Degraded")
        )
    )
    assert degraded["reason"] == "InferencePoolUnavailable"
    assert names.INFERENCE_POOL_CRD in degraded["message"]
    assert "plain Service chat" in degraded["message"]
    assert condition(cluster, "Routing")["reason"] == "InferencePoolUnavailable"
    assert absent(cluster, "apps/v1/deployments", "chat-epp")

    # Every later reconcile finds the same cluster: said once, then at debug, and never an
    # error (a failed reconcile would be retried and logged by kopf every 30 s).
    done = _reconciles(operator)
    for replicas in (1, 2, 3):
        await patch(
            cluster,
            f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/chat/status",
            {"status": {"replicas": replicas, "readyReplicas": replicas}},
        )
        await eventually(lambda r=replicas: _reconciles(operator) >= done + r)
    told = [r for r in caplog.records if names.INFERENCE_POOL_CRD in r.getMessage()]
    assert [r.levelno for r in told if r.levelno > logging.DEBUG] == [logging.WARNING]
    assert sum(r.levelno == logging.DEBUG for r in told) >= 3
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    assert condition(cluster, "Degraded")["reason"] == "InferencePoolUnavailable"


@pytest.mark.parametrize("optional_apis", [{"inferencepool"}])
async def test_a_routed_service_settles_without_writes(cluster, operator):
    await apply(cluster, inference_service(replicas=2))
    for resource, name in ROUTING_CHILDREN.values():
        await eventually(lambda r=resource, n=name: stored(cluster, r, n))
    await patch(
        cluster,
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/chat-epp/status",
        {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
    )
    await eventually(lambda: condition(cluster, "Routing")["status"] == "True")

    def child_writes() -> list[str]:
        # the reconciler's writes to children (kopf's echoes on the owner are left out)
        return [
            f"{r.method} {r.url.path}"
            for r in cluster
            if r.method in ("POST", "PUT", "PATCH", "DELETE") and names.PLURAL not in r.url.path
        ]

    seen, quiet_since = len(child_writes()), asyncio.get_running_loop().time()
    while asyncio.get_running_loop().time() - quiet_since < 0.5:
        await asyncio.sleep(0.1)
        if len(child_writes()) != seen:
            seen, quiet_since = len(child_writes()), asyncio.get_running_loop().time()
    await asyncio.sleep(1.0)
    assert child_writes()[seen:] == []


@pytest.mark.parametrize("optional_apis", [{"inferencepool"}])
async def test_kv_events_open_the_pods_and_make_the_picker_llm_ds(cluster, operator):
    """spec.router.kvEvents (issue 31): the pods publish, the picker subscribes; turned off,
    both go back."""
    await apply(cluster, inference_service(router={"kvEvents": {"enabled": True}}))

    def scheduler() -> dict:
        template = stored(cluster, "apps/v1/deployments")["spec"]["template"]
        return next(c for c in template["spec"]["containers"] if c["name"] == "scheduler")

    container = await eventually(scheduler)
    assert {p["name"]: p["containerPort"] for p in container["ports"]}.items() >= {
        ("kv-events", names.KV_EVENTS_PORT),
        ("kv-replay", names.KV_REPLAY_PORT),
    }
    template = stored(cluster, "apps/v1/deployments")["spec"]["template"]
    assert template["metadata"]["labels"][names.LABEL_KV_EVENTS] == "true"
    seed = next(e["value"] for e in container["env"] if e["name"] == "PYTHONHASHSEED")
    settings = stored(cluster, "v1/configmaps", "chat-config")["data"]
    assert settings["TOKENLINE_PREFIX_CACHING_HASH_ALGO"] == "sha256_cbor"

    picker_cm = await eventually(lambda: stored(cluster, "v1/configmaps", "chat-epp"))
    config = yaml.safe_load(picker_cm["data"][inference_pool.PICKER_CONFIG_FILE])
    scorer = next(p for p in config["plugins"] if p["type"] == picker_config.PRECISE_SCORER)
    assert scorer["parameters"]["tokenProcessorConfig"]["hashSeed"] == seed
    assert scorer["parameters"]["kvEventsConfig"]["podDiscoveryConfig"] == {
        "socketPort": names.KV_EVENTS_PORT
    }
    picker = await eventually(lambda: stored(cluster, "apps/v1/deployments", "chat-epp"))
    assert picker["spec"]["template"]["spec"]["containers"][0]["image"] == names.LLMD_PICKER_IMAGE
    policy = await eventually(lambda: stored(cluster, "networking.k8s.io/v1/networkpolicies"))
    assert any(
        {p["port"] for p in rule["ports"]} == {names.KV_EVENTS_PORT, names.KV_REPLAY_PORT}
        for rule in policy["spec"]["ingress"]
    )

    await patch(cluster, f"{API}/chat", {"spec": {"router": {"kvEvents": {"enabled": False}}}})

    def back() -> bool:
        # (the emulator merges an apply, so a label or key dropped stays there; a real API
        # server's server-side apply removes what the operator no longer applies)
        picker = stored(cluster, "apps/v1/deployments", "chat-epp")["spec"]["template"]
        image = picker["spec"]["containers"][0]["image"]
        return len(scheduler()["ports"]) == 1 and image == names.PICKER_IMAGE

    await eventually(back)
    env = {e["name"] for e in scheduler()["env"]}
    assert not {"POD_IP", "PYTHONHASHSEED", "TOKENLINE_KV_EVENTS_ENDPOINT"} & env
