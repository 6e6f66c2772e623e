"""What agent frameworks send, as raw requests against the stack: schemas without
``additionalProperties``, calls cut by max_tokens, a forced call beside a response format,
broken arguments in history, and the fields current SDKs add.

The tiny model writes random text, so every reply is checked for validity across many seeds:
a random model finds any gap a grammar leaves.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

SEEDS = range(12)
CHAT = [{"role": "user", "content": "What is the weather in Oslo?"}]
OPEN_NAME = {  # the repro: no additionalProperties, strict
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}},
    "required": ["name"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {  # as LangChain's bind_tools sends a non-strict tool: open
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MARKUP = ("<tool_call>", "</tool_call>", '{"name"')


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _closed_validate(document: object, schema: dict) -> None:
    """Valid against the schema, and no key the schema does not declare."""
    jsonschema.validate(document, schema)
    assert set(document) <= set(schema["properties"]), document


def _check_calls(calls) -> None:
    for call in calls or []:
        assert call.function.name in PARAMETERS, call
        _closed_validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


# ── 1. undeclared properties ──────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("strict", [True, None])
def test_a_schema_silent_on_additional_properties_admits_only_declared_keys(client, stack, strict):
    fmt = {"name": "x", "schema": OPEN_NAME}
    if strict is not None:
        fmt["strict"] = strict
    for seed in SEEDS:
        reply = client.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            response_format={"type": "json_schema", "json_schema": fmt},
            seed=seed,
            max_tokens=200,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        _closed_validate(json.loads(choice.message.content), OPEN_NAME)


def test_a_schema_that_allows_more_keys_still_gets_them(client, stack):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        # other keys, by a schema; short ones, else a random model writes one until max_tokens
        "patternProperties": {"^[a-z]{1,2}$": {"type": "integer", "minimum": 0, "maximum": 9}},
        "additionalProperties": False,
        "maxProperties": 3,
    }
    keys: set[str] = set()
    for seed in SEEDS:
        reply = client.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            seed=seed,
            max_tokens=200,
        )
        document = json.loads(reply.choices[0].message.content)
        jsonschema.validate(document, schema)
        keys |= set(document)
    assert keys - {"a"}, "the schema allows other keys, and a random model writes some"


def test_tool_arguments_silent_on_additional_properties_admit_only_declared_keys(client, stack):
    for seed in SEEDS:
        reply = client.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
            max_tokens=300,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", seed
        assert choice.message.tool_calls and not choice.message.content
        _check_calls(choice.message.tool_calls)


# ── 2. a call cut by max_tokens ───────────────────────────────────────────────────────────────
@pytest.mark.parametrize("max_tokens", [3, 8, 14, 20, 30, 40])
def test_a_call_cut_by_max_tokens_never_leaks_markup_into_content(client, stack, max_tokens):
    for seed in range(4):
        kwargs = dict(
            model=stack.model,
            messages=CHAT,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
            max_tokens=max_tokens,
        )
        whole = client.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "length"
        assert not any(m in (whole.message.content or "") for m in MARKUP), whole.message
        for call in whole.message.tool_calls or []:  # cut in its arguments: name kept
            assert call.function.name in PARAMETERS
        content, names = "", []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                names += [c.function.name for c in choice.delta.tool_calls or [] if c.id]
        assert not any(m in content for m in MARKUP), content
        assert names == [c.function.name for c in whole.message.tool_calls or []]


def test_a_cut_call_in_the_responses_api_is_no_text(client, stack):
    for max_tokens in (8, 20, 40):
        response = client.responses.create(
            model=stack.model,
            input="What is the weather in Oslo?",
            tools=[{"type": "function", **WEATHER["function"]}],
            tool_choice="required",
            max_output_tokens=max_tokens,
            temperature=1,
        )
        assert response.status == "incomplete"
        assert not any(m in response.output_text for m in MARKUP), response.output_text


# ── 3. a forced call beside a response format ─────────────────────────────────────────────────
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_a_forced_call_and_a_response_format_are_accepted_together(client, stack, tool_choice):
    for seed in range(4):
        reply = client.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            tools=TOOLS,
            tool_choice=tool_choice,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": OPEN_NAME},
            },
            seed=seed,
            max_tokens=300,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)
        if isinstance(tool_choice, dict):
            assert {c.function.name for c in choice.message.tool_calls} == {"get_time"}


# ── 4. broken arguments in history ────────────────────────────────────────────────────────────
def test_non_json_arguments_in_history_are_accepted_and_rendered_as_text(
    client, stack, tiny_tokenizer
):
    broken = '{"city": "Os'  # an earlier turn's call, cut or invalid: ordinary history
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": broken},
    }
    conversation = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    reply = client.chat.completions.create(
        model=stack.model, messages=conversation, tools=[WEATHER], max_tokens=2
    )
    rendered = tiny_tokenizer.apply_chat_template(
        [
            *CHAT,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ],
        tools=[WEATHER],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert json.dumps(broken) in rendered  # the template's tojson of the text as it was
    assert reply.usage.prompt_tokens == len(
        tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )
    response = client.responses.create(
        model=stack.model,
        input=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": broken,
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        ],
        tools=[{"type": "function", **WEATHER["function"]}],
        max_output_tokens=2,
    )
    assert response.usage.input_tokens == reply.usage.prompt_tokens


# ── 6. only declared functions are callable ───────────────────────────────────────────────────
def test_auto_tool_choice_calls_only_declared_functions_with_valid_arguments(client, stack):
    for seed in SEEDS:
        for stream in (False, True):
            kwargs = dict(model=stack.model, messages=CHAT, tools=TOOLS, seed=seed, max_tokens=60)
            if not stream:
                choice = client.chat.completions.create(**kwargs).choices[0]
                assert not any(m in (choice.message.content or "") for m in MARKUP[:2])
                if choice.finish_reason != "length":
                    _check_calls(choice.message.tool_calls)
                continue
            body = {**kwargs, "stream": True}
            with httpx.stream(
                "POST", f"{stack.api_url}/v1/chat/completions", json=body, timeout=60
            ) as reply:
                text = "".join(reply.iter_text())
            assert reply.status_code == 200 and "<tool_call>" not in text
