"""Tool-call markers the model might spell where the grammar did not expect a call: Mistral's
special ``[TOOL_CALLS]`` written in text tokens in auto's free text, and a call written inside a
string of a JSON answer (tools in auto beside a JSON response_format). Either would have made
a call the grammar never held to its function's schema; both tests fail without the fix."""

from __future__ import annotations

import json
import random

import llguidance
import llguidance.hf
import pytest
from tool_format_testkit import TOOLS, with_special_marker

from tokenline.api.function_calling import grammars
from tokenline.api.function_calling.formats import DEEPSEEK_V3, MISTRAL
from tokenline.api.function_calling.list_streams import MISTRAL_TRIGGER
from tokenline.api.function_calling.parsers import Content, Parsed, ParsedCall
from tokenline.api.openai.tools import ResponseFormat, Tool
from tokenline.scheduler.grammar import grammar_tokenizer

DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"


def _tools(*tools) -> list[Tool]:
    return [Tool.model_validate(t) for t in tools]


def _streamed(fmt, text: str, rng: random.Random):
    stream = fmt.stream()
    deltas, position = [], 0
    while position < len(text):
        size = rng.randint(1, 6)
        deltas += stream.feed(text[position : position + size])
        position += size
    return deltas + stream.finish()


@pytest.fixture(scope="module")
def special_marker(tiny_tokenizer):
    return with_special_marker(tiny_tokenizer)


def test_auto_free_text_never_spells_a_special_marker_out(special_marker):
    """Spelled in text tokens, ``[TOOL_CALLS]`` decodes as the token does, and the parser
    would read the unchecked call after it: in auto the grammar's free text never holds it,
    so only the special token opens a call, and the call after it is checked."""
    tokenizer, marker = special_marker
    fmt = MISTRAL.for_vocabulary({MISTRAL_TRIGGER: marker})
    env = grammar_tokenizer(tokenizer)
    auto = grammars.plan_tools(_tools(*TOOLS), "auto", True, None, fmt)

    def accepts(text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert marker not in ids  # the marker in text tokens only
        matcher = llguidance.LLMatcher(env, auto.grammar, log_level=0)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    unchecked = '[TOOL_CALLS][{"name": "rm_rf", "arguments": {"path": "/"}}]'
    assert fmt.parse(unchecked).calls  # what the parser would have made of it
    assert accepts("Hello [TOOL CALLS] and [TOOL_CALL]")
    assert not accepts(unchecked)
    assert not accepts("First some text. " + unchecked)
    assert not accepts("[TOOL_CALLS]")


NOTE = {
    "type": "json_schema",
    "json_schema": {
        "name": "note",
        "schema": {
            "type": "object",
            "properties": {"note": {"type": "string"}},
            "required": ["note"],
        },
    },
}
# a call written without quotes, which a JSON string can hold as it is
UNQUOTED = {
    "mistral": "[TOOL_CALLS]get_time{}",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time"
    "```{}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}


@pytest.mark.parametrize("fmt", [MISTRAL, DEEPSEEK_V3], ids=["mistral", "deepseek_v3"])
def test_a_call_spelled_inside_a_json_answer_is_the_answer_s_text(fmt, tiny_tokenizer):
    """Tools in auto beside a JSON response_format: the grammar allows calls or the answer,
    and a string of the answer may spell a call out; it stays the answer, never a call the
    grammar did not check (get_time without its required zone)."""
    answer = json.dumps({"note": UNQUOTED[fmt.name]}, ensure_ascii=False)
    assert fmt.parse(answer).calls  # what the format's parser alone makes of it
    plan = grammars.plan_tools(
        _tools(*TOOLS), "auto", True, ResponseFormat.model_validate(NOTE), fmt
    )
    env = llguidance.hf.from_tokenizer(tiny_tokenizer)
    matcher = llguidance.LLMatcher(env, plan.grammar, log_level=0)
    assert matcher.consume_tokens(env.tokenize_str(answer)) and matcher.is_accepting()
    assert plan.parser.parse(answer) == Parsed(answer, [])
    for seed in range(5):
        deltas = _streamed(plan.parser, answer, random.Random(seed))
        assert deltas and all(isinstance(d, Content) for d in deltas)
        assert "".join(d.text for d in deltas) == answer
    call = {
        "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        "deepseek_v3": "<｜tool▁calls▁begin｜>"
        + DS_CALL.format("get_time", '{"zone": "UTC"}')
        + "<｜tool▁calls▁end｜>",
    }[fmt.name]
    assert plan.parser.parse(call).calls == [ParsedCall("get_time", '{"zone": "UTC"}')]
