"""The mistral, pythonic, qwen3_coder and deepseek_v3 formats without a stack: their parsers
(whole and streamed in random pieces alike, cut-off calls, markup never content), their
detection from templates, and their grammars: output that required and named tool choices
allow, drawn token by token at random, parses into calls valid for their schemas; a marker that
is a special token of the vocabulary is written as that token, which the scheduler's grammar
tokenizer takes."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import llguidance.hf
import pytest
from tool_format_testkit import TEMPLATES, TOOLS, with_special_marker

from tokenline.api.function_calling import grammars
from tokenline.api.function_calling.formats import (
    DEEPSEEK_V3,
    FORMATS,
    HERMES,
    MISTRAL,
    PYTHONIC,
    QWEN3_CODER,
    format_for,
)
from tokenline.api.function_calling.list_streams import MISTRAL_TRIGGER
from tokenline.api.function_calling.parsers import Call, CallEnd, Content, ParsedCall
from tokenline.api.http.errors import ApiError
from tokenline.api.openai.tools import NamedToolChoice, Tool
from tokenline.model_source import special_tokens
from tokenline.scheduler.grammar import grammar_tokenizer

NEW = [MISTRAL, PYTHONIC, QWEN3_CODER, DEEPSEEK_V3]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
F = ParsedCall("f", '{"x": 1}')
G = ParsedCall("g", '{"city": "Oslo"}')

DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
# (format, reply, content, calls)
REPLIES = [
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', None, [F]),
    (
        MISTRAL,
        'Let me see. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, '
        '{"name": "g", "arguments": {"city": "Oslo"}}]',
        "Let me see.",
        [F, G],
    ),
    (MISTRAL, '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{"city": "Oslo"}', None, [F, G]),
    (MISTRAL, '[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"x": 1}', None, [F]),
    (MISTRAL, "no calls [here]", "no calls [here]", []),
    # cut off once the arguments began: a call as far as written (finish_reason says length)
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "f", "arguments": {"x": "]',
        None,
        [ParsedCall("f", '{"x": "]')],
    ),
    (MISTRAL, '[TOOL_CALLS]f[ARGS]{"x": [1', None, [ParsedCall("f", '{"x": [1')]),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "argu', None, []),  # cut off before: dropped
    (MISTRAL, '[TOOL_CALLS][{"arguments": {"x": 1}, "name": "f"}]', None, [F]),  # whole
    (MISTRAL, "[TOOL_CALLS]not a call", "not a call", []),  # the marker alone is dropped
    (PYTHONIC, '[f(x=1), g(city="Oslo")]', None, [F, G]),
    (PYTHONIC, "<|python_start|>[f(x=1)]<|python_end|>", None, [F]),
    (PYTHONIC, '[g(city="Oslo"), f(x=', None, [G]),  # the second cut off
    (PYTHONIC, "[f(x=os.system('x'))]", None, []),  # no literal: markup, never run or shown
    (PYTHONIC, "[1, 2] are numbers", "[1, 2] are numbers", []),
    (PYTHONIC, "Paris is sunny.", "Paris is sunny.", []),
    (PYTHONIC, "[get_wea", None, []),
    (
        QWEN3_CODER,
        "Checking.\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=g>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call>",
        "Checking.",
        [F, G],
    ),
    (QWEN3_CODER, "<tool_call>\n<function=f>\n<parameter=x>\n1\n</para", None, []),
    (QWEN3_CODER, "a <tool_call>junk</tool_call> b", "a b", []),
    (
        DEEPSEEK_V3,
        "Sure.<｜tool▁calls▁begin｜>"
        + DS_CALL.format("f", '{"x": 1}')
        + "\n"
        + DS_CALL.format("g", '{"city": "Oslo"}')
        + "<｜tool▁calls▁end｜>",
        "Sure.",
        [F, G],
    ),
    (
        DEEPSEEK_V3,
        "<｜tool▁calls▁begin｜>" + DS_CALL.format("f", '{"x": 1').split("\n```<")[0],
        None,
        [ParsedCall("f", '{"x": 1')],
    ),  # cut off once the arguments began
    (
        DEEPSEEK_V3,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```js",
        None,
        [],
    ),
    (DEEPSEEK_V3, "<｜tool▁calls▁begin｜>" + DS_CALL.format("f", "[1]"), None, []),  # no object
    (DEEPSEEK_V3, "plain", "plain", []),
]
TYPED = {"f": {"properties": {"x": {"type": "integer"}}}, "g": SCHEMAS["get_weather"]}


def _streamed(fmt, text: str, rng: random.Random):
    stream = fmt.bound(TYPED).stream()
    deltas, position = [], 0
    while position < len(text):
        size = rng.randint(1, 6)
        deltas += stream.feed(text[position : position + size])
        position += size
    deltas += stream.finish()
    return deltas


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    REPLIES,
    ids=[f"{r[0].name}-{i}" for i, r in enumerate(REPLIES)],
)
def test_whole_and_streamed_in_random_pieces_split_alike(fmt, text, content, calls):
    whole = fmt.bound(TYPED).parse(text)
    assert (whole.content or None, whole.calls) == (content, calls)
    markup = ("[TOOL_CALLS]", "<tool_call>", "<function=", "<｜", "[f(", "[get_wea")
    for seed in range(20):
        deltas = _streamed(fmt, text, random.Random(seed))
        streamed = "".join(d.text for d in deltas if isinstance(d, Content))
        assert (streamed or None, [d.call for d in deltas if isinstance(d, Call | CallEnd)]) == (
            content,
            calls,
        ), seed
        assert not any(m in streamed for m in markup)


def test_qwen3_coder_values_are_typed_by_the_schema():
    schemas = {
        "f": {
            "properties": {
                "n": {"type": "integer"},
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "note": {"type": ["string", "null"]},
                "code": {"type": "string"},
            }
        }
    }
    text = (
        "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n"
        '<parameter=ok>\nTrue\n</parameter>\n<parameter=tags>\n["a"]\n</parameter>\n'
        "<parameter=note>\nnull\n</parameter>\n<parameter=code>\n12\n</parameter>\n"
        "<parameter=other>\nfree\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = QWEN3_CODER.bound(schemas).parse(text).calls
    assert json.loads(call.arguments) == {
        "n": 3,
        "ok": True,
        "tags": ["a"],
        "note": None,
        "code": "12",
        "other": "free",
    }


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_format_is_read_from_its_template(name):
    assert format_for(TEMPLATES[name]) is FORMATS[name]


def test_a_template_showing_hermes_still_gets_hermes():
    assert format_for("{{ '<tool_call>' }} {\"name\": ...}") is HERMES


def test_mistral_call_ids_are_what_its_templates_accept():
    ids = {MISTRAL.call_id() for _ in range(20)}
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(ids) == 20
    assert PYTHONIC.call_id().startswith("call_")


# ── grammars ───────────────────────────────────────────────────────────────────────────────────
def _tools(*tools) -> list[Tool]:
    return [Tool.model_validate(t) for t in tools]


def _draw(grammar: str, tokenizer, seed: int, limit: int = 300) -> str:
    """Text the grammar allows, drawn a token at a time uniformly among those it allows."""
    env = llguidance.hf.from_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(env, grammar, log_level=0)
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < limit and not matcher.is_stopped():
        bias = matcher.compute_logit_bias()
        allowed = [i for i, b in enumerate(bias) if b and i < len(tokenizer)]
        if matcher.is_accepting() and (not allowed or rng.random() < 0.5):
            break
        token = rng.choice(allowed)
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
    assert matcher.is_accepting(), tokenizer.decode(ids)
    return tokenizer.decode(ids)


@pytest.mark.parametrize("fmt", NEW, ids=[f.name for f in NEW])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_output_parses_into_valid_calls(fmt, choice, tiny_tokenizer):
    tools = _tools(*TOOLS)
    tool_choice = (
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
        if choice == "named"
        else "required"
    )
    # one call: uniformly drawn tokens would otherwise call on and on
    plan = grammars.plan_tools(tools, tool_choice, False, None, fmt)
    for seed in range(4):
        text = _draw(plan.grammar, tiny_tokenizer, seed)
        parsed = plan.parser.parse(text)
        assert parsed.calls and not parsed.content, text
        if choice == "named":
            assert [c.name for c in parsed.calls] == ["get_time"]
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("fmt", NEW, ids=[f.name for f in NEW])
def test_auto_allows_text_and_calls_of_declared_functions_only(fmt, tiny_tokenizer):
    plan = grammars.plan_tools(_tools(*TOOLS), "auto", True, None, fmt)
    env = llguidance.hf.from_tokenizer(tiny_tokenizer)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(env, plan.grammar, log_level=0)
        return matcher.consume_tokens(env.tokenize_str(text)) and matcher.is_accepting()

    good = {
        "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        "pythonic": '[get_time(zone="UTC")]',
        "qwen3_coder": "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
        "</function>\n</tool_call>",
        "deepseek_v3": "<｜tool▁calls▁begin｜>"
        + DS_CALL.format("get_time", '{"zone": "UTC"}')
        + "<｜tool▁calls▁end｜>",
    }[fmt.name]
    assert accepts("Hello there") and accepts(good)
    assert not accepts(good.replace("get_time", "rm_rf"))
    assert not accepts(good.replace("UTC", "PST"))
    if fmt.trigger is not None:
        assert accepts("Let me look. " + good)


@pytest.mark.parametrize("fmt", [PYTHONIC, QWEN3_CODER], ids=["pythonic", "qwen3_coder"])
def test_a_schema_the_format_cannot_hold_is_refused_with_a_400(fmt):
    nested = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"$ref": "#/$defs/X"}},
                "$defs": {"X": {"type": "string"}},
            },
        },
    }
    with pytest.raises(ApiError) as caught:
        grammars.plan_tools(_tools(nested), "required", True, None, fmt)
    assert "tools[f].function.parameters" in str(caught.value.body())
    assert "--tool-call-parser" in str(caught.value.body())


def test_pythonic_refuses_json_values_python_spells_differently():
    flags = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "array", "items": {"type": "boolean"}}},
            },
        },
    }
    with pytest.raises(ApiError):
        grammars.plan_tools(_tools(flags), "required", True, None, PYTHONIC)
    # the same schema is fine where the arguments are JSON
    assert grammars.plan_tools(_tools(flags), "required", True, None, MISTRAL).grammar


# ── markers that are special tokens ────────────────────────────────────────────────────────────
@pytest.fixture(scope="module")
def special_marker(tiny_tokenizer):
    return with_special_marker(tiny_tokenizer)


def _allowed(matcher: llguidance.LLMatcher, size: int) -> list[int]:
    return [i for i, b in enumerate(matcher.compute_logit_bias()) if b and i < size]


def test_a_special_marker_is_its_exact_token_in_the_scheduler_s_grammar(special_marker):
    """required writes the marker as the model's own special token (``<[id]>``), which the
    scheduler's grammar tokenizer takes; auto lets free text end at that token, then holds
    the call to the declared functions."""
    tokenizer, marker = special_marker
    fmt = MISTRAL.for_vocabulary({MISTRAL_TRIGGER: marker, "<|end|>": 4})
    assert fmt.special_markers == ((MISTRAL_TRIGGER, marker),)
    env = grammar_tokenizer(tokenizer)
    size = len(tokenizer)
    required = grammars.plan_tools(_tools(*TOOLS), "required", False, None, fmt)
    assert f"<[{marker}]>" in required.grammar
    for seed in range(3):
        matcher = llguidance.LLMatcher(env, required.grammar, log_level=0)
        assert _allowed(matcher, size) == [marker]
        rng, ids = random.Random(seed), []
        while not matcher.is_stopped() and len(ids) < 300:
            token = rng.choice(_allowed(matcher, size))
            assert matcher.consume_token(token), matcher.get_error()
            ids.append(token)
        parsed = fmt.parse(tokenizer.decode(ids, skip_special_tokens=False))
        assert len(parsed.calls) == 1 and not parsed.content
        call = parsed.calls[0]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])

    auto = grammars.plan_tools(_tools(*TOOLS), "auto", True, None, fmt)

    def accepts(ids: list[int]) -> bool:
        matcher = llguidance.LLMatcher(env, auto.grammar, log_level=0)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    def text(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False)

    call = '[{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    assert accepts(text("Hello there"))
    assert accepts([marker, *text(call)])
    assert accepts([*text("Let me look. "), marker, *text(call)])
    assert not accepts([marker, *text(call.replace("get_time", "rm_rf"))])


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_formats_whose_markers_are_text_keep_their_grammars(fmt):
    """Special tokens of a vocabulary that the format does not write change nothing."""
    same = fmt.for_vocabulary({"<|end|>": 4, "<s>": 1, "[INST]": 3})
    assert same.special_markers == ()
    for choice in ("required", "auto"):
        ours = grammars.plan_tools(_tools(*TOOLS), choice, True, None, same)
        before = grammars.plan_tools(_tools(*TOOLS), choice, True, None, fmt)
        assert ours.grammar == before.grammar


def test_the_api_reads_special_tokens_from_the_tokenizer_files(tmp_path):
    added = [
        {"id": 4, "content": "<|end|>", "special": True},
        {"id": 9, "content": "<tool_call>", "special": False},  # added as text, as Qwen's
        {"id": 12, "content": MISTRAL_TRIGGER, "special": True},
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    assert special_tokens(str(tmp_path)) == {"<|end|>": 4, MISTRAL_TRIGGER: 12}
    assert special_tokens("tiny") == {}
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert special_tokens(str(tmp_path)) == {}  # logged, and the markers stay text
