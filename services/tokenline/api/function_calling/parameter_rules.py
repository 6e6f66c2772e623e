"""Lark rules for arguments that are not one JSON object: Python keyword arguments (the
pythonic format) and Qwen3-Coder's ``<parameter=...>`` elements, built per parameter from the
function's JSON schema.

Each parameter's value keeps what its schema says where the format can say it: a JSON value
is a Python literal too, once booleans and null are spelled True, False and None, so those
are the only values built here; the rest are llguidance's JSON rules. A schema the format
cannot hold (references, or a string constraint raw XML text cannot carry) is refused with
a 400 naming the parameter, never served unconstrained.

Parameters come in the order the schema lists them; optional ones may be left out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tokenline.api.http.errors import invalid

JsonRule = Callable[[dict[str, Any]], str]  # a schema's llguidance %json rule
_SCALAR_TYPES = ("string", "integer", "number")
# any Python literal a JSON value can be, for parameters whose schema says nothing
_PY_ANY = [
    "py_any: py_string | py_number | py_word | py_list | py_dict",
    'py_string: %json{"type": "string"}',
    'py_number: %json{"type": "number"}',
    'py_word: "True" | "False" | "None"',
    'py_list: "[" (py_any (", " py_any)*)? "]"',
    'py_dict: "{" (py_string ": " py_any (", " py_string ": " py_any)*)? "}"',
]


class Unsupported(ValueError):
    """A parameter schema the format's grammar cannot hold."""


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _types(schema: dict[str, Any]) -> list[str]:
    found = schema.get("type")
    return found if isinstance(found, list) else [found] if isinstance(found, str) else []


def _python_literal(value: Any) -> str:
    if value is True or value is False or value is None:
        return {True: "True", False: "False", None: "None"}[value]
    if isinstance(value, str | int | float):
        return json.dumps(value, ensure_ascii=False)
    raise Unsupported(f"the value {value!r} has no Python literal here")


def _json_is_python(schema: Any) -> bool:
    """Whether every JSON value the schema admits is written the same as a Python literal:
    strings and numbers, and lists and closed objects of them."""
    if not isinstance(schema, dict) or "$ref" in schema:
        return False
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in values)
    types = _types(schema)
    if not types:
        return False
    for kind in types:
        if kind == "array":
            if not _json_is_python(schema.get("items")):
                return False
        elif kind == "object":
            properties = schema.get("properties") or {}
            if schema.get("additionalProperties", False) is not False:
                return False
            if not all(_json_is_python(p) for p in properties.values()):
                return False
        elif kind not in _SCALAR_TYPES:
            return False
    return True


def _python_value(schema: Any, json_rule: JsonRule) -> str:
    """A Lark expression for one parameter's value as a Python literal."""
    if not isinstance(schema, dict) or schema in ({}, {"type": []}) or schema is True:
        return "py_any"
    if "$ref" in schema:
        raise Unsupported("it refers to another schema ($ref)")
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return "(" + " | ".join(_lark(_python_literal(v)) for v in values) + ")"
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return "(" + " | ".join(_python_value(s, json_rule) for s in schema[key]) + ")"
    types = _types(schema)
    if not types:
        if any(k in schema for k in ("properties", "items", "allOf", "not")):
            raise Unsupported("it constrains a value without naming its type")
        return "py_any"
    choices = []
    for kind in types:
        if kind == "boolean":
            choices.append('"True" | "False"')
        elif kind == "null":
            choices.append('"None"')
        else:
            narrowed = {**schema, "type": kind}
            if not _json_is_python(narrowed):
                raise Unsupported(
                    f"its {kind} values may hold true, false or null, which Python spells "
                    "differently"
                )
            choices.append(json_rule(narrowed))
    return "(" + " | ".join(choices) + ")"


