"""The building blocks of the CRD's OpenAPI schema, and the schema of each declared setting.

A stage setting's field (``spec.engine.maxNumSeqs``) is not written here or in :mod:`definition`:
its type, enum and default come from the setting's declaration in `tokenline.settings`, its
description and bounds from the declaration's `CrdField`; `setting_fields` builds them all.
"""

from __future__ import annotations

from typing import Any

from tokenline.settings import SETTINGS, Setting, parse_bool, parse_bytes

Schema = dict[str, Any]

# Kubernetes' own quantity pattern (as controller-gen writes resource.Quantity).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
#: Byte sizes the scheduler's --kv-cache-memory accepts: 8GiB, 512MiB, 8000000000.
BYTES_PATTERN = r"^[0-9]+(\.[0-9]+)?([KMGT]i?B?)?$"
#: Prometheus durations: 15s, 1m, 1m30s.
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def string(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def integer(description: str, **extra: Any) -> Schema:
    return {"type": "integer", "description": description, **extra}


def boolean(description: str, **extra: Any) -> Schema:
    return {"type": "boolean", "description": description, **extra}


def string_map(description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {"type": "string"},
    }


def quantity(description: str = "A Kubernetes quantity, e.g. 500m, 2, 4Gi.") -> Schema:
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": True,
    }


def int_or_string(description: str, **extra: Any) -> Schema:
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        **extra,
    }


def resources(description: str, requests: dict[str, str]) -> Schema:
    quantities = {"type": "object", "additionalProperties": quantity()}
    return {
        "type": "object",
        "description": description,
        "default": {"requests": dict(requests)},
        "properties": {
            "requests": {**quantities, "description": "Minimum resources the stage needs."},
            "limits": {**quantities, "description": "Maximum resources the stage may use."},
        },
    }


def secret_reference(description: str, key_default: str | None = None) -> Schema:
    """A Secret by name and, with ``key_default``, the key inside it that holds the value."""
    properties = {"name": string("The Secret's name.", minLength=1)}
    if key_default is not None:
        properties["key"] = string("The key inside the Secret.", default=key_default, minLength=1)
    return {
        "type": "object",
        "description": description,
        "required": ["name"],
        "properties": properties,
    }


# --- the declared settings ---------------------------------------------------------------

#: A setting's OpenAPI type, from the parser that reads its flag.
_KIND_SCHEMAS: dict[Any, Schema] = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    parse_bool: {"type": "boolean"},
    parse_bytes: {"type": "string", "pattern": BYTES_PATTERN},
}


def _kind_schema(kind: Any) -> Schema:
    """A parser's type; text of a form of its own (a ``str`` subclass that checks itself, like
    --speculative-config's JSON) is a string, its form checked by the field's pattern."""
    if kind not in _KIND_SCHEMAS and isinstance(kind, type) and issubclass(kind, str):
        return {"type": "string"}
    return _KIND_SCHEMAS[kind]


def setting_schema(setting: Setting) -> Schema:
    """The CRD field of one setting: its type, description, enum and default (the flag's, in
    the field's type; negated for an inverted switch; none where the declaration's schema says
    ``"default": None``), then the declaration's own keywords."""
    declared = setting.crd
    assert declared is not None, setting.flag
    extra = dict(declared.schema)
    kind = {"type": "array"} if setting.repeatable else dict(_kind_schema(setting.kind))
    schema: Schema = {"type": extra.pop("type", kind.pop("type")), "description": declared.help}
    enum = extra.pop("enum", list(setting.choices) if setting.choices else None)
    if enum:
        schema["enum"] = enum
    default = setting.default
    if declared.inverted:
        default = not default
    if "default" in extra and extra.pop("default") is None:
        default = None  # the operator derives the value from other fields (see pods/config.py)
    if default is not None and not declared.required and not setting.repeatable:
        schema["default"] = int(default) if schema["type"] == "integer" else default
    return {**schema, **kind, **extra}


def _declared(section: str) -> list[Setting]:
    return [s for s in SETTINGS if s.crd is not None and s.crd.section == section]


def setting_fields(section: str) -> dict[str, Schema]:
    """The fields of ``spec.<section>`` that set a stage setting, in declaration order."""
    return {s.crd.name: setting_schema(s) for s in _declared(section)}  # type: ignore[union-attr]


def required_settings(section: str) -> list[str]:
    """The fields of ``spec.<section>`` that must be set (no flag default applies), but for
    those with an alternative (see `alternative_rules`)."""
    return [
        s.crd.name  # type: ignore[union-attr]
        for s in _declared(section)
        if s.crd.required and not s.crd.alternative  # type: ignore[union-attr]
    ]


def alternatives(section: str) -> list[tuple[str, str]]:
    """(field, alternative) pairs of ``spec.<section>``: exactly one of each pair is set."""
    return [
        (s.crd.name, s.crd.alternative)  # type: ignore[union-attr]
        for s in _declared(section)
        if s.crd.required and s.crd.alternative  # type: ignore[union-attr]
    ]


def alternative_rules(section: str) -> list[Schema]:
    """The CEL rules that make exactly one field of each pair of `alternatives` required."""
    return [
        {
            "rule": f"has(self.{a}) != has(self.{b})",
            "message": f"set exactly one of {a} and {b}",
        }
        for a, b in alternatives(section)
    ]
