"""What every child of an InferenceService shares: its owner, the cluster's optional APIs,
and the names, labels and metadata that tie each child to its owner.

Every object carries an owner reference to its InferenceService, so Kubernetes' garbage
collector removes the children with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import names

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Owner:
    """What the builders need to know about the InferenceService itself."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Any) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


@dataclass(frozen=True)
class Capabilities:
    """Optional APIs found in the cluster, which decide the optional children."""

    keda: bool = False
    prometheus_operator: bool = False
    inference_pool: bool = False  # the cluster serves inferencepools.inference.networking.k8s.io
    #: Pods may mount OCI images as volumes (``volumes[].image``): oci:// models are mounted,
    #: not copied out by an init container.
    image_volume: bool = False


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_by(obj: dict[str, Any], owner: Owner) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner.uid for ref in refs)


def manifest(api_version: str, kind: str, meta: dict[str, Any], **body: Any) -> Manifest:
    """A Kubernetes object: its type and metadata, then its body (``spec``, ``data``, ...)."""
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, **body}


def selector_labels(name: str) -> dict[str, str]:
    """The pods' identity: immutable in the Deployment's selector, used by Service and PDB."""
    return {names.LABEL_NAME: "tokenline", names.LABEL_OWNER: name}


def labels(owner: Owner) -> dict[str, str]:
    return {
        **selector_labels(owner.name),
        names.LABEL_INSTANCE: owner.name,
        names.LABEL_COMPONENT: "inference",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
    }


def metadata(owner: Owner, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner),
        "ownerReferences": [owner_reference(owner)],
        **extra,
    }


def picker_name(owner: Owner) -> str:
    return f"{owner.name}-epp"


def picker_selector(owner: Owner) -> dict[str, str]:
    """The picker pods' identity: never the stage pods' (the pool and Service select those)."""
    return {names.LABEL_NAME: names.PICKER_APP, names.LABEL_OWNER: owner.name}


def config_map_name(owner: Owner) -> str:
    return f"{owner.name}-config"
