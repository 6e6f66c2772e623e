"""``spec.model.lora`` in the CRD: the adapters' schema, the rule that keeps the served name
free, and the same checks in Python for where no API server ran them.

What the pods make of it (the adapters file, the scheduler's flags and volumes):
:mod:`tokenline_operator.pods.lora`.
"""

from __future__ import annotations

from typing import Any

from tokenline.settings import BY_FLAG

from . import model_uri

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


def _uri_schema() -> dict[str, Any]:
    return {
        "type": "string",
        "description": (
            "Where the adapter (Hugging Face PEFT: adapter_config.json and "
            "adapter_model.safetensors) comes from: " + model_uri.SCHEMES_HINT + ". Fetched by the "
            "scheduler with the model's credentials; pvc:// and oci:// are mounted instead (a "
            "new claim or image rolls the pods, the other schemes never do)."
        ),
        "minLength": 1,
        # half of spec.model.uri's: the rules run on every item, within the API server's
        # CEL cost budget for the whole list
        "maxLength": URI_MAX_LENGTH,
        "x-kubernetes-validations": [
            {"rule": rule, "message": message} for rule, message in model_uri.URI_RULES
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
        found.extend(f"{where}.uri: {message}" for message in model_uri.uri_problems(uri))
    return found
