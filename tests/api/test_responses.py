"""The Responses API (``POST /v1/responses``) through the official openai client and
openai-agents, against the running stack.

The tiny model writes random text, so these assert shapes and consistency (streamed deltas join
to the final text, calls validate against their schema), never content. Where a test needs the
model to stop on its own (an agent's answer must not be cut off, or agents raise), the output
is a small bounded JSON schema, which constrained decoding always completes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Annotated

import agents
import httpx
import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS = 400

WEATHER = {
    "type": "function",
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
    "strict": True,
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "sunny": {"type": "boolean"},
        "degrees": {"type": "integer", "minimum": -20, "maximum": 40},
    },
    "required": ["sunny", "degrees"],
    "additionalProperties": False,
}


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _post(stack, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(f"{stack.api_url}{path}", json={"model": stack.model, **body}, timeout=60)


def _message_texts(response) -> list[str]:
    return [
        part.text
        for item in response.output
        if item.type == "message"
        for part in item.content
        if part.type == "output_text"
    ]


# ── whole responses ────────────────────────────────────────────────────────────────────────────
def test_text_input_gives_a_response_with_real_usage(client, stack):
    response = client.responses.create(model=stack.model, input="Tell me about rivers.")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == stack.model
    assert response.status in ("completed", "incomplete")
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert response.output_text == item.content[0].text
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # the echo fields the client's model requires, and the truth about storage
    raw = _post(stack, {"input": "hi", "max_output_tokens": 2}).json()
    assert raw["store"] is False and raw["tools"] == [] and raw["tool_choice"] == "auto"
    assert raw["text"] == {"format": {"type": "text"}}


def test_item_input_and_instructions_reach_the_prompt(client, stack):
    plain = client.responses.create(model=stack.model, input="Hello", max_output_tokens=2)
    items = client.responses.create(
        model=stack.model,
        instructions="You answer in one word.",
        input=[
            {"role": "developer", "content": "Be kind."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi!", "annotations": []}],
            },
            {"role": "user", "content": "And again?"},
        ],
        max_output_tokens=2,
        temperature=0.0,
        top_p=0.9,
        metadata={"run": "1"},
    )
    assert items.status == "incomplete"  # greedy: the same two tokens every run
    assert items.usage.input_tokens > plain.usage.input_tokens + 10
    assert items.instructions == "You answer in one word."
    assert (items.temperature, items.top_p, items.metadata) == (0.0, 0.9, {"run": "1"})


@pytest.mark.parametrize(("status", "continued"), [("incomplete", True), ("completed", False)])
def test_an_unfinished_last_message_is_continued_not_answered(client, stack, status, continued):
    """vLLM's partial completion: a last message item still in_progress or incomplete is left
    open for the reply (the prompt /tokenize counts with continue_final_message)."""
    said = {"type": "output_text", "text": "The river", "annotations": []}
    reply = client.responses.create(
        model=stack.model,
        input=[
            {"role": "user", "content": "Tell me about the river."},
            {"type": "message", "role": "assistant", "status": status, "content": [said]},
        ],
        max_output_tokens=1,
    )
    chat = [
        {"role": "user", "content": "Tell me about the river."},
        {"role": "assistant", "content": "The river"},
    ]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    counted = httpx.post(
        f"{stack.api_url}/tokenize", json={"messages": chat, **(flags if continued else {})}
    )
    assert reply.usage.input_tokens == counted.json()["count"]


def test_max_output_tokens_ends_incomplete(client, stack):
    response = client.responses.create(
        model=stack.model, input="Talk at length.", max_output_tokens=5, temperature=0
    )  # greedy: the same reply every run, and it does not stop within 5 tokens
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5
    assert response.output[-1].status == "incomplete"
    assert response.max_output_tokens == 5


# ── streams ────────────────────────────────────────────────────────────────────────────────────
def test_stream_events_come_in_order_and_join_to_the_final_text(client, stack):
    events = list(
        client.responses.create(
            model=stack.model, input="Tell me a story.", max_output_tokens=30, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{events[-1].response.status}",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1 and ids.pop().startswith("resp_")
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    item_id = events[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 for d in deltas)
    final = events[-1].response
    assert "".join(d.delta for d in deltas) == final.output_text == events[-4].text
    assert final.output[0].id == item_id
    assert (
        final.usage.output_tokens == 30
        if final.status == "incomplete"
        else 0 < final.usage.output_tokens < 30
    )


def test_stream_helper_gives_the_final_response(client, stack):
    # a bounded JSON answer always completes: the helper needs response.completed
    request = dict(
        model=stack.model,
        input="How is the weather?",
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}},
        max_output_tokens=MAX_TOKENS,
    )
    with client.responses.stream(**request) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), ANSWER_SCHEMA)


def test_stream_carries_no_done_sentinel_and_names_each_event(stack):
    body = {"model": stack.model, "input": "hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{stack.api_url}/v1/responses", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    frames = [f for f in text.split("\n\n") if f]
    assert "[DONE]" not in text
    for f in frames:
        event, data = f.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data.removeprefix("data: "))["type"] == event.removeprefix("event: ")


# ── structured output and tools ───────────────────────────────────────────────────────────────
def test_json_schema_output_parses_and_validates(client, stack):
    response = client.responses.create(
        model=stack.model,
        input="How is the weather?",
        text={
            "format": {
                "type": "json_schema",
                "name": "answer",
                "schema": ANSWER_SCHEMA,
                "strict": True,
            }
        },
        max_output_tokens=MAX_TOKENS,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), ANSWER_SCHEMA)
    assert response.text.format.type == "json_schema"


def _call_of(response):
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    return call


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_function_call_round_trip(client, stack, choice):
    request = dict(model=stack.model, tools=[WEATHER], parallel_tool_calls=False)
    conversation = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(
        **request, input=conversation, tool_choice=choice, max_output_tokens=MAX_TOKENS
    )
    assert first.status == "completed"
    call = _call_of(first)
    # the call and its output go back as items, the way a stateless client continues
    conversation += [item.model_dump(exclude_none=True) for item in first.output]
    conversation.append(
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21"}
    )
    second = client.responses.create(
        **request,
        input=conversation,
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}},
        tool_choice="none",
        max_output_tokens=MAX_TOKENS,
    )
    assert second.status == "completed"
    jsonschema.validate(json.loads(second.output_text), ANSWER_SCHEMA)
    # the call and its output are in the prompt: longer than the question alone
    alone = client.responses.create(
        **request, input=conversation[:1], tool_choice="none", max_output_tokens=1
    )
    assert second.usage.input_tokens > alone.usage.input_tokens + 10


def test_a_streamed_call_is_the_one_in_the_final_response(client, stack):
    with client.responses.stream(
        model=stack.model,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=MAX_TOKENS,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = _call_of(final)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    # the arguments stream in pieces as they are generated
    assert len(deltas) > 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.call_id == call.call_id and events[2].item.arguments == ""
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(d.delta for d in deltas) == done.arguments == call.arguments


# ── refusals: a 400 naming the field, before anything runs ─────────────────────────────────────
REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"seed": 3}, "seed"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"image": {"context_compression": "enabled"}}, "image"),
    ({"prompt_cache_options": {"mode": "explicit"}}, "prompt_cache_options"),
    ({"access_programs": {"cyber": "standard"}}, "access_programs"),
    ({"background_options": {"completion_window": "2h"}}, "background_options"),
    ({"tools": [{**WEATHER, "output_schema": {"type": "string"}}]}, "tools[0].output_schema"),
    ({"tools": [{**WEATHER, "allowed_callers": ["programmatic"]}]}, "tools[0].allowed_callers"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    (
        {"stream": True, "stream_options": {"include_obfuscation": True}},
        "stream_options.include_obfuscation",
    ),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
    ),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_unserved_fields_are_refused_naming_the_param(stack, extra, param):
    reply = _post(stack, {"input": "hi", **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", param), error
    assert error["type"] == "invalid_request_error"


INVALID = [
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{**WEATHER, "parameters": {"type": 5}}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}}, "text.format.name"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
        "text.format.schema",
    ),
    # a schema beside another type would be dropped
    (
        {"text": {"format": {"type": "json_object", "name": "x", "schema": ANSWER_SCHEMA}}},
        "text.format.schema",
    ),
    ({"input": [{"type": "function_call_output", "output": "21"}]}, "input[0].call_id"),
    # checked when the request becomes chat's: named as sent, not blamed on the input
    ({"kv_transfer_params": {"do_remote_prefill": "yes"}}, "kv_transfer_params"),
    ({"input": [{"role": "tool", "content": "21"}]}, "input[0].role"),
]


@pytest.mark.parametrize(("extra", "param"), INVALID, ids=[p for _, p in INVALID])
def test_invalid_fields_are_refused_naming_the_param(stack, extra, param):
    reply = _post(stack, {"input": "hi", **extra})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()


def test_the_official_client_sees_the_storage_refusal(client, stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=stack.model, input="hi", previous_response_id="resp_x")
    assert caught.value.body["param"] == "previous_response_id"
    assert "send the whole conversation" in caught.value.body["message"]


def test_store_is_accepted_and_answered_false(stack):
    reply = _post(stack, {"input": "hi", "store": True, "max_output_tokens": 2})
    assert reply.status_code == 200 and reply.json()["store"] is False


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/resp_1"),
        ("DELETE", "/v1/responses/resp_1"),
        ("GET", "/v1/responses/resp_1/input_items"),
        ("POST", "/v1/responses/resp_1/cancel"),
    ],
)
def test_stored_response_routes_say_nothing_is_stored(stack, method, path):
    reply = httpx.request(method, f"{stack.api_url}{path}", timeout=10)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "not_found" and "stores no responses" in error["message"]


def test_the_client_retrieve_sees_a_404(client, stack):
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_1")


@pytest.mark.parametrize("stream", [False, True])
def test_input_longer_than_the_context_fails_before_any_event(client, stack, stream):
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=stack.model, input="river mountain " * 3000, stream=stream)
    error = caught.value.body
    assert error["code"] == "context_length_exceeded"
    assert time.monotonic() - started < 5
    # the tokenizer stage names chat's fields; a Responses client reads its own
    assert error["param"] == "input"
    # only the input's length is at fault (a max_output_tokens past the context is cut to it)
    assert error["message"].startswith("This model's maximum context length")
    assert "max_tokens" not in error["message"] and "messages" not in error["message"]


# ── openai-agents' default model ──────────────────────────────────────────────────────────────
class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sunny: bool
    degrees: int = Field(ge=-20, le=40)


def _model(stack):
    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(
        base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    return agents.OpenAIResponsesModel(stack.model, client)


def test_an_agent_runs_a_plain_turn(stack):
    # greedy, so the reply is the same every run: this one stops before the context fills
    agent = agents.Agent(
        name="plain",
        instructions="Be brief.",
        model=_model(stack),
        model_settings=agents.ModelSettings(temperature=0),
    )
    result = asyncio.run(agents.Runner.run(agent, "Hello", max_turns=1))
    assert isinstance(result.final_output, str)
    (response,) = result.raw_responses
    assert response.response_id.startswith("resp_") and response.usage.output_tokens > 0


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_calls_a_tool_then_answers(stack, streamed):
    cities: list[str] = []

    # offered until used once, so the second turn answers instead of calling again
    @agents.function_tool(is_enabled=lambda ctx, agent: not cities)
    def get_weather(city: Annotated[str, Field(max_length=6)]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny, 21 degrees"

    agent = agents.Agent(
        name="weather",
        instructions="Use the tool, then answer.",
        model=_model(stack),
        tools=[get_weather],
        output_type=Answer,
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS
        ),
    )

    async def run():
        if not streamed:
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
        result = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert len(cities) == 1
    assert [type(item).__name__ for item in result.new_items] == [
        "ToolCallItem",
        "ToolCallOutputItem",
        "MessageOutputItem",
    ]
    assert isinstance(result.final_output, Answer)


# ── a failure mid-stream ───────────────────────────────────────────────────────────────────────
# 700 booleans: about 1,400 tokens that no reply can stop before, seconds of decoding
LONG_ANSWER = {
    "type": "object",
    "properties": {
        "a": {"type": "array", "items": {"type": "boolean"}, "minItems": 700, "maxItems": 700}
    },
    "required": ["a"],
    "additionalProperties": False,
}


def test_a_deadline_mid_stream_ends_in_error_then_response_failed(launch_stack):
    short = launch_stack("--request-timeout", "2")
    try:
        client = OpenAI(base_url=f"{short.api_url}/v1", api_key="unused", max_retries=0)
        stream = client.responses.create(
            model=short.model,
            input="Count.",
            text={"format": {"type": "json_schema", "name": "long", "schema": LONG_ANSWER}},
            stream=True,
        )
        # Pause the scheduler after the first delta, so the deadline (shorter than the heartbeat
        # timeout) falls mid-stream however fast the engine is.
        scheduler = short.pid_of("scheduler")
        events = []
        try:
            for event in stream:
                events.append(event)
                if event.type == "response.output_text.delta" and len(events) < 8:
                    os.kill(scheduler, signal.SIGSTOP)
        finally:
            os.kill(scheduler, signal.SIGCONT)
    finally:
        short.stop()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-2:] == ["error", "response.failed"]
    assert events[-2].code == "request_timeout"
    failed = events[-1].response
    assert failed.status == "failed" and "request-timeout" in failed.error.message
