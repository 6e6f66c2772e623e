"""Replies with tool calls, rendered by the api's own code from replies as the ring delivers
them, and read back by the official client's stream accumulator: streamed and whole agree."""

from __future__ import annotations

import json
import time

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from tokenline.api.endpoints.chat import ChatAnswer
from tokenline.api.function_calling import grammars as structured
from tokenline.api.function_calling.formats import HERMES
from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.ring.exchange import Exchange
from tokenline.protocol import Reply

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
OUTPUT = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)
META = {"id": "chatcmpl-x", "created": 0, "model": "tiny"}


class _NoFlow:
    def pause(self, exchange) -> None: ...
    def resume(self, exchange) -> None: ...


def _body(stream: bool) -> ChatCompletionRequest:
    body = ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}
        | {"stream": stream}
    )
    return body


PARSER = structured.plan_tools(_body(False).tools, None, True, None, HERMES).parser


def _exchange(pieces: list[str]) -> Exchange:
    ex = Exchange(uids=["u0"], deadline=time.monotonic() + 60, flow=_NoFlow())
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        ex.deliver(
            Reply(uid="u0", text=piece, num_tokens=1, finish_reason="stop" if last else None)
        )
    return ex


def _pieces(size: int) -> list[str]:
    return [OUTPUT[i : i + size] for i in range(0, len(OUTPUT), size)]


def test_a_whole_reply_carries_its_calls():
    ex = _exchange([OUTPUT])
    ex.keep([(0, Reply(uid="u0", text=OUTPUT, num_tokens=1))])
    ex.choices[0].finish_reason = "stop"
    choice = ChatAnswer(_body(False), PARSER).whole(ex, META)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    calls = choice["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Oslo"},
        {"city": "Rome"},
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("size", [1, 5, 1000])
async def test_streamed_deltas_assemble_in_the_official_client(size):
    ex = _exchange(_pieces(size))
    first = await ex.next_batch()
    state = ChatCompletionStreamState(input_tools=[TOOL])
    content_chunks = []
    async for raw in ChatAnswer(_body(True), PARSER).stream(ex, first, META):
        data = raw.decode().removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        chunk = ChatCompletionChunk.model_validate_json(data)
        for choice in chunk.choices:
            if choice.delta.content:
                content_chunks.append(choice.delta.content)
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.content == "Let me check."
    assert "<" not in "".join(content_chunks)
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls
    ] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome"}),
    ]
