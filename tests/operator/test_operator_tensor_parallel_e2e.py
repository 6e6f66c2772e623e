"""spec.engine.tensorParallelSize and spec.engine.nodes: the GPUs and /dev/shm of a pod, the
CRD's rules, and, for a model that spans nodes, a LeaderWorkerSet in place of the Deployment
(kopf against kmock's emulator, which runs no controllers: the tests play LWS's)."""

from __future__ import annotations

import pytest
from operator_testkit import IS_RESOURCE, NAMESPACE, eventually, inference_service, stored

from tokenline_operator import names
from tokenline_operator.controller import manifests
from tokenline_operator.crd import spec
from tokenline_operator.objects import Capabilities, Owner
from tokenline_operator.pods import deployment as pods
from tokenline_operator.pods import parallel

pytestmark = pytest.mark.timeout(60)

API = f"/apis/{names.API_VERSION}/namespaces/{NAMESPACE}/{names.PLURAL}"
LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
OWNER = Owner(name="chat", namespace=NAMESPACE, uid="uid-chat")
MULTI_NODE = {"gpus": 1, "tensorParallelSize": 8, "nodes": 2}


def _parse(engine: dict) -> spec.Spec:
    return spec.parse("chat", {"model": {"name": "m"}, "engine": engine}, default_image="i:1")


def _scheduler(pod_spec: dict) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == "scheduler")


def _shm(pod_spec: dict) -> str:
    return next(v for v in pod_spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]


def test_one_node_pod_requests_a_gpu_per_rank_and_shm_for_nccl():
    pod = pods.deployment(OWNER, _parse({"tensorParallelSize": 4}))["spec"]["template"]["spec"]
    assert _scheduler(pod)["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert _shm(pod) == "8Gi"
    env = {e["name"]: e.get("valueFrom") for e in _scheduler(pod)["env"]}
    assert "TOKENLINE_TENSOR_PARALLEL_SIZE" in env  # from the ConfigMap, like every setting
    cpu = pods.deployment(OWNER, _parse({"tensorParallelSize": 2, "gpus": 0}))
    assert "nvidia.com/gpu" not in str(cpu)


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"tensorParallelSize": 3, "nodes": 2}, "multiple of nodes"),
        ({"tensorParallelSize": 16}, "at most 8 GPUs per node"),
        ({"tensorParallelSize": 4, "gpus": 2}, "must equal tensorParallelSize / nodes"),
        ({"tensorParallelSize": 0}, "tensorParallelSize"),
    ],
)
def test_impossible_combinations_are_refused(engine, message):
    with pytest.raises(spec.SpecError, match=message):
        _parse(engine)


def test_the_crd_carries_the_same_rules():
    rules = [r["rule"] for r in parallel_rules()]
    assert len(rules) == 3 and all("tensorParallelSize" in r for r in rules)


def parallel_rules() -> list[dict]:
    from tokenline_operator.crd import definition as crd

    return crd.ENGINE["x-kubernetes-validations"]


def test_multi_node_children_are_a_leader_worker_set_and_no_deployment():
    children = manifests.children(OWNER, _parse(MULTI_NODE), Capabilities())
    assert "Deployment" not in children and "LeaderWorkerSet" in children
    assert children["Service"]["spec"]["selector"][parallel.LABEL_ROLE] == "leader"


@pytest.fixture
def optional_apis() -> set[str]:
    return {"lws"}


async def test_nodes_above_one_make_a_leader_worker_set(cluster, operator):
    resp = await cluster.post(API, json=inference_service(engine=MULTI_NODE))
    assert resp.ok, await resp.text()

    lws = await eventually(lambda: stored(cluster, LWS))
    (ref,) = lws["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"]) == (names.KIND, "chat")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]
    assert [c["name"] for c in leader["containers"]] == list(names.STAGES)
    assert [c["name"] for c in worker["containers"]] == ["scheduler"]
    for pod in (leader, worker):
        scheduler = _scheduler(pod)
        assert scheduler["resources"]["limits"]["nvidia.com/gpu"] == 4  # 8 ranks on 2 nodes
        assert _shm(pod) == "8Gi"
        args = scheduler["args"]
        assert args[args.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
        assert args[args.index("--nnodes") + 1] == "$(LWS_GROUP_SIZE)"
    worker_args = _scheduler(worker)["args"]
    assert worker_args[worker_args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert "--node-rank" not in _scheduler(leader)["args"]
    svc = await eventually(lambda: stored(cluster, "v1/services"))
    assert svc["spec"]["selector"][parallel.LABEL_ROLE] == "leader"
    with pytest.raises(KeyError):
        stored(cluster, "apps/v1/deployments")

    # Play the LWS controller: the one group is ready.
    resp = await cluster.patch(
        f"/apis/{LWS}".replace("/leaderworkersets", f"/namespaces/{NAMESPACE}/leaderworkersets")
        + "/chat/status",
        json={
            "status": {
                "replicas": 1,
                "readyReplicas": 1,
                "updatedReplicas": 1,
                "conditions": [{"type": "Available", "status": "True", "reason": "AllGroupsReady"}],
            }
        },
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.ok, await resp.text()

    def ready() -> dict:
        status = stored(cluster, IS_RESOURCE)["status"]
        assert status["phase"] == "Ready", status
        return status

    status = await eventually(ready)
    assert status["readyReplicas"] == 1


@pytest.mark.parametrize("optional_apis", [set()])
async def test_without_the_lws_api_the_service_says_so(cluster, operator, optional_apis):
    resp = await cluster.post(API, json=inference_service(engine=MULTI_NODE))
    assert resp.ok, await resp.text()

    def degraded() -> dict:
        status = stored(cluster, IS_RESOURCE)["status"]
        cond = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert cond["status"] == "True" and "LeaderWorkerSet" in cond["message"], cond
        return cond

    await eventually(degraded)
    with pytest.raises(KeyError):
        stored(cluster, "apps/v1/deployments")
