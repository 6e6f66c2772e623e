"""spec.disaggregation (issue 49) and spec.model.runner: pooling (issue 51) end to end: kopf
against kmock's emulator (which runs no controllers: the tests play the Deployments').

A P/D InferenceService becomes two Deployments by role under one InferencePool with llm-d's
picker; the status reads both; turned off, the one Deployment comes back. A spec it cannot
serve is Degraded with the reason. A pooling model's pods run with --runner pooling and its
pool's picker routes /rerank and /score as well as /v1/embeddings.
"""

from __future__ import annotations

import kmock
import pytest
import yaml
from operator_testkit import IS_RESOURCE, NAMESPACE, absent, eventually, inference_service, stored

from tokenline_operator import names
from tokenline_operator.routing import inference_pool, picker_config

pytestmark = pytest.mark.timeout(60)

API = f"/apis/{names.API_VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}"
DEPLOYMENTS = "apps/v1/deployments"
POOLS = "inference.networking.k8s.io/v1/inferencepools"
SECRETS = "v1/secrets"
MERGE = {"Content-Type": "application/merge-patch+json"}
PD = {"prefill": {"replicas": 2}, "decode": {"replicas": 1}}


def condition(cluster: kmock.KubernetesEmulator, kind: str) -> dict:
    obj = stored(cluster, IS_RESOURCE)
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


async def apply(cluster: kmock.KubernetesEmulator, body: dict) -> None:
    resp = await cluster.post(API, json=body)
    assert resp.ok, await resp.text()


async def patch(cluster: kmock.KubernetesEmulator, path: str, body: dict) -> None:
    resp = await cluster.patch(path, json=body, headers=MERGE)
    assert resp.ok, await resp.text()


async def roll_out(cluster: kmock.KubernetesEmulator, name: str, replicas: int) -> None:
    """Play the Deployment controller: every pod of ``name`` is up."""
    generation = stored(cluster, DEPLOYMENTS, name)["metadata"].get("generation", 1)
    status = {
        "observedGeneration": generation,
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas,
        "availableReplicas": replicas,
        "conditions": [
            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
        ],
    }
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}/status"
    await patch(cluster, path, {"status": status})


def labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("optional_apis", [{"inferencepool"}])
async def test_prefill_and_decode_deployments_under_one_pool_then_back_to_one(cluster, operator):
    await apply(cluster, inference_service(disaggregation=PD))

    prefill = await eventually(lambda: stored(cluster, DEPLOYMENTS, "chat-prefill"))
    decode = await eventually(lambda: stored(cluster, DEPLOYMENTS, "chat-decode"))
    assert absent(cluster, DEPLOYMENTS, "chat")
    assert labels(prefill)[names.LABEL_LLMD_ROLE] == "prefill"
    assert labels(decode)[names.LABEL_LLMD_ROLE] == "decode"
    for dep in (prefill, decode):
        (ref,) = dep["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["controller"]) == (names.KIND, "chat", True)
    containers = [c["name"] for c in decode["spec"]["template"]["spec"]["containers"]]
    assert containers[0] == "routing-sidecar" and "routing-sidecar" not in str(prefill)

    pool = await eventually(lambda: stored(cluster, POOLS))
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels(prefill).items()
    assert selector.items() <= labels(decode).items()
    picker = await eventually(lambda: stored(cluster, "v1/configmaps", "chat-epp"))
    config = yaml.safe_load(picker["data"][inference_pool.PICKER_CONFIG_FILE])
    assert {"disagg-profile-handler", "prefix-based-pd-decider"} <= {
        p["type"] for p in config["plugins"]
    }
    epp = stored(cluster, DEPLOYMENTS, "chat-epp")
    assert epp["spec"]["template"]["spec"]["containers"][0]["image"] == names.LLMD_PD_PICKER_IMAGE
    svc = stored(cluster, "v1/services")
    assert svc["spec"]["selector"][names.LABEL_LLMD_ROLE] == "decode"
    # The side channel's keys: made once, owned, mounted by both roles' schedulers.
    keys = stored(cluster, SECRETS, "chat-kv-side-channel")
    (ref,) = keys["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"]) == (names.KIND, "chat")
    assert set(keys["data"]) == {"ring.key", "ring.key_secret"}
    for dep in (prefill, decode):
        volumes = dep["spec"]["template"]["spec"]["volumes"]
        assert {"secretName": "chat-kv-side-channel", "defaultMode": 0o440} in [
            v.get("secret") for v in volumes
        ]

    # The status reads both: prefill alone up serves nothing; with decode up it is Ready.
    await roll_out(cluster, "chat-prefill", 2)
    await eventually(lambda: "2/3 replicas updated" in condition(cluster, "Progressing")["message"])
    assert condition(cluster, "Ready")["reason"] == "NoReplicaReady"
    await roll_out(cluster, "chat-decode", 1)

    def ready() -> dict:
        status = stored(cluster, IS_RESOURCE)["status"]
        assert status["phase"] == "Ready", status
        return status

    assert (await eventually(ready))["readyReplicas"] == 3

    # A role deleted by hand comes back; the reconciles it takes keep the same keys.
    resp = await cluster.delete(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/chat-decode")
    assert resp.ok, await resp.text()
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "chat-decode"))
    assert stored(cluster, SECRETS, "chat-kv-side-channel")["data"] == keys["data"]

    # Turned off: the roles go, the one Deployment and the plain picker come back.
    await patch(
        cluster, f"{API}/chat", {"metadata": {"generation": 2}, "spec": {"disaggregation": None}}
    )
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "chat"))
    await eventually(
        lambda: (
            absent(cluster, DEPLOYMENTS, "chat-prefill")
            and absent(cluster, DEPLOYMENTS, "chat-decode")
        )
    )
    one = stored(cluster, DEPLOYMENTS, "chat")
    assert names.LABEL_LLMD_ROLE not in labels(one)
    await eventually(lambda: absent(cluster, SECRETS, "chat-kv-side-channel"))

    def plain_picker() -> bool:
        data = stored(cluster, "v1/configmaps", "chat-epp")["data"]
        return "disagg-profile-handler" not in data[inference_pool.PICKER_CONFIG_FILE]

    await eventually(plain_picker)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {"engine": {"extraArgs": ["--kv-transfer-config", "{}"]}},
            "--kv-transfer-config is set by",
        ),
        ({"engine": {"nodes": 2, "tensorParallelSize": 2}}, "set engine.nodes to 1"),
    ],
)
async def test_a_disaggregation_it_cannot_serve_is_degraded_and_makes_no_pods(
    cluster, operator, fields, problem
):
    await apply(cluster, inference_service(disaggregation=PD, **fields))

    degraded = await eventually(lambda: condition(cluster, "Degraded"))
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert problem in degraded["message"]
    for name in ("chat", "chat-prefill", "chat-decode"):
        assert absent(cluster, DEPLOYMENTS, name)


@pytest.mark.parametrize("optional_apis", [{"inferencepool"}])
async def test_a_pooling_model_runs_with_runner_pooling_and_its_pool_routes_rerank(
    cluster, operator
):
    model = {"name": "BAAI/bge-reranker-base", "runner": "pooling"}
    await apply(cluster, inference_service(model=model))

    dep = await eventually(lambda: stored(cluster, DEPLOYMENTS, "chat"))
    config_map = await eventually(lambda: stored(cluster, "v1/configmaps", "chat-config"))
    scheduler = next(
        c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "scheduler"
    )
    runner = next(e for e in scheduler["env"] if e["name"] == "TOKENLINE_RUNNER")
    ref = runner["valueFrom"]["configMapKeyRef"]
    # TOKENLINE_RUNNER mirrors --runner: the scheduler runs with --runner pooling
    assert (ref["name"], config_map["data"][ref["key"]]) == ("chat-config", "pooling")

    pool = await eventually(lambda: stored(cluster, POOLS))
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels(dep).items()
    picker = await eventually(lambda: stored(cluster, "v1/configmaps", "chat-epp"))
    config = yaml.safe_load(picker["data"][inference_pool.PICKER_CONFIG_FILE])
    # the OpenAI parser reads /rerank and /score as completions without a prompt and refuses
    # them; the body-blind parser routes every pooling route
    assert config["parser"] == {"pluginRef": picker_config.PASSTHROUGH_PARSER}
    types = {p["type"] for p in config["plugins"]}
    assert "prefix-cache-scorer" not in types and "queue-scorer" in types
    epp = stored(cluster, DEPLOYMENTS, "chat-epp")
    assert epp["spec"]["template"]["spec"]["containers"][0]["image"] == names.PICKER_IMAGE
