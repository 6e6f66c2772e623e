"""spec.model.lora end to end: kopf against kmock's Kubernetes emulator (see
test_operator_e2e.py). Adapters reach the pods through an owned ConfigMap volume; adding one to
a live InferenceService rewrites that ConfigMap and nothing else, so no pod restarts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from operator_testkit import IS_RESOURCE, NAMESPACE, absent, eventually, inference_service, stored

from tokenline.settings import BY_FLAG
from tokenline_operator import names

pytestmark = pytest.mark.timeout(60)

API = f"/apis/{names.API_VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
LORA_CM = f"/api/v1/namespaces/{NAMESPACE}/configmaps/chat-lora"
MERGE = {"Content-Type": "application/merge-patch+json"}
WRITES = ("POST", "PUT", "PATCH", "DELETE")
SQL = {"name": "sql", "uri": "hf://acme/sql-lora@v1"}
SUPPORT = {"name": "support", "uri": "s3://adapters/support?region=eu-west-1"}


def lora_service(adapters: list[dict], **lora: Any) -> dict:
    body = inference_service()
    body["spec"]["model"]["lora"] = {"adapters": adapters, **lora}
    return body


async def apply(cluster, body: dict) -> None:
    resp = await cluster.post(API, json=body)
    assert resp.ok, await resp.text()


async def patch(cluster, path: str, body: dict) -> None:
    resp = await cluster.patch(path, json=body, headers=MERGE)
    assert resp.ok, await resp.text()


def adapters_file(cluster) -> dict:
    return json.loads(stored(cluster, "v1/configmaps", "chat-lora")["data"]["adapters.json"])


def scheduler(dep: dict) -> dict:
    (found,) = [
        c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "scheduler"
    ]
    return found


async def settled(cluster, writes) -> int:
    """Wait until the operator's writes die out; the count of them then."""
    seen, quiet_since = len(writes()), asyncio.get_running_loop().time()
    while asyncio.get_running_loop().time() - quiet_since < 0.5:
        await asyncio.sleep(0.1)
        if len(writes()) != seen:
            seen, quiet_since = len(writes()), asyncio.get_running_loop().time()
    return seen


async def test_adapters_configmap_flags_and_volume(cluster, operator):
    await apply(cluster, lora_service([SQL], maxAdapters=2, maxRank=32))

    cm = await eventually(lambda: stored(cluster, "v1/configmaps", "chat-lora"))
    (ref,) = cm["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"]) == (names.KIND, "uid-chat", True)
    assert adapters_file(cluster) == {"adapters": [SQL]}

    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    env = {e["name"]: e.get("value") for e in scheduler(dep)["env"]}
    assert env[BY_FLAG["enable-lora"].env] == "true"
    assert env[BY_FLAG["max-loras"].env] == "2"
    assert env[BY_FLAG["max-lora-rank"].env] == "32"
    assert env[BY_FLAG["lora-config"].env] == "/etc/tokenline/lora/adapters.json"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["lora-config"]["configMap"]["name"] == "chat-lora"
    mounts = {m["name"]: m for m in scheduler(dep)["volumeMounts"]}
    assert mounts["lora-config"]["mountPath"] == "/etc/tokenline/lora"


async def test_adding_an_adapter_changes_only_the_configmap(cluster, operator):
    await apply(cluster, lora_service([SQL]))
    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    await eventually(lambda: adapters_file(cluster) == {"adapters": [SQL]})
    template = json.loads(json.dumps(dep["spec"]["template"]))

    def writes() -> list[tuple[str, str]]:
        return [(r.method, r.url.path) for r in cluster if r.method in WRITES]

    before = await settled(cluster, writes)

    await patch(
        cluster,
        f"{API}/chat",
        {"metadata": {"generation": 2}, "spec": {"model": {"lora": {"adapters": [SQL, SUPPORT]}}}},
    )
    await eventually(lambda: adapters_file(cluster) == {"adapters": [SQL, SUPPORT]})
    await eventually(lambda: stored(cluster, IS_RESOURCE)["status"]["observedGeneration"] == 2)
    await settled(cluster, writes)

    # the pod template is what it was: no rollout; nothing but the ConfigMap (and the
    # status, and kopf's own bookkeeping on the InferenceService) was written
    assert stored(cluster, "apps/v1/deployments")["spec"]["template"] == template
    late = writes()[before:]
    touched = {path for _, path in late if not path.startswith(API)}
    assert touched == {LORA_CM}, late
    assert not [w for w in late if w[1].startswith(DEPLOYMENTS)]


async def test_turning_lora_off_removes_the_configmap(cluster, operator):
    await apply(cluster, lora_service([SQL]))
    await eventually(lambda: stored(cluster, "v1/configmaps", "chat-lora"))

    # a merge patch's null removes the field
    await patch(
        cluster, f"{API}/chat", {"metadata": {"generation": 2}, "spec": {"model": {"lora": None}}}
    )
    await eventually(lambda: absent(cluster, "v1/configmaps", "chat-lora"))

    def without_lora() -> bool:
        dep = stored(cluster, "apps/v1/deployments")
        env = {e["name"] for e in scheduler(dep)["env"]}
        return BY_FLAG["enable-lora"].env not in env

    await eventually(without_lora)


async def test_a_hand_edited_adapters_file_is_restored(cluster, operator):
    await apply(cluster, lora_service([SQL]))
    await eventually(lambda: stored(cluster, "v1/configmaps", "chat-lora"))

    await patch(cluster, LORA_CM, {"data": {"adapters.json": '{"adapters": []}'}})
    await eventually(lambda: adapters_file(cluster) == {"adapters": [SQL]})


async def test_bad_adapters_degrade_the_service(cluster, operator):
    body = lora_service([SQL, {"name": "sql", "uri": "/other"}])
    await apply(cluster, body)

    def degraded() -> dict:
        obj = stored(cluster, IS_RESOURCE)
        (cond,) = [c for c in obj["status"]["conditions"] if c["type"] == "Degraded"]
        assert cond["status"] == "True"
        return cond

    cond = await eventually(degraded)
    assert cond["reason"] == "InvalidSpec"
    assert "spec.model.lora.adapters[1].name" in cond["message"]
    assert absent(cluster, "v1/configmaps", "chat-lora")
    assert absent(cluster, "apps/v1/deployments", "chat")
