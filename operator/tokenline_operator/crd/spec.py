"""Read an InferenceService spec: the CRD's defaults, its schema, its CEL rules.

The API server normally defaults and validates before the operator sees an object; the
operator does both again from the same schema (:mod:`.definition`) so that an
object stored under an older CRD, or created where no validation ran, is read the same way,
and a spec that cannot be served becomes a ``SpecError`` (a Degraded condition), never a crash.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema

from tokenline.fetch import parse_uri

from . import children, definition, disaggregation, extra_args, lora, model_uri

Spec = dict[str, Any]

#: Longest InferenceService name: children add suffixes (``-config``), pods add two hashes.
MAX_NAME_LENGTH = 52
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class SpecError(ValueError):
    """The spec cannot be served; the message says why, for a condition and an Event."""


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill in ``default`` values the way the API server does for structural schemas.

    A missing property with a default gets a copy of it (itself defaulted in turn);
    present objects and array items are walked. ``value`` is not modified.
    """
    if isinstance(value, dict):
        result = dict(value)
        for key, sub in schema.get("properties", {}).items():
            if key not in result and "default" in sub:
                result[key] = copy.deepcopy(sub["default"])
            if key in result:
                result[key] = apply_defaults(sub, result[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            known = schema.get("properties", {})
            for key in result:
                if key not in known:
                    result[key] = apply_defaults(extra, result[key])
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def _check_rules(spec: Spec) -> list[str]:
    """The CRD's CEL rules (``x-kubernetes-validations``), for where no API server ran them."""
    problems = []
    autoscaling = spec["autoscaling"]
    if autoscaling["minReplicas"] > autoscaling["maxReplicas"]:
        problems.append("spec.autoscaling: minReplicas must not exceed maxReplicas")
    problems.extend(_model_problems(spec["model"]))
    problems.extend(_engine_problems(spec["engine"]))
    served = _served_name_if_valid(spec["model"])
    if served is not None:  # else the model's own problems say why
        problems.extend(extra_args.problems(spec["engine"].get("extraArgs") or [], served))
    problems.extend(disaggregation.problems(spec))
    problems.extend(children.routing_problems(spec))
    policy = spec["networkPolicy"]
    for field in ("apiFrom", "metricsFrom", "kvEventsFrom"):
        for index, peer in enumerate(policy.get(field) or []):
            where = f"spec.networkPolicy.{field}[{index}]"
            if "cidr" in peer and peer.keys() & {"namespace", "namespaceLabels", "podLabels"}:
                problems.append(
                    f"{where}: cidr cannot be combined with namespace, namespaceLabels or podLabels"
                )
            if "namespace" in peer and "namespaceLabels" in peer:
                problems.append(f"{where}: set either namespace or namespaceLabels, not both")
    return problems


def _model_problems(model_spec: dict[str, Any]) -> list[str]:
    """spec.model's CEL rules, then what ``tokenline fetch`` would refuse in its uri."""
    problems = []
    cache = model_spec.get("cache", {})
    if len(cache.keys() & {"sizeLimit", "claimName", "hostPath"}) > 1:
        problems.append(
            "spec.model.cache: set one of sizeLimit (emptyDir), claimName (PVC) or hostPath"
        )
    if ("name" in model_spec) == ("uri" in model_spec):
        problems.append("spec.model: set exactly one of name and uri")
    uri = model_spec.get("uri")
    problems.extend(lora.problems(model_spec, _served_name_if_valid(model_spec)))
    if uri is None:
        if "hostPath" in cache:
            problems.append(
                "spec.model: cache.hostPath needs uri (name downloads into each pod's own cache)"
            )
        return problems
    if "revision" in model_spec:
        problems.append("spec.model: with uri, pin the revision in it: hf://ORG/NAME@REVISION")
    problems.extend(f"spec.model.uri: {message}" for message in model_uri.uri_problems(uri))
    return problems


def _engine_problems(engine: dict[str, Any]) -> list[str]:
    """The CRD's CEL rules on spec.engine (definition.ENGINE), for where no API server ran them."""
    size, count, gpus = engine["tensorParallelSize"], engine["nodes"], engine["gpus"]
    problems = []
    if size % count:
        problems.append(
            "spec.engine: tensorParallelSize must be a multiple of nodes (each node holds "
            "tensorParallelSize / nodes ranks)"
        )
    if size > 8 * count:
        problems.append(
            "spec.engine: at most 8 GPUs per node: tensorParallelSize / nodes must not exceed "
            "8; add nodes"
        )
    if size > 1 and gpus > 1 and size % count == 0 and gpus != size // count:
        problems.append(
            "spec.engine: gpus, when set above 1, must equal tensorParallelSize / nodes (the "
            "GPUs of one pod)"
        )
    return problems


def _served_name_if_valid(model_spec: dict[str, Any]) -> str | None:
    """The served name, or None where the uri that would name it is itself refused."""
    if model_spec.get("servedName") or model_spec.get("name"):
        return model_spec.get("servedName") or model_spec["name"]
    uri = model_spec.get("uri")
    if not uri or model_uri.uri_problems(uri):
        return None
    return model_uri.default_served_name(parse_uri(uri.strip()))


def _path(error: jsonschema.ValidationError) -> str:
    parts = ["spec"]
    for item in error.absolute_path:
        parts.append(f"[{item}]" if isinstance(item, int) else f".{item}")
    return "".join(parts).replace(".[", "[")


def parse(name: str, raw_spec: Any, *, default_image: str | None) -> Spec:
    """Default and validate a spec; raise ``SpecError`` naming every problem found.

    ``default_image`` fills ``spec.image`` when the object names none (the operator passes
    its own image, so a stage runs the same build as the operator that built it).
    """
    problems: list[str] = []
    if len(name) > MAX_NAME_LENGTH or not _DNS_1035.match(name):
        problems.append(
            f"metadata.name {name!r}: must be a DNS-1035 label (lower case letters, digits, "
            f"'-', starting with a letter) of at most {MAX_NAME_LENGTH} characters"
        )
    if not isinstance(raw_spec, dict):
        raise SpecError("; ".join([*problems, "spec: must be an object"]))

    schema = definition.spec_schema()
    spec = apply_defaults(schema, raw_spec)
    validator = jsonschema.Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(spec), key=lambda e: list(e.absolute_path)):
        problems.append(f"{_path(error)}: {error.message}")
    if not problems:
        problems.extend(_check_rules(spec))
    if not spec.get("image"):
        if default_image:
            spec["image"] = default_image
        else:
            problems.append("spec.image: required (the operator has no default image)")
    if problems:
        raise SpecError("; ".join(problems))
    return spec


def served_model_name(spec: Spec) -> str:
    """What /v1/models lists: ``model.servedName``, else the model's own name (with ``uri``:
    the Hub id, or the last component of its path)."""
    if spec["model"].get("servedName"):
        return spec["model"]["servedName"]
    if spec["model"].get("uri"):
        return model_uri.default_served_name(parse_uri(spec["model"]["uri"].strip()))
    return spec["model"]["name"]


def desired_replicas(spec: Spec) -> int:
    """Replicas the operator asks for; with an autoscaler, the floor it starts from; with
    spec.disaggregation, the prefill and decode pods together."""
    if disaggregation.enabled(spec):
        roles = spec["disaggregation"]
        return int(roles["prefill"]["replicas"]) + int(roles["decode"]["replicas"])
    if spec["autoscaling"]["enabled"]:
        return int(spec["autoscaling"]["minReplicas"])
    return int(spec["replicas"])


def tls_enabled(spec: Spec) -> bool:
    """Whether the api serves HTTPS itself (``spec.server.tlsSecret``)."""
    return bool(spec["server"].get("tlsSecret"))
