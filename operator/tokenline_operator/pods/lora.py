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

from . import model, names

# not .objects at import time: it imports spec, which imports the CRD, which imports this
Spec = dict[str, Any]
Manifest = dict[str, Any]

#: Where the scheduler reads the adapters file (the ConfigMap volume, read-only).
LORA_DIR = "/etc/tokenline/lora"
LORA_CONFIG_KEY = "adapters.json"
LORA_CONFIG_FILE = f"{LORA_DIR}/{LORA_CONFIG_KEY}"
LORA_VOLUME = "lora-config"
#: pvc:// adapters: each claim mounted read-only at <PVC_ROOT>/<claim> in the scheduler.
PVC_ROOT = "/mnt/lora/pvc"
#: oci:// adapters with image volumes: each image at <OCI_ROOT>/<adapter name>.
OCI_ROOT = "/mnt/lora/oci"

#: Adapter names: what requests put in `model` and metrics in a label (vLLM takes any
#: string; these survive URLs, label values and file names).
NAME_PATTERN = r"^[A-Za-z0-9._-]+$"
NAME_MAX_LENGTH = 128
#: Adapters one InferenceService lists (the ConfigMap stays far below its 1 MiB, and the
#: CEL rules on each uri stay within the API server's cost budget).
MAX_ADAPTERS_LISTED = 64
URI_MAX_LENGTH = 1024
#: Bounds of the scheduler's flags: slots on the device, and the largest rank a slot holds.
MAX_RESIDENT = 256
MAX_RANK = 512

DEFAULT_MAX_ADAPTERS: int = BY_FLAG["max-loras"].default
DEFAULT_MAX_RANK: int = BY_FLAG["max-lora-rank"].default
DEFAULT_MAX_CPU_LORAS: int = BY_FLAG["max-cpu-loras"].default


def _uri_schema() -> dict[str, Any]:
    return {
        "type": "string",
        "description": (
            "Where the adapter (Hugging Face PEFT: adapter_config.json and "
            "adapter_model.safetensors) comes from: " + model.SCHEMES_HINT + ". Fetched by the "
            "scheduler with the model's credentials; pvc:// and oci:// are mounted instead (a "
            "new claim or image rolls the pods, the other schemes never do)."
        ),
        "minLength": 1,
        # half of spec.model.uri's: the rules run on every item, within the API server's
        # CEL cost budget for the whole list
        "maxLength": URI_MAX_LENGTH,
        "x-kubernetes-validations": [
            {"rule": rule, "message": message} for rule, message in model.URI_RULES
        ],
    }


ADAPTER = {
    "type": "object",
    "required": ["name", "uri"],
    "properties": {
        "name": {
            "type": "string",
            "description": (
                "What requests name in `model` and /v1/models lists: letters, digits, '.', "
                "'_', '-'; unique, and not the base model's served name."
            ),
            "minLength": 1,
            "maxLength": NAME_MAX_LENGTH,
            "pattern": NAME_PATTERN,
        },
        "uri": _uri_schema(),
    },
}

#: spec.model.lora's schema.
LORA = {
    "type": "object",
    "description": (
        "LoRA adapters served beside the base model, mixed in one batch. Adding, removing or "
        "changing an adapter updates a ConfigMap the scheduler watches: no pod restarts "
        "(but for an adapter on a new pvc:// claim or an oci:// image, which are mounted)."
    ),
    "properties": {
        "adapters": {
            "type": "array",
            "description": "The adapters, each by its name and where it comes from.",
            "maxItems": MAX_ADAPTERS_LISTED,
            "items": ADAPTER,
            # the API server rejects two adapters of one name
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
        "maxAdapters": {
            "type": "integer",
            "description": (
                "Adapters resident on the device at once (--max-loras); requests for the "
                "others wait for a slot. A change restarts the pods."
            ),
            "default": DEFAULT_MAX_ADAPTERS,
            "minimum": 1,
            "maximum": MAX_RESIDENT,
        },
        "maxRank": {
            "type": "integer",
            "description": (
                "The highest adapter rank accepted (--max-lora-rank; sizes the device slots). "
                "A change restarts the pods."
            ),
            "default": DEFAULT_MAX_RANK,
            "minimum": 1,
            "maximum": MAX_RANK,
        },
    },
}

#: spec.model's rule: no adapter takes the base model's name (with ``uri`` and no
#: ``servedName`` the name is derived from the URI, which the operator checks itself).
SERVED_NAME_RULE = {
    "rule": "!has(self.lora) || !has(self.lora.adapters) "
    "|| (!has(self.servedName) && !has(self.name)) "
    "|| self.lora.adapters.all(a, a.name != (has(self.servedName) ? self.servedName : self.name))",
    "message": "a LoRA adapter cannot take the served model's name",
}


def enabled(spec: Spec) -> bool:
    return spec["model"].get("lora") is not None


def adapters(spec: Spec) -> list[dict[str, str]]:
    lora = spec["model"].get("lora") or {}
    return list(lora.get("adapters") or [])


def problems(model_spec: dict[str, Any], served_name: str | None) -> list[str]:
    """What the CRD rejects in spec.model.lora (list-map keys, CEL rules), for where no API
    server ran them, and what ``tokenline fetch`` would refuse in each uri."""
    lora = model_spec.get("lora")
    if not lora:
        return []
    found: list[str] = []
    seen: set[str] = set()
    for index, adapter in enumerate(lora.get("adapters") or []):
        where = f"spec.model.lora.adapters[{index}]"
        name, uri = adapter["name"], adapter["uri"]
        if name in seen:
            found.append(f"{where}.name: {name!r} is listed twice")
        seen.add(name)
        if served_name is not None and name == served_name:
            found.append(f"{where}.name: {name!r} is the served model's name")
        found.extend(f"{where}.uri: {message}" for message in model.uri_problems(uri))
    return found


# --- the adapters file ------------------------------------------------------------------------


def config_map_name(owner: Any) -> str:
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


def config_map(owner: Any, spec: Spec, image_volumes: bool = False) -> Manifest:
    from .objects import metadata

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


def volumes(owner: Any, spec: Spec, image_volumes: bool = False) -> list[dict[str, Any]]:
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
