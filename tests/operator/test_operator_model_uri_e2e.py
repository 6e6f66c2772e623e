"""spec.model.uri end to end: kopf against kmock's emulator.

The emulator runs no kubelet: the test plays it, writing a pod whose fetch init container
runs, then ends with the termination message ``tokenline fetch`` writes; the operator reads
the pods (it watches them) and reports status.model and the ModelReady condition.
"""

from __future__ import annotations

import json

import kmock
import pytest
from operator_testkit import (
    IS_RESOURCE,
    NAMESPACE,
    absent,
    eventually,
    inference_service,
    stored,
)

from tokenline.fetch import cache_name, parse_uri
from tokenline_operator import names
from tokenline_operator.objects import Owner, labels

pytestmark = pytest.mark.timeout(60)

API = f"/apis/{names.API_VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
MERGE = {"Content-Type": "application/merge-patch+json"}
URI = "hf://Qwen/Qwen3-0.6B@main"


def condition(cluster: kmock.KubernetesEmulator, kind: str, name: str = "chat") -> dict:
    obj = stored(cluster, IS_RESOURCE, name)
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


def model(cluster: kmock.KubernetesEmulator, name: str = "chat") -> dict:
    return stored(cluster, IS_RESOURCE, name)["status"]["model"]


def pod(init_state: dict) -> dict:
    owner = Owner(name="chat", namespace=NAMESPACE, uid="uid-chat")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "chat-abc", "namespace": NAMESPACE, "labels": labels(owner)},
        "spec": {
            "initContainers": [
                {"name": names.FETCH_CONTAINER, "image": "tokenline:test", "args": ["fetch", URI]}
            ],
            "containers": [{"name": "api", "image": "tokenline:test"}],
        },
        "status": {
            "initContainerStatuses": [
                {"name": names.FETCH_CONTAINER, "state": init_state, "lastState": {}}
            ]
        },
    }


async def test_a_uri_gets_a_fetch_init_container_and_its_state_in_the_status(cluster, operator):
    body = inference_service()
    body["spec"]["model"] = {"uri": URI, "hfTokenSecret": {"name": "hf"}}
    resp = await cluster.post(API, json=body)
    assert resp.ok, await resp.text()

    dep = await eventually(lambda: stored(cluster, "apps/v1/deployments"))
    template = dep["spec"]["template"]["spec"]
    (fetch,) = template["initContainers"]
    target = f"/models/{cache_name(parse_uri(URI))}"
    assert fetch["args"] == ["fetch", URI, target, "--termination-log", "/dev/termination-log"]
    cm = await eventually(lambda: stored(cluster, "v1/configmaps", "chat-config"))
    assert cm["data"]["TOKENLINE_MODEL"] == target
    assert cm["data"]["TOKENLINE_SERVED_MODEL_NAME"] == "Qwen/Qwen3-0.6B"

    # no pod yet
    await eventually(lambda: model(cluster)["state"] == "Pending")
    assert condition(cluster, "ModelReady")["status"] == "False"

    # the kubelet starts the pod: the fetch runs
    resp = await cluster.post(PODS, json=pod({"running": {"startedAt": "2025-01-01T00:00:00Z"}}))
    assert resp.ok, await resp.text()
    await eventually(lambda: model(cluster)["state"] == "Downloading")
    assert condition(cluster, "ModelReady")["reason"] == "Downloading"

    # it ends: its termination message is the model's status
    done = {
        "terminated": {
            "exitCode": 0,
            "message": json.dumps(
                {"uri": URI, "state": "Ready", "size": 42, "revision": "c0ffee", "digest": "d"}
            ),
        }
    }
    resp = await cluster.patch(
        f"{PODS}/chat-abc",
        json={
            "status": {
                "initContainerStatuses": [
                    {"name": names.FETCH_CONTAINER, "state": done, "lastState": {}}
                ]
            }
        },
        headers=MERGE,
    )
    assert resp.ok, await resp.text()
    await eventually(lambda: model(cluster)["state"] == "Ready")
    assert model(cluster) == {
        "uri": URI,
        "servedName": "Qwen/Qwen3-0.6B",
        "state": "Ready",
        "size": 42,
        "revision": "c0ffee",
        "digest": "d",
    }
    assert condition(cluster, "ModelReady")["status"] == "True"


async def test_a_uri_the_fetcher_refuses_is_a_failed_model_not_a_crash_loop(cluster, operator):
    # what an API server without the CRD's rules (or one the rules cannot see) lets through
    body = inference_service()
    body["spec"]["model"] = {"uri": "s3://models/a/../b"}
    resp = await cluster.post(API, json=body)
    assert resp.ok, await resp.text()

    await eventually(lambda: condition(cluster, "ModelReady")["reason"] == "InvalidURI")
    assert model(cluster)["state"] == "Failed"
    assert "'..'" in model(cluster)["message"]
    assert condition(cluster, "Degraded")["reason"] == "InvalidSpec"
    assert absent(cluster, "apps/v1/deployments", "chat")
