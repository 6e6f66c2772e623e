"""``spec.model.lora``: LoRA adapters served on the base model (issue 27).

``{adapters: [{name, uri}], maxAdapters, maxRank}`` becomes:

- on the api and scheduler containers, ``--enable-lora``; on the scheduler ``--max-loras``
  (maxAdapters), ``--max-lora-rank`` (maxRank) and ``--lora-config`` pointing at
  :data:`LORA_CONFIG_FILE`: their TOKENLINE_* mirrors, plain values of the pod template (read
  once at start, so a changed bound rolls the pods, as it must);
- a ConfigMap ``<name>-lora`` (an owned child) holding ``adapters.json``
  (``{"adapters": [{"name", "uri"}]}``), mounted as a volume in the scheduler. The adapters are
  never part of the pod template: adding, removing or changing one rewrites only that
  ConfigMap, the kubelet swaps the file in place, and the scheduler's watcher
  (``tokenline.scheduler.lora_config``) loads and unloads them without a restart.

Adapter URIs take model delivery's schemes, checked by the same CRD rules as
``spec.model.uri``. hf://, s3://, https:// and directories are fetched by the scheduler itself,
with the model's credentials (``hfTokenSecret``, ``s3Secret``), which the scheduler gets
whenever LoRA is on, so an adapter from a new scheme needs no new environment. pvc:// and
oci:// need a volume: the claim (read-only, under :data:`PVC_ROOT`) or, where the cluster
mounts images, an image volume (under :data:`OCI_ROOT`), and the file names the mounted
directory instead of the URI. Those two are the exception: an adapter on a claim not yet
mounted, or any new oci:// adapter, changes the pod template and rolls the pods. Without image
volumes an oci:// adapter is passed through as its URI, for the scheduler to refuse (an error
in its log and metrics; the others load).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from tokenline.fetch import parse_uri
from tokenline.fetch.uri import OciURI, PvcURI
from tokenline.settings import BY_FLAG

from .. import names
from ..crd.lora import DEFAULT_MAX_ADAPTERS, DEFAULT_MAX_RANK
from ..crd.spec import Spec
from ..objects import Manifest, Owner, metadata
from . import model

#: Where the scheduler reads the adapters file (the ConfigMap volume, read-only).
LORA_DIR = "/etc/tokenline/lora"
LORA_CONFIG_KEY = "adapters.json"
LORA_CONFIG_FILE = f"{LORA_DIR}/{LORA_CONFIG_KEY}"
LORA_VOLUME = "lora-config"
#: pvc:// adapters: each claim mounted read-only at <PVC_ROOT>/<claim> in the scheduler.
PVC_ROOT = "/mnt/lora/pvc"
#: oci:// adapters with image volumes: each image at <OCI_ROOT>/<adapter name>.
OCI_ROOT = "/mnt/lora/oci"

DEFAULT_MAX_CPU_LORAS: int = BY_FLAG["max-cpu-loras"].default


def enabled(spec: Spec) -> bool:
    return spec["model"].get("lora") is not None


def adapters(spec: Spec) -> list[dict[str, str]]:
    lora = spec["model"].get("lora") or {}
    return list(lora.get("adapters") or [])


# --- the adapters file ------------------------------------------------------------------------


def config_map_name(owner: Owner) -> str:
    return f"{owner.name}-lora"


def _claims(spec: Spec) -> list[str]:
    """The claims pvc:// adapters read from, sorted (their volumes' order)."""
    found = {u.claim for u in _parsed(spec).values() if isinstance(u, PvcURI)}
    return sorted(found)


def _oci_adapters(spec: Spec) -> dict[str, OciURI]:
    return {n: u for n, u in sorted(_parsed(spec).items()) if isinstance(u, OciURI)}


def _parsed(spec: Spec) -> dict[str, Any]:
    return {a["name"]: parse_uri(a["uri"].strip()) for a in adapters(spec)}


def _where(uri_text: str, name: str, image_volumes: bool) -> str:
    """What the file tells the scheduler: the mounted directory for pvc:// (and oci:// with
    image volumes), else the URI itself."""
    uri = parse_uri(uri_text.strip())
    if isinstance(uri, PvcURI):
        root = f"{PVC_ROOT}/{uri.claim}"
        return posixpath.join(root, uri.path) if uri.path else root
    if isinstance(uri, OciURI) and image_volumes:
        # the image's own /models, as a model image ("modelcar") keeps it
        return f"{OCI_ROOT}/{name}{names.OCI_IMAGE_MODEL_DIR}"
    return uri_text.strip()


