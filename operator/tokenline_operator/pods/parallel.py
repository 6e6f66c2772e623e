"""Tensor parallelism in the pods: GPUs per pod, /dev/shm for NCCL, and, for a model that
spans nodes, a LeaderWorkerSet in place of the Deployment.

``spec.engine.tensorParallelSize`` ranks spread over ``spec.engine.nodes`` pods of a group.
With one node the Deployment's pod requests tensorParallelSize GPUs. With more, each replica
is a LeaderWorkerSet group (leaderworkerset.x-k8s.io, the Kubernetes SIG project vLLM and llm-d
use): the leader pod runs the api, tokenizer, detokenizer and the scheduler with ranks
0..k-1; each worker pod runs only the scheduler, holding ranks i*k..i*k+k-1, joined to the
leader's group through ``LWS_LEADER_ADDRESS``; ``LWS_GROUP_SIZE`` is the node count and
``LWS_WORKER_INDEX`` the node's rank. A pod that fails restarts its whole group.
"""

from __future__ import annotations

import copy
from typing import Any

from ..crd.spec import Spec
from ..objects import Manifest, Owner, metadata

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
#: the leader's rendezvous port for the group (the scheduler's --master-port)
MASTER_PORT = 29500
#: /dev/shm per rank: NCCL's intra-node buffers live there; Docker's 64 MiB default fails
SHM_PER_RANK_GI = 2
LABEL_ROLE = "tokenline.dev/role"
#: A headless Service per group, named ``<name>-<group>``, instead of one named after the
#: LeaderWorkerSet (that name is the operator's api Service). LWS then sets each pod's
#: subdomain to it and LWS_LEADER_ADDRESS to ``<name>-<group>.<name>-<group>.<namespace>``.
SUBDOMAIN_POLICY = "UniquePerReplica"


def nodes(spec: Spec) -> int:
    return int(spec["engine"].get("nodes", 1))


def tensor_parallel_size(spec: Spec) -> int:
    return int(spec["engine"].get("tensorParallelSize", 1))


def multi_node(spec: Spec) -> bool:
    return nodes(spec) > 1


def ranks_per_pod(spec: Spec) -> int:
    return max(1, tensor_parallel_size(spec) // nodes(spec))


def gpus_per_pod(spec: Spec) -> int:
    """The scheduler container's nvidia.com/gpu: 0 keeps it on the CPU; with tensor
    parallelism, one per rank of the pod."""
    gpus = spec["engine"]["gpus"]
    if gpus == 0:
        return 0
    return ranks_per_pod(spec) if tensor_parallel_size(spec) > 1 else gpus


def shm_size(spec: Spec) -> str:
    return (
        f"{max(1, SHM_PER_RANK_GI * ranks_per_pod(spec))}Gi"
        if tensor_parallel_size(spec) > 1
        else "1Gi"
    )


def _group_args() -> list[str]:
    """Flags of every pod's scheduler in a group; $(VAR) is expanded by the kubelet from the
    variables the LeaderWorkerSet controller injects."""
    return [
        "--nnodes", "$(LWS_GROUP_SIZE)",
        "--master-addr", "$(LWS_LEADER_ADDRESS)",
        "--master-port", str(MASTER_PORT),
    ]  # fmt: skip


def leader_worker_set(owner: Owner, spec: Spec, deployment: Manifest) -> Manifest:
    """The LeaderWorkerSet that replaces ``deployment`` when the model spans nodes: the
    Deployment's pod as the leader, and a scheduler-only pod as each worker."""
    template = copy.deepcopy(deployment["spec"]["template"])
    leader = copy.deepcopy(template)
    leader["metadata"]["labels"][LABEL_ROLE] = "leader"
    for container in leader["spec"]["containers"]:
        if container["name"] == "scheduler":
            container["args"] = [*container["args"], *_group_args()]
            container["ports"] = [
                *container["ports"],
                {"name": "tp-rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"},
            ]
    worker = copy.deepcopy(template)
    worker["metadata"]["labels"][LABEL_ROLE] = "worker"
    scheduler = next(c for c in worker["spec"]["containers"] if c["name"] == "scheduler")
    scheduler["args"] = [*scheduler["args"], *_group_args(), "--node-rank", "$(LWS_WORKER_INDEX)"]
    worker["spec"]["containers"] = [scheduler]
    body: dict[str, Any] = {
        "leaderWorkerTemplate": {
            "size": nodes(spec),
            # a rank that dies leaves its peers in a broken group: restart them together
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": leader,
            "workerTemplate": worker,
        },
        "startupPolicy": "LeaderCreated",
        # The operator's Service already holds the LeaderWorkerSet's name, and LWS makes its
        # Shared headless Service (the pods' DNS) only when that name is free: workers could
        # not resolve the leader. Per-group headless Services take other names.
        "networkConfig": {"subdomainPolicy": SUBDOMAIN_POLICY},
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {
                "maxUnavailable": spec["rollout"]["maxUnavailable"],
                "maxSurge": spec["rollout"]["maxSurge"],
            },
        },
    }
    if "replicas" in deployment["spec"]:
        body["replicas"] = deployment["spec"]["replicas"]
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": metadata(owner, owner.name),
        "spec": body,
    }


def as_deployment(lws: dict[str, Any] | None) -> dict[str, Any] | None:
    """A LeaderWorkerSet read as the Deployment the status code knows: its groups are the
    replicas; a group counts as available once ready (LWS has no separate availability)."""
    if lws is None:
        return None
    view = copy.deepcopy(lws)
    status = view.setdefault("status", {})
    status.setdefault("availableReplicas", status.get("readyReplicas", 0))
    status["conditions"] = _deployment_conditions(status.get("conditions") or [])
    if any(c.get("type") == "Available" for c in status.get("conditions") or []):
        # LWS does not report observedGeneration; a reported state is taken as current
        status.setdefault("observedGeneration", view.get("metadata", {}).get("generation"))
    return view


def _deployment_conditions(conditions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """LeaderWorkerSet conditions as a Deployment's. LWS keeps Available, Progressing and
    UpdateInProgress mutually exclusive, so Progressing turns False exactly when all groups
    are ready, and it has no progress deadline: a False Progressing never means a stalled
    rollout, as it does on a Deployment. Progressing is rewritten to read as a Deployment's:
    complete (NewReplicaSetAvailable) once Available, in progress otherwise."""
    available = any(c.get("type") == "Available" and c.get("status") == "True" for c in conditions)
    lws_progressing = next((c for c in conditions if c.get("type") == "Progressing"), {})
    if available:
        progressing = {
            "type": "Progressing",
            "status": "True",
            "reason": "NewReplicaSetAvailable",
            "message": "Every group is ready and runs the current template.",
        }
    else:
        progressing = {
            "type": "Progressing",
            "status": "True",
            "reason": lws_progressing.get("reason", "GroupsProgressing"),
            "message": lws_progressing.get("message", "Groups are progressing."),
        }
    return [*(c for c in conditions if c.get("type") != "Progressing"), progressing]
