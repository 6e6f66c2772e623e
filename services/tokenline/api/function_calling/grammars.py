"""Structured outputs and tool calls: the request fields, and the grammar they constrain to.

The grammar library is llguidance rather than xgrammar: it needs no tokenizer to check a
grammar (the api validates every schema before anything is queued, without loading one), its
Lark grammars embed JSON schemas (``%json{...}``), which a tool call written in a model's own
markup needs, and it builds a matcher lazily, so a large schema costs little before its first
token. The scheduler builds the matcher from the grammar string made here.

Which fields hold together:

- ``response_format`` alone: the output is the JSON document (any object for ``json_object``).
- ``tools`` with ``tool_choice`` ``auto`` (the default): free text, parsed for calls afterwards;
  with a JSON ``response_format`` too, the output is either calls or the JSON document.
- ``tool_choice`` ``auto`` without a format: free text, and any call the model starts (its
  format's trigger, ``<tool_call>`` for Hermes) is held to a declared function and its schema.
- ``tool_choice`` ``required`` or a named function: the output is calls in the model's format.
  A JSON ``response_format`` is accepted beside it (agents send both: an output type, and a
  forced call for this turn) and shapes the turns that answer in text (``auto`` or ``none``).
- ``tool_choice`` ``none``: the tools are not shown to the model; ``response_format`` holds.

Schemas are closed where they are silent: an object schema that declares ``properties`` and
says nothing of ``additionalProperties`` admits only the declared keys, as OpenAI's strict
mode and vLLM's guided decoding do. Otherwise a model may add keys without bound until
max_tokens cuts the document. A schema that allows more (``additionalProperties: true`` or a
schema for them, ``patternProperties``, ``unevaluatedProperties``) keeps what it says.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

import jsonschema
import llguidance

from tokenline.api.function_calling.formats import ToolCallFormat
from tokenline.api.function_calling.parameter_rules import arguments_rules
from tokenline.api.http.errors import invalid
from tokenline.api.openai.tools import NamedToolChoice, ResponseFormat, Tool, ToolChoice
from tokenline.bounded import cached_by_text
from tokenline.metrics import track_cache

# Whitespace is fixed, not free: with flexible whitespace a model can emit spaces and newlines
# between tokens forever without breaking the grammar. These are json.dumps' separators, and
# the ones chat templates write tool-call arguments with (tojson).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what OpenAI allows
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


# ── grammars ───────────────────────────────────────────────────────────────────────────────────
# Keywords that hold subschemas, by how they hold them
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
# not ``not`` or ``if``: closing what they hold would widen what the whole admits
_SUBSCHEMA_ONE = ("items", "additionalItems", "then", "else", "contains")
_OPENING_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: Any, *, in_all_of: bool = False) -> Any:
    """The schema with every object that declares ``properties`` and no rule for other keys
    closed to them (``additionalProperties: false``).

    The branches of an ``allOf`` are left open: closing each would refuse the keys that the
    others declare, and their intersection would admit nothing.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _SUBSCHEMA_ONE:
        if key in out:
            out[key] = (
                [closed(sub) for sub in out[key]]
                if isinstance(out[key], list)
                else closed(out[key])
            )
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(sub, in_all_of=True) for sub in out["allOf"]]
    silent = not any(key in out for key in _OPENING_KEYWORDS)
    if "properties" in out and silent and not in_all_of and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _with_options(schema: dict[str, Any]) -> dict[str, Any]:
    # the client's own x-guidance, if any, is replaced: whitespace stays bounded
    return {**closed(schema), "x-guidance": JSON_OPTIONS}


# Keyed by text a client chose, so bounded in bytes as well as entries (a body may be 8 MiB)
@cached_by_text(max_entries=1024, max_bytes=8 * 2**20)
def _problem(grammar: str) -> str | None:
    """What llguidance finds wrong with a grammar, or None; cached by the grammar's text."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(messages) or "invalid" if is_error else None


@cached_by_text(max_entries=1024, max_bytes=8 * 2**20)
def _schema_problem(schema_text: str) -> str | None:
    schema = json.loads(schema_text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"it is not a valid JSON Schema ({exc.message}{' at ' + where if where else ''})"
    grammar = llguidance.LLMatcher.grammar_from_json_schema(_with_options(schema))
    problem = _problem(grammar)
    if problem is not None:
        return f"constrained decoding cannot enforce it: {problem}"
    return None


track_cache("api", "grammar_checks", _problem.cache)
track_cache("api", "schema_checks", _schema_problem.cache)


def check_schema(schema: dict[str, Any], param: str) -> str:
    """The schema as JSON text, once both JSON Schema and llguidance accept it."""
    try:
        text = json.dumps(schema, sort_keys=True)
        problem = _schema_problem(text)
    except RecursionError:
        problem = "it nests too deeply to check"
    except ValueError as exc:  # llguidance's refusal of a value it cannot read
        problem = f"constrained decoding cannot read it: {exc}"
    if problem is not None:
        raise invalid(param, f"{param} is refused: {problem}; fix or simplify the schema")
    return text


def json_grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(_with_options(schema))


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json" + json.dumps(_with_options(schema), ensure_ascii=False)


def response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The schema a JSON ``response_format`` asks for (validated), or None for text."""
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        raise invalid(
            "response_format.json_schema",
            f"a response_format of type {fmt.type} takes no json_schema; set type to "
            "json_schema to constrain the output to it, or leave json_schema out",
        )
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None:
        raise invalid(
            "response_format.json_schema",
            'response_format of type json_schema needs a json_schema: {"name": ..., "schema": ...}',
        )
    schema = fmt.json_schema.schema_ or {"type": "object"}
    check_schema(schema, "response_format.json_schema.schema")
    return schema


