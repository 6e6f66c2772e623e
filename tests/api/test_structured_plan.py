"""What response_format and the tool fields make of a request, checked without a stack."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest

from tokenline.api import structured
from tokenline.api.errors import ApiError
from tokenline.api.structured import ResponseFormat, Tool
from tokenline.api.tool_parsers import HERMES

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


def _accepts(grammar: str, text: str, tiny_tokenizer) -> bool:
    tokenizer = llguidance.hf.from_tokenizer(tiny_tokenizer)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_auto_without_a_format_is_free_text_parsed_afterwards():
    plan = structured.plan_tools([TOOL], None, True, None, HERMES)
    assert plan.grammar is None and plan.parser is HERMES and plan.tools


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


def test_json_whitespace_is_fixed_so_output_cannot_run_on_in_spaces(tiny_tokenizer):
    grammar = structured.completion_grammar(ResponseFormat(type="json_object"))
    assert _accepts(grammar, '{"a": [1, 2]}', tiny_tokenizer)
    assert not _accepts(grammar, '{"a":  [1, 2]}', tiny_tokenizer)
    assert not _accepts(grammar, '{\n"a": 1}', tiny_tokenizer)


def test_none_hides_the_tools_and_keeps_the_format():
    plan = structured.plan_tools([TOOL], "none", True, ANSWER, HERMES)
    assert plan.tools is None and plan.parser is None and plan.grammar is not None


def test_a_required_call_and_a_json_answer_cannot_both_hold():
    with pytest.raises(ApiError) as caught:
        structured.plan_tools([TOOL], "required", True, ANSWER, HERMES)
    assert caught.value.param == "response_format"
