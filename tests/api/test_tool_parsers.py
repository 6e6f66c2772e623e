"""The tool-call parsers, driven directly: whole replies, streamed ones, and their grammars."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from tokenline import tiny_model
from tokenline.api.function_calling.formats import (
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    PARSER_CHOICES,
    format_for,
)
from tokenline.api.function_calling.parsers import (
    ArgumentsPiece,
    Call,
    CallEnd,
    CallStart,
    Content,
    ParsedCall,
)
from tokenline.settings import BY_FLAG

CALL_F = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
CALL_G = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'


def _streamed(fmt, text: str, size: int):
    stream = fmt.stream()
    deltas = []
    for i in range(0, len(text), size):
        deltas += stream.feed(text[i : i + size])
    deltas += stream.finish()
    content = "".join(d.text for d in deltas if isinstance(d, Content))
    return content, [d.call for d in deltas if isinstance(d, Call | CallEnd)], deltas


def test_hermes_finds_calls_and_the_text_before_them():
    parsed = HERMES.parse("Let me look.\n" + CALL_F + "\n" + CALL_G)
    assert parsed.content == "Let me look."
    assert parsed.calls == [ParsedCall("f", '{"x": 1}'), ParsedCall("g", "{}")]


def test_hermes_reply_of_only_calls_has_no_content():
    assert HERMES.parse(CALL_F).content is None


def test_hermes_leaves_text_without_calls_alone():
    for text in ("plain words", " leading space", "a <tool_ half tag"):
        parsed = HERMES.parse(text)
        assert (parsed.content, parsed.calls) == (text, [])


CUT = '<tool_call>\n{"name": "get_weather", "arguments": '


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CUT, "", []),  # max_tokens cut the call before its arguments began
        ("Let me check.\n" + CUT, "Let me check.", []),
        (CALL_F + '\n<tool_call>\n{"nam', None, [ParsedCall("f", '{"x": 1}')]),
        ("<tool_call>not json</tool_call>", "", []),  # markup holding no call
        ("a <tool_call>[1, 2]</tool_call> b", "a b", []),
        # cut inside the arguments: the call as far as it was written (finish_reason: length)
        (CUT + '{"city": "Os', None, [ParsedCall("get_weather", '{"city": "Os')]),
    ],
)
def test_hermes_never_shows_call_markup_as_content(text, content, calls):
    parsed = HERMES.parse(text)
    assert (parsed.content, parsed.calls) == (content, calls)
    for size in (1, 3, 7):
        streamed, streamed_calls, _ = _streamed(HERMES, text, size)
        assert (streamed or None, streamed_calls) == (content or None, calls), size


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ('{"name": "f", "parameters": {"x"', ""),  # a call cut off
        ('<|python_tag|>{"name": "f"', ""),
        ('{"na', ""),
        ('{"name": "f", "parameters": {}} trailing', ""),  # markup, though no call parses
        ('{"colour": "re', '{"colour": "re'),  # a JSON answer cut off is still the answer
        ('{"colour": "red"}', '{"colour": "red"}'),
    ],
)
def test_llama3_json_never_shows_call_markup_as_content(text, content):
    parsed = LLAMA3_JSON.parse(text)
    assert (parsed.content, parsed.calls) == (content, [])


def test_hermes_accepts_a_last_call_without_its_closing_tag_and_string_arguments():
    parsed = HERMES.parse('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 2}"}')
    assert parsed.calls == [ParsedCall("f", '{"x": 2}')]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streaming_in_any_pieces_gives_what_parsing_whole_gives(size):
    text = "Checking the weather.\n" + CALL_F + "\n" + CALL_G
    content, calls, deltas = _streamed(HERMES, text, size)
    whole = HERMES.parse(text)
    assert (content, calls) == (whole.content, whole.calls)
    # nothing of the markup reaches the content, piece by piece
    for delta in deltas:
        if isinstance(delta, Content):
            assert "<" not in delta.text
    assert [d.index for d in deltas if isinstance(d, Call | CallEnd)] == [0, 1]


def test_a_call_streams_its_name_then_its_arguments_in_pieces():
    arguments = '{"city": "Oslo \\"}</tool_call>{", "days": [1, {"n": 2}]}'
    text = f'<tool_call>\n{{"name": "weather", "arguments": {arguments}}}\n</tool_call> after'
    _, calls, deltas = _streamed(HERMES, text, 3)
    starts = [d for d in deltas if isinstance(d, CallStart)]
    pieces = [d.text for d in deltas if isinstance(d, ArgumentsPiece)]
    assert starts == [CallStart(0, "weather")]
    assert len(pieces) > 5 and "".join(pieces) == arguments  # markup inside strings included
    ended = next(i for i, d in enumerate(deltas) if isinstance(d, CallEnd))
    assert deltas.index(starts[0]) < ended
    assert calls == [ParsedCall("weather", arguments)] == HERMES.parse(text).calls
    assert json.loads(arguments)["days"][1] == {"n": 2}
    assert "".join(d.text for d in deltas if isinstance(d, Content)) == "after"


def test_a_streamed_call_cut_off_keeps_what_it_had():
    stream = HERMES.stream()
    deltas = stream.feed('<tool_call>\n{"name": "f", "arguments": {"x": [1, 2') + stream.finish()
    assert deltas[0] == CallStart(0, "f")
    assert deltas[-1] == CallEnd(0, ParsedCall("f", '{"x": [1, 2'))


def test_a_call_written_arguments_first_is_parsed_whole_when_it_closes():
    text = '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>'
    _, calls, deltas = _streamed(HERMES, text, 2)
    assert not any(isinstance(d, CallStart | ArgumentsPiece) for d in deltas)
    assert calls == [ParsedCall("f", '{"x": 1}')]


def test_streamed_content_is_sent_before_the_reply_ends():
    stream = HERMES.stream()
    assert stream.feed("Hello there, ") == [Content("Hello there,")]
    assert stream.feed("friend <tool") == [Content(" friend")]  # the tag's start is held


def test_llama3_json_calls_with_and_without_the_python_tag():
    for text in (
        '{"name": "f", "parameters": {"a": 2}}',
        '<|python_tag|>{"name": "f", "parameters": {"a": 2}}',
        ' {"name": "f", "arguments": {"a": 2}}',
    ):
        parsed = LLAMA3_JSON.parse(text)
        assert parsed.content is None and parsed.calls == [ParsedCall("f", '{"a": 2}')], text
    two = LLAMA3_JSON.parse('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}')
    assert [c.name for c in two.calls] == ["f", "g"]


def test_llama3_json_text_that_is_not_a_call_stays_content():
    for text in ("hi there", '{"answer": 1}'):
        assert LLAMA3_JSON.parse(text).content == text
    content, calls, deltas = _streamed(LLAMA3_JSON, "hi there", 2)
    assert (content, calls) == ("hi there", [])
    assert len(deltas) > 1  # streamed as it came, once it could not be a call


def test_the_format_is_read_from_the_chat_template():
    assert format_for(tiny_model.CHAT_TEMPLATE) is HERMES
    llama = '{{- \'<|python_tag|>\' }} Respond as {"name": function name, "parameters": ...}'
    assert format_for(llama) is LLAMA3_JSON
    assert format_for(None) is HERMES
    assert format_for(tiny_model.CHAT_TEMPLATE, "llama3_json") is LLAMA3_JSON


def test_the_flag_offers_exactly_the_formats():
    assert BY_FLAG["tool-call-parser"].choices == PARSER_CHOICES


JSON_FORMATS = [f for f in FORMATS.values() if f.arguments == "json"]


@pytest.mark.parametrize("fmt", JSON_FORMATS, ids=[f.name for f in JSON_FORMATS])
def test_a_call_the_grammar_allows_parses_back(fmt, tiny_tokenizer):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 5}},
        "required": ["city"],
        "additionalProperties": False,
    }
    rules = fmt.call_rules([("get_weather", "args")], parallel=True)
    lark = "start: calls\nargs: %json" + json.dumps(schema) + "\n" + rules
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    text = fmt.separator.join(
        f'{fmt.call_head}get_weather{fmt.call_middle}{{"city": "{c}"}}{fmt.call_tail}'
        for c in ("Oslo", "Rome")
    )
    text = fmt.calls_open + text + fmt.calls_close
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tiny_tokenizer), grammar)
    tokenizer = llguidance.hf.from_tokenizer(tiny_tokenizer)
    assert matcher.consume_tokens(tokenizer.tokenize_str(text)), matcher.get_error()
    assert matcher.is_accepting()
    assert [json.loads(c.arguments)["city"] for c in fmt.parse(text).calls] == ["Oslo", "Rome"]