# ── tools ──────────────────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class ToolPlan:
    """What the tools of a request mean for its sampling and its reply."""

    tools: list[dict[str, Any]] | None  # for the chat template; None: not shown to the model
    grammar: str | None  # the output's constraint; None: free text
    parser: ToolCallFormat | None  # the format the reply is parsed for calls in; None: not


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS


def check_tools(tools: list[Tool]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not name:
            raise invalid(f"tools[{i}].function.name", f"tools[{i}] has no function name")
        if not FUNCTION_NAME.fullmatch(name):
            raise invalid(
                f"tools[{i}].function.name",
                f"tools[{i}]'s name {name!r} is not allowed: use letters, digits, _ and -, "
                "at most 64",
            )
        if name in seen:
            raise invalid(
                f"tools[{i}].function.name",
                f"two tools are named {name!r}; give each function its own name",
            )
        seen.add(name)
        parameters = _parameters(tool)
        if parameters.get("type", "object") != "object":
            raise invalid(
                f"tools[{i}].function.parameters",
                f"tools[{i}]'s parameters must be a JSON Schema of type object",
            )
        check_schema(parameters, f"tools[{i}].function.parameters")


def shown_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools, checked, as the chat template shows them to the model."""
    check_tools(tools)
    return [_template_tool(t) for t in tools]


def _template_tool(tool: Tool) -> dict[str, Any]:
    """As vLLM hands a tool to the template, keys in OpenAI's order (name, description,
    parameters): a template that writes ``tool | tojson`` shows them so, as models were
    trained on them."""
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = _parameters(tool)
    if tool.function.strict is not None:
        function["strict"] = tool.function.strict
    return {"type": "function", "function": function}


def plan_tools(
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel: bool,
    response_format: ResponseFormat | None,
    fmt: ToolCallFormat,
) -> ToolPlan:
    """Check the tool fields together with ``response_format``; raise a 400 naming the param."""
    schema = response_schema(response_format)
    answer = json_grammar(schema) if schema is not None else None
    tools = tools or []
    check_tools(tools)
    choice = tool_choice if tool_choice is not None else "auto"
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            known = ", ".join(t.function.name or "" for t in tools) or "none"
            raise invalid(
                "tool_choice",
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"the tools (defined: {known})",
            )
    elif choice == "required":
        if not tools:
            raise invalid("tool_choice", "tool_choice is required, but no tools are defined")
        chosen = tools
    else:
        chosen = []
    if not tools or choice == "none":
        return ToolPlan(None, answer, None)
    shown = [_template_tool(t) for t in tools]
    fmt = fmt.bound({t.function.name or "": _parameters(t) for t in tools})
    if chosen:  # a call is forced: no text comes out this turn for a format to shape
        # A named function is called exactly once, as OpenAI and vLLM do, parallel or not.
        several = parallel and not isinstance(choice, NamedToolChoice)
        return ToolPlan(shown, _checked_lark(_calls_lark(chosen, fmt, several)), fmt)
    if schema is None:  # auto: free text, in which any call is one of the declared
        return ToolPlan(shown, _checked_lark(_text_or_calls_lark(tools, fmt, parallel)), fmt)
    lark = _calls_lark(tools, fmt, parallel, answer=schema)  # auto: calls or the JSON answer
    return ToolPlan(shown, _checked_lark(lark), replace(fmt, calls_first=True))


def refuse_deprecated(functions: object, function_call: object) -> None:
    """OpenAI's ``functions`` and ``function_call`` were replaced by ``tools``/``tool_choice``."""
    for param, value in (("functions", functions), ("function_call", function_call)):
        if value is not None:
            raise invalid(
                param,
                f"{param} is deprecated and not supported; send tools (and tool_choice) instead",
                "unsupported_parameter",
            )


def completion_grammar(response_format: ResponseFormat | None) -> str | None:
    schema = response_schema(response_format)
    return json_grammar(schema) if schema is not None else None


def _arguments_rules(
    tools: list[Tool], fmt: ToolCallFormat
) -> tuple[list[str], list[tuple[str, str]]]:
    """The Lark rules of each tool's arguments in the format's style (``arguments_i``), and
    (name, rule) pairs for the call rules."""
    rules: list[str] = []
    for i, tool in enumerate(tools):
        param = f"tools[{tool.function.name}].function.parameters"
        rules += arguments_rules(fmt.arguments, i, _parameters(tool), _json_rule, param)
    pairs = [(tool.function.name or "", f"arguments_{i}") for i, tool in enumerate(tools)]
    return list(dict.fromkeys(rules)), pairs  # shared helper rules once


def _text_or_calls_lark(tools: list[Tool], fmt: ToolCallFormat, parallel: bool) -> str:
    rules, pairs = _arguments_rules(tools, fmt)
    return "\n".join([*fmt.text_or_calls_rules(pairs, parallel), *rules])


def _calls_lark(
    tools: list[Tool], fmt: ToolCallFormat, parallel: bool, answer: dict | None = None
) -> str:
    rules, pairs = _arguments_rules(tools, fmt)
    rules.append(fmt.call_rules(pairs, parallel))
    if answer is None:
        start = "start: calls"
    else:
        rules.append(f"answer: {_json_rule(answer)}")
        start = "start: calls | answer"
    return "\n".join([start, *rules])


def _checked_lark(lark: str) -> str:
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    problem = _problem(grammar)
    if problem is not None:  # each schema passed alone, so this is ours, not the client's
        raise invalid("tools", f"the tools could not be combined into one grammar: {problem}")
    return grammar
