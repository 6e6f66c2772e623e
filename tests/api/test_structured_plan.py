"""What response_format and the tool fields make of a request, checked without a stack."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest

from tokenline.api.function_calling import grammars as structured
from tokenline.api.function_calling.formats import HERMES, LLAMA3_JSON
from tokenline.api.http.errors import ApiError
from tokenline.api.openai.tools import NamedToolChoice, ResponseFormat, Tool

TOOL = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    }
)
ANSWER = ResponseFormat.model_validate(
    {
        "type": "json_schema",
        "json_schema": {
            "name": "a",
            "schema": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
        },
    }
)
CALL = '<tool_call>\n{"name": "pick", "arguments": {"n": 3}}\n</tool_call>'
LLAMA3_CALL = '{"name": "pick", "parameters": {"n": 3}}'


def _accepts(grammar: str, text: str, tiny_tokenizer) -> bool:
    tokenizer = llguidance.hf.from_tokenizer(tiny_tokenizer)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


OTHER_CALL = '<tool_call>\n{"name": "other", "arguments": {"n": 3}}\n</tool_call>'


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_auto_is_free_text_whose_calls_are_declared_and_valid(tiny_tokenizer, fmt):
    plan = structured.plan_tools([TOOL], None, True, None, fmt)
    assert plan.parser is fmt and plan.tools
    call = fmt.call_head + "pick" + fmt.call_middle + '{"n": 3}' + fmt.call_tail
    for text in ("", "hello there", "Let me look. " * 3, "a <tool_ half tag", call):
        assert _accepts(plan.grammar, text, tiny_tokenizer), text
    undeclared = call.replace("pick", "other")
    bad_arguments = call.replace("3", "12")
    extra_key = call.replace('{"n": 3}', '{"n": 3, "m": 1}')
    for text in (undeclared, bad_arguments, extra_key):
        assert not _accepts(plan.grammar, text, tiny_tokenizer), text
        if fmt.trigger is not None:  # Llama 3's calls are whole replies: after text, text
            assert not _accepts(plan.grammar, "Sure. " + text, tiny_tokenizer), text


def test_auto_hermes_calls_follow_text_and_parallel_ones_follow_each_other(tiny_tokenizer):
    parallel = structured.plan_tools([TOOL], "auto", True, None, HERMES)
    single = structured.plan_tools([TOOL], "auto", False, None, HERMES)
    for plan in (parallel, single):
        assert _accepts(plan.grammar, "Let me look.\n" + CALL, tiny_tokenizer)
        assert not _accepts(plan.grammar, "Let me look.\n" + OTHER_CALL, tiny_tokenizer)
    assert _accepts(parallel.grammar, CALL + "\n" + CALL, tiny_tokenizer)
    assert not _accepts(single.grammar, CALL + "\n" + CALL, tiny_tokenizer)


def test_auto_with_a_format_allows_a_call_or_the_answer(tiny_tokenizer):
    plan = structured.plan_tools([TOOL], "auto", False, ANSWER, HERMES)
    assert _accepts(plan.grammar, CALL, tiny_tokenizer)
    assert _accepts(plan.grammar, '{"ok": true}', tiny_tokenizer)
    assert not _accepts(plan.grammar, "hello", tiny_tokenizer)


def test_required_allows_only_calls_whose_arguments_validate(tiny_tokenizer):
    plan = structured.plan_tools([TOOL], "required", False, None, HERMES)
    assert _accepts(plan.grammar, CALL, tiny_tokenizer)
    assert not _accepts(plan.grammar, CALL.replace("3", "12"), tiny_tokenizer)
    assert not _accepts(plan.grammar, CALL + "\n" + CALL, tiny_tokenizer)  # not parallel
    parallel = structured.plan_tools([TOOL], "required", True, None, HERMES)
    assert _accepts(parallel.grammar, CALL + "\n" + CALL, tiny_tokenizer)


@pytest.mark.parametrize("fmt, call", [(HERMES, CALL), (LLAMA3_JSON, LLAMA3_CALL)])
def test_a_named_tool_choice_is_exactly_one_call_even_when_parallel(tiny_tokenizer, fmt, call):
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "pick"}})
    plan = structured.plan_tools([TOOL], named, True, None, fmt)
    assert _accepts(plan.grammar, call, tiny_tokenizer)
    assert not _accepts(plan.grammar, call + fmt.separator + call, tiny_tokenizer)


def test_json_whitespace_is_fixed_so_output_cannot_run_on_in_spaces(tiny_tokenizer):
    grammar = structured.completion_grammar(ResponseFormat(type="json_object"))
    assert _accepts(grammar, '{"a": [1, 2]}', tiny_tokenizer)
    assert not _accepts(grammar, '{"a":  [1, 2]}', tiny_tokenizer)
    assert not _accepts(grammar, '{\n"a": 1}', tiny_tokenizer)


def test_none_hides_the_tools_and_keeps_the_format():
    plan = structured.plan_tools([TOOL], "none", True, ANSWER, HERMES)
    assert plan.tools is None and plan.parser is None and plan.grammar is not None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_a_forced_call_beside_a_json_answer_is_the_call(tiny_tokenizer, choice):
    tool_choice = NamedToolChoice.model_validate(choice) if choice != "required" else choice
    plan = structured.plan_tools([TOOL], tool_choice, True, ANSWER, HERMES)
    assert _accepts(plan.grammar, CALL, tiny_tokenizer)
    assert not _accepts(plan.grammar, '{"ok": true}', tiny_tokenizer)


def test_a_format_beside_a_forced_call_is_still_checked():
    broken = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}
    )
    with pytest.raises(ApiError) as caught:
        structured.plan_tools([TOOL], "required", True, broken, HERMES)
    assert caught.value.param == "response_format.json_schema.schema"


# ── schemas silent on additionalProperties are closed ─────────────────────────────────────────
OPEN = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "items": {"type": "array", "items": {"properties": {"y": {"type": "integer"}}}},
        "maybe": {"anyOf": [{"$ref": "#/$defs/Thing"}, {"type": "null"}]},
    },
    "$defs": {"Thing": {"type": "object", "properties": {"z": {"type": "integer"}}}},
}


def test_closed_adds_no_additional_properties_to_every_object_that_declares_properties():
    closed = structured.closed(OPEN)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["items"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["Thing"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["name"]  # not an object
    assert OPEN.get("additionalProperties") is None  # the client's schema is left as it came


@pytest.mark.parametrize(
    "schema",
    [
        {"properties": {"a": {}}, "additionalProperties": True},
        {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
        {"properties": {"a": {}}, "patternProperties": {"^x": {}}},
        {"properties": {"a": {}}, "unevaluatedProperties": {"type": "integer"}},
        {"type": "object"},  # json_object: any object
        {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        {"not": {"properties": {"a": {}}}},
    ],
)
def test_closed_keeps_what_a_schema_says_of_other_keys(schema):
    assert structured.closed(schema) == schema


def test_a_silent_schema_refuses_undeclared_keys_and_an_open_one_takes_them(tiny_tokenizer):
    def grammar(schema):
        return structured.json_grammar(schema)

    silent = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert _accepts(grammar(silent), '{"a": 1}', tiny_tokenizer)
    assert not _accepts(grammar(silent), '{"a": 1, "b": 2}', tiny_tokenizer)
    nested = {"type": "object", "properties": {"o": silent}, "required": ["o"]}
    assert not _accepts(grammar(nested), '{"o": {"a": 1, "b": 2}}', tiny_tokenizer)
    opened = {**silent, "additionalProperties": True}
    assert _accepts(grammar(opened), '{"a": 1, "b": 2}', tiny_tokenizer)


def test_schema_checks_are_cached_within_a_byte_bound_and_counted():
    from prometheus_client import REGISTRY, generate_latest

    cache = structured._schema_problem.cache
    small = {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}
    structured.check_schema(small, "p")
    held = len(cache)
    structured.check_schema(small, "p")
    assert len(cache) == held  # a hit
    huge = {"type": "object", "description": "x" * (3 * 2**20)}  # over a quarter of 8 MiB
    structured.check_schema(huge, "p")
    assert len(cache) == held, "a schema that large is checked each time, never kept"
    exposition = generate_latest(REGISTRY).decode()
    assert f'tokenline_cache_entries{{cache="schema_checks",stage="api"}} {held}.0' in exposition