def config_document(spec: Spec, image_volumes: bool = False) -> dict[str, Any]:
    """The adapters file: ``{"adapters": [{"name", "uri"}]}`` in the spec's order."""
    return {
        "adapters": [
            {"name": a["name"], "uri": _where(a["uri"], a["name"], image_volumes)}
            for a in adapters(spec)
        ]
    }


def config_map(owner: Owner, spec: Spec, image_volumes: bool = False) -> Manifest:
    text = json.dumps(config_document(spec, image_volumes), indent=2) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, config_map_name(owner)),
        "data": {LORA_CONFIG_KEY: text},
    }


# --- the pod ----------------------------------------------------------------------------------


def _env(flag: str, value: str) -> dict[str, str]:
    return {"name": BY_FLAG[flag].env, "value": value}


def stage_env(spec: Spec, stage: str) -> list[dict[str, Any]]:
    """The LoRA flags (as their mirrors) and, for the scheduler, the model's credentials."""
    if not enabled(spec) or stage not in ("api", "scheduler"):
        return []
    env = [_env("enable-lora", "true")]
    if stage == "api":
        return env
    lora = spec["model"]["lora"]
    resident = int(lora.get("maxAdapters", DEFAULT_MAX_ADAPTERS))
    env += [
        _env("max-loras", str(resident)),
        _env("max-lora-rank", str(int(lora.get("maxRank", DEFAULT_MAX_RANK)))),
        _env("lora-config", LORA_CONFIG_FILE),
    ]
    if resident > DEFAULT_MAX_CPU_LORAS:  # host memory holds at least the resident ones
        env.append(_env("max-cpu-loras", str(resident)))
    return env + credentials_env(spec)


def credentials_env(spec: Spec) -> list[dict[str, Any]]:
    """The model's credentials for the scheduler's adapter downloads, from their Secrets.

    Whenever LoRA is on and the Secret is set, whatever the adapters' schemes: an adapter
    from a new scheme then changes the ConfigMap only. HF_TOKEN only with ``model.uri``
    (with ``model.name`` every stage has it already)."""
    model_spec = spec["model"]
    env: list[dict[str, Any]] = []
    secret = model_spec.get("hfTokenSecret")
    if secret and model.uri_of(spec):
        ref = {"name": secret["name"], "key": secret["key"]}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    if model_spec.get("s3Secret"):
        name = model_spec["s3Secret"]["name"]
        for key, optional in model.S3_SECRET_KEYS:
            ref: dict[str, Any] = {"name": name, "key": key}
            if optional:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def scheduler_mounts(spec: Spec, image_volumes: bool = False) -> list[dict[str, Any]]:
    if not enabled(spec):
        return []
    mounts = [{"name": LORA_VOLUME, "mountPath": LORA_DIR, "readOnly": True}]
    mounts += [
        {"name": f"lora-pvc-{i}", "mountPath": f"{PVC_ROOT}/{claim}", "readOnly": True}
        for i, claim in enumerate(_claims(spec))
    ]
    if image_volumes:
        mounts += [
            {"name": f"lora-oci-{i}", "mountPath": f"{OCI_ROOT}/{name}", "readOnly": True}
            for i, name in enumerate(_oci_adapters(spec))
        ]
    return mounts


#: The adapters file is world-readable: it names URIs, never credentials.
CONFIG_FILE_MODE = 0o444


def volumes(owner: Owner, spec: Spec, image_volumes: bool = False) -> list[dict[str, Any]]:
    """The ConfigMap volume (no ``items``, no ``subPath``: only then does the kubelet update
    the file in place), and the pvc:// claims and oci:// images adapters need."""
    if not enabled(spec):
        return []
    result: list[dict[str, Any]] = [
        {
            "name": LORA_VOLUME,
            "configMap": {"name": config_map_name(owner), "defaultMode": CONFIG_FILE_MODE},
        }
    ]
    result += [
        {"name": f"lora-pvc-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        for i, claim in enumerate(_claims(spec))
    ]
    if image_volumes:
        result += [
            {
                "name": f"lora-oci-{i}",
                "image": {"reference": uri.reference, "pullPolicy": "IfNotPresent"},
            }
            for i, uri in enumerate(_oci_adapters(spec).values())
        ]
    return result
