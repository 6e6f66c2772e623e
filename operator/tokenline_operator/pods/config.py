"""The pod's ConfigMap: every stage setting the spec sets, as its TOKENLINE_* mirror.

Which settings exist, which CRD field sets each, and which stage takes it all come from their
declarations in `tokenline.settings.SETTINGS`; this module only reads the fields and writes
the values the way each flag's mirror reads them. A changed value changes `config_hash`,
which rolls the pods (a stage reads its environment once, at start).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from tokenline.settings import ALL_STAGES, BY_FLAG, SETTINGS, Setting, settings_of

from .. import names
from ..crd.spec import Spec, served_model_name
from ..objects import Manifest, Owner, config_map_name, metadata
from . import model, router

#: The declared settings an InferenceService sets (those with a CRD field).
CRD_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.crd is not None)

#: Which stage reads which setting; each container gets exactly its own as TOKENLINE_*
#: (``common``: every stage's), in declaration order.
STAGE_SETTINGS: dict[str, tuple[str, ...]] = {
    "common": tuple(s.env for s in CRD_SETTINGS if s.stages == ALL_STAGES),
    **{
        stage: tuple(s.env for s in settings_of(stage) if s.crd and s.stages != ALL_STAGES)
        for stage in names.STAGES
    },
}


def _device(spec: Spec) -> str:
    device = spec["engine"]["device"]
    # no GPU requested: do not let the runner find one by accident
    return "cpu" if device == "auto" and spec["engine"]["gpus"] == 0 else device


def _model(spec: Spec) -> str:
    """``model.name``, or with ``model.uri`` the directory the fetch init container fills (or
    checks): every stage loads the model from there, read-only."""
    found = model.delivery(spec, image_volumes=False)
    return found.model_path if found else spec["model"]["name"]


def _served_names(spec: Spec) -> list[str]:
    """The one name the status reports (the flag takes aliases too; the CRD sets one)."""
    return [served_model_name(spec)]


#: Values the operator decides from more than the setting's own field.
_DERIVED: dict[str, Callable[[Spec], Any]] = {
    "model": _model,
    "served-model-name": _served_names,  # always set: the name the status reports
    "device": _device,
    # unset: sha256_cbor with router.kvEvents (llm-d hashes prompts with vLLM's scheme)
    "prefix-caching-hash-algo": router.hash_algo,
}


def _mirror(setting: Setting, spec: Spec) -> str | None:
    """The setting's TOKENLINE_* value, or None to leave the key out."""
    declared = setting.crd
    assert declared is not None
    derived = _DERIVED.get(setting.flag)
    value = derived(spec) if derived else spec[declared.section].get(declared.name)
    if setting.switch:
        # only when on: a new key would change the settings' hash and roll every pod
        on = bool(value) != declared.inverted
        return declared.on if on else None
    if setting.repeatable:
        # The mirror is comma-separated (no value the schema admits holds a comma); only
        # when set, so pods made before the field existed do not roll.
        return ",".join(value or []) or None
    return None if value is None else str(value)


def config_map_data(spec: Spec) -> dict[str, str]:
    """The ConfigMap's data: every stage setting the spec sets, as TOKENLINE_* strings."""
    data = {s.env: _mirror(s, spec) for s in CRD_SETTINGS}
    return {key: value for key, value in data.items() if value is not None}


def config_map(owner: Owner, spec: Spec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, config_map_name(owner)),
        "data": config_map_data(spec),
    }


def config_hash(data: dict[str, str]) -> str:
    """A short digest of the settings: a change rolls the pods (env is read at start)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def env_name(flag: str) -> str:
    """The TOKENLINE_* mirror of a declared flag, for the values the pod itself fixes."""
    return BY_FLAG[flag].env
