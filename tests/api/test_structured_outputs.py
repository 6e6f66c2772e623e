"""Structured outputs and tool calls through the official openai client, against the stack.

The tiny model writes random text, so these assert validity, never content: every schema here
bounds its strings, numbers and lists, so a valid document is reachable within max_tokens
whatever the model prefers.
"""

from __future__ import annotations

import json
from enum import StrEnum

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS = 400


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=120)


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Place(BaseModel):
    # no extra keys: an open object lets the model add unbounded ones until max_tokens
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=8)
    floor: int = Field(ge=0, le=9)


class Order(BaseModel):
    colour: Colour
    quantity: int = Field(ge=1, le=5)
    place: Place
    tags: list[Colour] = Field(max_length=3)


CHAT = [{"role": "user", "content": "Order something for the garden."}]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
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
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _valid_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    if name is not None:
        assert call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return arguments


# ── response_format ───────────────────────────────────────────────────────────────────────────
def test_parse_returns_a_pydantic_object(client, stack):
    completion = client.chat.completions.parse(
        model=stack.model, messages=CHAT, response_format=Order, max_tokens=MAX_TOKENS, seed=1
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Order)


def test_streamed_parse_returns_a_pydantic_object(client, stack):
    with client.chat.completions.stream(
        model=stack.model, messages=CHAT, response_format=Order, max_tokens=MAX_TOKENS, seed=2
    ) as stream:
        for _ in stream:
            pass
        completion = stream.get_final_completion()
    assert isinstance(completion.choices[0].message.parsed, Order)


def test_every_choice_of_n_validates(client, stack):
    completion = client.chat.completions.parse(
        model=stack.model, messages=CHAT, response_format=Order, max_tokens=MAX_TOKENS, n=3
    )
    assert len(completion.choices) == 3
    for choice in completion.choices:
        assert isinstance(choice.message.parsed, Order)


def test_json_object_output_parses(client, stack):
    # Any object is allowed, so an unbounded string can outrun max_tokens: every choice that
    # stopped must parse, and of four some stop.
    reply = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        n=4,
        seed=3,
    )
    stopped = [c for c in reply.choices if c.finish_reason == "stop"]
    assert stopped
    for choice in stopped:
        assert isinstance(json.loads(choice.message.content), dict)


def test_completions_take_a_response_format(client, stack):
    schema = Place.model_json_schema()
    reply = client.completions.create(
        model=stack.model,
        prompt="A place:",
        max_tokens=MAX_TOKENS,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": schema},
            }
        },
    )
    Place.model_validate_json(reply.choices[0].text)


def test_langchain_with_structured_output(stack):
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model=stack.model,
        base_url=f"{stack.api_url}/v1",
        api_key="unused",
        max_tokens=MAX_TOKENS,
        max_retries=0,
    )
    result = model.with_structured_output(Order).invoke("Order something.")
    assert isinstance(result, Order)


# ── tools ──────────────────────────────────────────────────────────────────────────────────────
def test_required_tool_choice_gives_calls_that_validate(client, stack):
    reply = client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=2 * MAX_TOKENS,  # parallel calls: room for several
        seed=4,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        _valid_call(call)


def test_a_named_function_is_the_one_called_once_without_parallel_calls(client, stack):
    reply = client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        seed=5,
    )
    (call,) = reply.choices[0].message.tool_calls
    _valid_call(call, "get_time")


def test_streamed_call_assembles_into_the_non_streamed_one(client, stack):
    request = dict(
        model=stack.model,
        messages=CHAT,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        seed=6,
        temperature=1.0,
    )
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls
    pieces = []
    with client.chat.completions.stream(**request) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        streamed = stream.get_final_completion().choices[0]
    assert len(pieces) > 1  # the arguments stream as they are generated, not in one piece
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    for call in streamed.message.tool_calls:
        _valid_call(call, "get_weather")


def test_a_tool_result_continues_the_conversation(client, stack):
    first = client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        seed=7,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    conversation = [
        *CHAT,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    reply = client.chat.completions.create(
        model=stack.model, messages=conversation, tools=TOOLS, max_tokens=8
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_tool_choice_answers_in_text_or_calls(client, stack):
    reply = client.chat.completions.create(
        model=stack.model, messages=CHAT, tools=TOOLS, max_tokens=16, seed=8
    )
    message = reply.choices[0].message
    assert "<tool_call>" not in (message.content or "")
    for call in message.tool_calls or []:
        assert call.function.name in PARAMETERS


# ── bad input: a 400 naming the param, at once ────────────────────────────────────────────────
def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


BAD = [
    ({"response_format": _schema_format({"type": "strin"})}, "response_format.json_schema.schema"),
    (
        {"response_format": _schema_format({"type": "array", "uniqueItems": True})},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": _schema_format({"type": "object", "required": "a"})},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    # a schema beside another type would be dropped: a 400, not free or any-object output
    (
        {"response_format": {**_schema_format({"type": "object"}), "type": "json_object"}},
        "response_format.json_schema",
    ),
    (
        {"response_format": {**_schema_format({"type": "object"}), "type": "text"}},
        "response_format.json_schema",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages.0"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_structured_input_is_refused_naming_the_param(stack, extra, param):
    body = {"model": stack.model, "messages": CHAT, "max_tokens": 4, **extra}
    reply = httpx.post(f"{stack.api_url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    if param in ("functions", "function_call"):
        assert error["code"] == "unsupported_parameter" and "tools" in error["message"]


def test_tool_turns_render_through_the_chat_template(client, stack, tiny_tokenizer):
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
    }
    conversation = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "rain"},
    ]
    reply = client.chat.completions.create(
        model=stack.model, messages=conversation, tools=TOOLS, max_tokens=2
    )
    # the template sees the arguments as an object and the tools as OpenAI sent them
    rendered = tiny_tokenizer.apply_chat_template(
        [
            *CHAT,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        **call,
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Oslo", "unit": "c"},
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_abc", "content": "rain"},
        ],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in rendered
    assert "<tool_response>\nrain\n</tool_response>" in rendered
    ids = tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert reply.usage.prompt_tokens == len(ids)


def test_tool_choice_none_keeps_the_tools_from_the_model(client, stack, tiny_tokenizer):
    reply = client.chat.completions.create(
        model=stack.model, messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    plain = tiny_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(
        tiny_tokenizer(plain, add_special_tokens=False)["input_ids"]
    )
    assert reply.choices[0].message.tool_calls is None


def test_tools_shown_to_the_model_lengthen_the_prompt(client, stack, tiny_tokenizer):
    reply = client.chat.completions.create(
        model=stack.model, messages=CHAT, tools=TOOLS, max_tokens=2
    )
    shown = tiny_tokenizer.apply_chat_template(
        CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in shown
    assert reply.usage.prompt_tokens == len(
        tiny_tokenizer(shown, add_special_tokens=False)["input_ids"]
    )