def _object_parts(schema: dict[str, Any]) -> tuple[dict[str, Any], set[str], bool]:
    """The declared parameters, the required ones, and whether others are allowed."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    undeclared = required - set(properties)
    if undeclared:
        raise Unsupported(f"it requires {sorted(undeclared)} without declaring them")
    is_open = not properties and schema.get("additionalProperties", True) is not False
    return properties, required, is_open


def python_arguments(index: int, schema: dict[str, Any], json_rule: JsonRule) -> list[str]:
    """Rules whose ``arguments_{index}`` is the keyword arguments ``schema`` admits."""
    properties, required, is_open = _object_parts(schema)
    name = f"arguments_{index}"
    if is_open:  # any keyword arguments, as the schema allows any object
        pair = '/[A-Za-z_][A-Za-z0-9_]*/ "=" py_any'
        return [f'{name}: "" | {pair} (", " {pair})*', *_PY_ANY]
    rules = []
    for k, (key, sub) in enumerate(properties.items()):
        rules.append(f"{name}_v{k}: {_lark(key + '=')} {_python_value(sub, json_rule)}")
    # {name}_f{k}: the arguments from parameter k on, the first of them; _r{k}: after another
    count = len(properties)
    for k, key in enumerate(properties):
        nxt_first = f"{name}_f{k + 1}" if k + 1 < count else '""'
        nxt_rest = f"{name}_r{k + 1}" if k + 1 < count else '""'
        first = f"{name}_v{k} {nxt_rest}"
        rest = f'", " {name}_v{k} {nxt_rest}'
        if key not in required:
            first += f" | {nxt_first}"
            rest += f" | {nxt_rest}"
        rules += [f"{name}_f{k}: {first}", f"{name}_r{k}: {rest}"]
    rules.append(f"{name}: {name}_f0" if count else f'{name}: ""')
    return [*rules, *_PY_ANY]


_END = "\n</parameter>\n"
_STRING_LIMITS = ("pattern", "format", "minLength", "maxLength")


def _xml_value(schema: Any, json_rule: JsonRule, rule: str) -> list[str]:
    """Rules whose ``rule`` is one parameter's value and the element's closing tag."""
    if not isinstance(schema, dict) or "$ref" in schema:
        if isinstance(schema, dict):
            raise Unsupported("it refers to another schema ($ref)")
        return [f"{rule}[lazy]: /(.|\\n)*/ {_lark(_END)}"]
    types = set(_types(schema))
    strings = [v for v in schema.get("enum", []) if isinstance(v, str)]
    if "enum" in schema and len(strings) == len(schema["enum"]):
        return [f"{rule}: (" + " | ".join(_lark(v + _END) for v in strings) + ")"]
    if "string" in types or not types:
        limits = [k for k in _STRING_LIMITS if k in schema]
        if limits:
            raise Unsupported(f"raw XML text cannot be held to {', '.join(limits)}")
        if not types and any(k in schema for k in ("properties", "items", "anyOf", "oneOf")):
            raise Unsupported("it constrains a value without naming its type")
        return [f"{rule}[lazy]: /(.|\\n)*/ {_lark(_END)}"]
    return [f"{rule}: {json_rule(schema)} {_lark(_END)}"]


def xml_arguments(index: int, schema: dict[str, Any], json_rule: JsonRule) -> list[str]:
    """Rules whose ``arguments_{index}`` is the ``<parameter=...>`` elements of a call."""
    properties, required, is_open = _object_parts(schema)
    name = f"arguments_{index}"
    if is_open:
        head = f'"<parameter=" /[A-Za-z_][A-Za-z0-9_.-]*/ ">\\n" {name}_any'
        return [f"{name}: ({head})*", f"{name}_any[lazy]: /(.|\\n)*/ {_lark(_END)}"]
    rules, parts = [], []
    for k, (key, sub) in enumerate(properties.items()):
        value = f"{name}_v{k}"
        rules += _xml_value(sub, json_rule, value)
        element = f"{_lark('<parameter=' + key + '>' + chr(10))} {value}"
        parts.append(element if key in required else f"({element})?")
    rules.append(f"{name}: {' '.join(parts)}" if parts else f'{name}: ""')
    return rules


def arguments_rules(
    style: str, index: int, schema: dict[str, Any], json_rule: JsonRule, param: str
) -> list[str]:
    """The rules of one function's arguments in a format's ``style``; a 400 naming ``param``
    when its schema cannot be held in that style."""
    if style == "json":
        return [f"arguments_{index}: {json_rule(schema)}"]
    build = python_arguments if style == "python" else xml_arguments
    try:
        return build(index, schema, json_rule)
    except Unsupported as exc:
        raise invalid(
            param,
            f"{param} cannot be constrained in the model's {style} tool-call format: {exc}; "
            "simplify the schema, or serve with another --tool-call-parser",
        ) from exc
