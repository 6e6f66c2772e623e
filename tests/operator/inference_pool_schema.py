"""The InferencePool CRD fixture, and validation the way the API server applies it.

jsonschema checks the OpenAPI schema; the CRD's two CEL rules are checked here by hand (no
CEL evaluator is installed), and fields the schema does not declare count as errors, since
the API server would prune them silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import yaml

FIXTURE = Path(__file__).parent / "fixtures" / "inferencepools.inference.networking.k8s.io.yaml"


def crd() -> dict[str, Any]:
    return yaml.safe_load(FIXTURE.read_text())


def schema() -> dict[str, Any]:
    (version,) = crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def _pruned(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Fields the API server would drop: keys a structural schema does not declare."""
    if isinstance(value, dict) and schema.get("type") == "object":
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if properties is None:
            if isinstance(extra, dict):
                return [p for k, v in value.items() for p in _pruned(extra, v, f"{path}.{k}")]
            return []  # an open object (metadata)
        problems = [f"{path}.{k}: not in the schema" for k in value if k not in properties]
        for key, sub in properties.items():
            if key in value:
                problems += _pruned(sub, value[key], f"{path}.{key}")
        return problems
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [p for i, v in enumerate(value) for p in _pruned(schema["items"], v, f"{path}[{i}]")]
    return []


def _cel_rules(pool: dict[str, Any]) -> list[str]:
    spec = pool.get("spec", {})
    problems = []
    numbers = [p.get("number") for p in spec.get("targetPorts", [])]
    if len(set(numbers)) != len(numbers):
        problems.append("spec.targetPorts: port number must be unique")
    ref = spec.get("endpointPickerRef", {})
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        problems.append("spec.endpointPickerRef: port is required when kind is 'Service'")
    return problems


def violations(pool: dict[str, Any]) -> list[str]:
    """Every reason the API server would refuse or change ``pool``; [] when it takes it."""
    root = schema()
    validator = jsonschema.Draft202012Validator(root)
    problems = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(pool)
    ]
    return problems + _pruned(root, pool, "") + _cel_rules(pool)
