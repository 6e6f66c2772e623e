"""Mistral's and DeepSeek-V3's calls stream piece by piece, as Hermes' do: the api's own chat
rendering of replies as the ring delivers them, read back by the official client's stream
accumulator (its events and its final message), against the whole reply's message."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from tool_format_testkit import TOOLS

from tokenline.api.endpoints.chat import ChatAnswer
from tokenline.api.function_calling import grammars
from tokenline.api.function_calling.formats import DEEPSEEK_V3, MISTRAL
from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.ring.exchange import Exchange
from tokenline.protocol import Reply

OSLO = '{"city": "Oslo", "days": 3, "metric": true}'
UTC = '{"zone": "UTC"}'
DS = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
OUTPUTS = {  # the reply, as its format writes two calls after some text
    "mistral-list": (
        MISTRAL,
        f'Let me check. [TOOL_CALLS][{{"name": "get_weather", "arguments": {OSLO}}}, '
        f'{{"name": "get_time", "arguments": {UTC}}}]',
    ),
    "mistral-named": (
        MISTRAL,
        f"Let me check. [TOOL_CALLS]get_weather[ARGS]{OSLO}[TOOL_CALLS]get_time[ARGS]{UTC}",
    ),
    "deepseek_v3": (
        DEEPSEEK_V3,
        "Let me check.<｜tool▁calls▁begin｜>"
        + DS.format("get_weather", OSLO)
        + "\n"
        + DS.format("get_time", UTC)
        + "<｜tool▁calls▁end｜>",
    ),
}
META = {"id": "chatcmpl-x", "created": 0, "model": "m"}


class _NoFlow:
    def pause(self, exchange) -> None: ...
    def resume(self, exchange) -> None: ...


def _body(stream: bool) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        | {"stream": stream}
    )


def _pieces(text: str, size: int, finish: str = "stop") -> list[Reply]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        Reply(
            uid="u0", text=p, num_tokens=1, finish_reason=finish if i == len(pieces) - 1 else None
        )
        for i, p in enumerate(pieces)
    ]


async def _streamed(parser, text: str, size: int, finish: str = "stop"):
    """The official client's view of the stream, its replies delivered one at a time as the
    stream reads them (the exchange would join replies that wait): its state and events."""
    ex = Exchange(uids=["u0"], deadline=time.monotonic() + 60, flow=_NoFlow())
    replies = _pieces(text, size, finish)
    ex.deliver(replies[0])
    first = await ex.next_batch()

    async def deliver() -> None:
        for reply in replies[1:]:
            await asyncio.sleep(0.0005)  # the stream reads each before the next comes
            ex.deliver(reply)

    delivering = asyncio.create_task(deliver())
    state = ChatCompletionStreamState(input_tools=TOOLS)
    events = []
    async for raw in ChatAnswer(_body(True), parser).stream(ex, first, META):
        data = raw.decode().removeprefix("data: ").strip()
        if data == "[DONE]":
            break
        events += state.handle_chunk(ChatCompletionChunk.model_validate_json(data))
    await delivering
    return state, events


def _whole(parser, text: str) -> dict:
    ex = Exchange(uids=["u0"], deadline=time.monotonic() + 60, flow=_NoFlow())
    ex.keep([(0, Reply(uid="u0", text=text, num_tokens=1))])
    ex.choices[0].finish_reason = "stop"
    return ChatAnswer(_body(False), parser).whole(ex, META)["choices"][0]["message"]


@pytest.mark.parametrize("name", list(OUTPUTS))
@pytest.mark.parametrize("size", [1, 3, 10_000])
async def test_arguments_stream_in_pieces_and_assemble_into_the_whole_reply(name, size):
    fmt, text = OUTPUTS[name]
    parser = grammars.plan_tools(_body(False).tools, None, True, None, fmt).parser
    whole = _whole(parser, text)
    state, events = await _streamed(parser, text, size)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.content == whole["content"] == "Let me check."
    calls = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert calls == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]
    assert calls == [("get_weather", OSLO), ("get_time", UTC)]
    for index, (_, arguments) in enumerate(calls):
        pieces = [
            e.arguments_delta
            for e in events
            if e.type == "tool_calls.function.arguments.delta" and e.index == index
        ]
        assert "".join(pieces) == arguments
        if size < 10:  # the arguments went out as they came, not in one piece at the end
            assert len(pieces) >= len(arguments) // size - 1, pieces
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [json.loads(OSLO), json.loads(UTC)]


@pytest.mark.parametrize("name", list(OUTPUTS))
async def test_a_call_cut_off_keeps_the_arguments_it_streamed(name):
    fmt, text = OUTPUTS[name]
    parser = grammars.plan_tools(_body(False).tools, None, True, None, fmt).parser
    cut = text[: text.index('"Oslo"') + 4]
    state, _ = await _streamed(parser, cut, 2, finish="length")
    with pytest.raises(openai.LengthFinishReasonError):  # the client does not run it
        state.get_final_completion()
    final = state.current_completion_snapshot.choices[0]
    assert final.finish_reason == "length"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        ("get_weather", '{"city": "Osl')
    ]
    assert final.message.content == "Let me check."
