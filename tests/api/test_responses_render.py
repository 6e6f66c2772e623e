"""The Responses output builder on scripted replies, checked against the official client's own
models (validated strictly, not constructed), in milliseconds and without a stack."""

from __future__ import annotations

import json

import pydantic
from openai.types.responses import Response, ResponseStreamEvent

from tokenline.api.endpoints.responses import OutputBuilder
from tokenline.api.function_calling.formats import HERMES
from tokenline.api.http.errors import ApiError
from tokenline.api.openai.responses import ResponsesRequest

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
META = {"id": "resp_t-1", "created": 1700000000, "model": "tiny"}
USAGE = {
    "input_tokens": 7,
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "output_tokens": 3,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 10,
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny", "input": "hi", **fields})


def _decode(frames: list[bytes]) -> list[dict]:
    events = []
    for raw in frames:
        head, data = raw.decode().removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        EVENT.validate_python(payload)  # every event is one the client knows, fields and all
        events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _run(pieces: list[str], finish: str = "stop", parser=None, **fields):
    builder = OutputBuilder(META, _body(**fields), parser, emit=True)
    frames = builder.start()
    for piece in pieces:
        frames += builder.feed(piece)
    frames += builder.finish(finish, USAGE)
    return _decode(frames), Response.model_validate(builder.response)


def test_text_streams_into_one_message():
    events, response = _run(["Hel", "lo", " there"])
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert response.output_text == "Hello there" == events[-4]["text"]
    assert response.status == "completed" and response.completed_at is not None
    assert events[-1]["response"] == response.model_dump(mode="json", exclude_unset=True)


def test_text_and_calls_become_separate_items_in_order():
    events, response = _run(
        ["Let me check. ", CALL[:20], CALL[20:], "\nDone."], parser=HERMES, tools=[]
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["message", "function_call", "message"]
    message, call, after = response.output
    assert message.content[0].text == "Let me check."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    assert after.content[0].text == "Done."
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]
    (arguments,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert arguments["item_id"] == call.id and arguments["arguments"] == call.arguments


def test_a_reply_of_only_a_call_has_no_message():
    _, response = _run([CALL], parser=HERMES)
    assert [item.type for item in response.output] == ["function_call"]
    assert response.output_text == ""


def test_an_empty_reply_is_an_empty_message():
    _, response = _run([])
    (item,) = response.output
    assert item.type == "message" and item.content[0].text == ""


def test_length_ends_incomplete_and_the_last_item_with_it():
    events, response = _run(["cut of"], finish="length", max_output_tokens=2)
    assert events[-1]["type"] == "response.incomplete"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.max_output_tokens == 2


def test_a_failure_sends_error_then_response_failed():
    builder = OutputBuilder(META, _body(), None, emit=True)
    frames = builder.start() + builder.feed("partial")
    frames += builder.fail(ApiError(504, "ran past the timeout", "request_timeout"), USAGE)
    events = _decode(frames)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "request_timeout"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and "request_timeout" in failed.error.message


def test_the_echo_repeats_the_request_in_responses_shape():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    _, response = _run(
        ["x"],
        tools=[tool],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
        instructions="Be brief.",
        temperature=0.2,
        store=True,
    )
    assert response.tools[0].name == "f" and response.tools[0].strict is True
    assert response.tool_choice.name == "f"
    assert response.text.format.type == "json_schema" and response.text.format.name == "a"
    assert (response.instructions, response.temperature) == ("Be brief.", 0.2)
    assert response.model_extra["store"] is False


def _think_then(thoughts: list[str], pieces: list[str], finish: str = "stop"):
    builder = OutputBuilder(META, _body(), None, emit=True)
    frames = builder.start()
    for thought in thoughts:
        frames += builder.think(thought)
    for piece in pieces:
        frames += builder.feed(piece)
    frames += builder.finish(finish, USAGE)
    return _decode(frames), Response.model_validate(builder.response)


def test_thinking_streams_into_a_reasoning_item_before_the_message():
    events, response = _think_then(["the ", "river"], ["Hel", "lo"])
    kinds = [e["type"] for e in events]
    assert kinds[2:9] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[9] == "response.output_item.added" and kinds[-1] == "response.completed"
    thought, message = response.output
    assert thought.type == "reasoning" and thought.status == "completed"
    assert thought.content[0].text == "the river" and thought.summary == []
    assert message.type == "message" and message.content[0].text == "Hello"
    assert {e["output_index"] for e in events if "reasoning_text" in e["type"]} == {0}


def test_a_reply_cut_while_thinking_ends_with_its_thinking_alone():
    events, response = _think_then(["the ", "river"], [], finish="length")
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].status == "incomplete" and response.status == "incomplete"
    assert events[-1]["type"] == "response.incomplete"
    _, done = _think_then(["the river"], [])
    assert [item.type for item in done.output] == ["reasoning", "message"]  # answer: empty
