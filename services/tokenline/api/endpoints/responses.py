"""``POST /v1/responses``, stateless: a chat completion in other clothes.

The request is translated into a chat completion request (api/openai/responses_as_chat.py),
so limits, tool plans and grammars are the very code chat runs; only the answer differs: a
response object, whole or built up by a stream of events. One `OutputBuilder` turns a reply's
text into output items (messages and function calls), whether the text arrives at once or
piece by piece, so a streamed response always ends in the very object the non-streamed one is.
Events are framed as the real API frames them (``event: <type>`` then ``data: {...}``, each
with a ``sequence_number``), with no ``data: [DONE]`` after the terminal event.

Nothing is stored: ``previous_response_id`` and ``conversation`` are refused, ``store`` is
answered ``false``, and the retrieval routes say so (`not_stored`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from tokenline.api.endpoints.chat import Chat, grammar_param
from tokenline.api.function_calling.chat_calls import call_id
from tokenline.api.function_calling.formats import ToolCallFormat
from tokenline.api.function_calling.parsers import ArgumentsPiece, Call, CallEnd, CallStart, Content
from tokenline.api.http.errors import ApiError
from tokenline.api.http.sse import event
from tokenline.api.openai.responses import ResponsesRequest
from tokenline.api.openai.responses_as_chat import renamed, to_chat
from tokenline.api.openai.usage import Usage
from tokenline.api.ring.exchange import NORMAL_ENDS, Exchange


class Responses(Chat):
    """Chat's plan and ring messages, with the Responses API's request and answer."""

    id_prefix = "resp_"

    async def create(self, body: ResponsesRequest) -> Response:  # type: ignore[override]
        chat = to_chat(body)
        try:
            plan = await self.plan(chat)
            self.admit(chat, grammar_param(plan))
            answer = ResponsesAnswer(body, plan.parser)
            return await self.generate(chat, self.messages(chat, plan), answer)
        except ApiError as exc:  # the tool plan and the limits name chat's fields
            raise renamed(exc) from exc

    def named(self, error: ApiError) -> ApiError:
        return renamed(error)


def not_stored(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"no response {response_id!r}: this server stores no responses (its Responses API is "
        "stateless); keep the output you were sent, and send the whole conversation as input",
        "not_found",
    )


def _usage(ex: Exchange) -> dict:
    return Usage.of(ex.choices, ex.cached_tokens).responses_shape()


def echo(body: ResponsesRequest) -> dict:
    """The request's settings as the response object repeats them."""
    tools = [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
            "strict": t.strict,
        }
        for t in body.tools or []
    ]
    fmt: dict[str, Any] = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True)
    return {
        "background": False,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "prompt_cache_key": body.prompt_cache_key,
        "reasoning": None,
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "store": False,  # whatever was asked: nothing is kept
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": tools,
        "top_logprobs": None,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
    }


def _where(item: dict, index: int) -> dict:
    """Where an event about an item's one content part points."""
    return {"item_id": item["id"], "output_index": index, "content_index": 0}


class OutputBuilder:
    """One response's output items and, when ``emit``, the events that build them."""

    def __init__(
        self, meta: dict, body: ResponsesRequest, parser: ToolCallFormat | None, emit: bool
    ):
        self.response: dict[str, Any] = {
            "id": meta["id"],
            "object": "response",
            "created_at": meta["created"],
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "model": meta["model"],
            "output": [],
            "usage": None,
            **echo(body),
        }
        self._calls = parser.stream() if parser is not None else None
        self._new_call_id = parser.call_id if parser is not None else call_id
        self._emit = emit
        self._sequence = 0
        self._message: dict | None = None  # the message item text is streaming into
        self._reasoning: dict | None = None  # the reasoning item thinking is streaming into
        self._thoughts: list[str] = []
        self._open_call: dict | None = None  # the function_call item arguments stream into
        self._pieces: list[str] = []

    # ── events ─────────────────────────────────────────────────────────────────────────────────
    def _event(self, out: list[bytes], kind: str, **fields: Any) -> None:
        if self._emit:
            out.append(event({"type": kind, "sequence_number": self._sequence, **fields}, kind))
        self._sequence += 1

    def _lifecycle(self, out: list[bytes], kind: str) -> None:
        self._event(out, kind, response=self.response)

    def start(self) -> list[bytes]:
        out: list[bytes] = []
        self._lifecycle(out, "response.created")
        self._lifecycle(out, "response.in_progress")
        return out

    # ── items ──────────────────────────────────────────────────────────────────────────────────
    def _add(self, out: list[bytes], item: dict) -> int:
        index = len(self.response["output"])
        self.response["output"].append(item)
        self._event(out, "response.output_item.added", output_index=index, item=item)
        return index

    def _open(self, out: list[bytes], item: dict, part: dict) -> None:
        """Add an item of one content part, announced as the real API announces it."""
        index = self._add(out, item)
        item["content"].append(part)
        self._event(out, "response.content_part.added", **_where(item, index), part=part)

    def _close(
        self, out: list[bytes], item: dict, part: dict, done: str, status: str, **fields: Any
    ) -> None:
        """End an item `_open` added: its part whole, its ``done`` event, then the item's."""
        index = self.response["output"].index(item)
        item["content"][0] = part
        self._event(out, done, **_where(item, index), **fields)
        self._event(out, "response.content_part.done", **_where(item, index), part=part)
        item["status"] = status
        self._event(out, "response.output_item.done", output_index=index, item=item)

    def _thought(self, out: list[bytes], text: str) -> None:
        if self._reasoning is None:
            item = {
                "type": "reasoning",
                "id": "rs_" + secrets.token_hex(12),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            self._open(out, item, {"type": "reasoning_text", "text": ""})
            self._reasoning, self._thoughts = item, []
        self._thoughts.append(text)
        where = _where(self._reasoning, len(self.response["output"]) - 1)
        self._event(out, "response.reasoning_text.delta", **where, delta=text)

    def _close_reasoning(self, out: list[bytes], status: str = "completed") -> None:
        item, self._reasoning = self._reasoning, None
        if item is not None:
            text = "".join(self._thoughts)
            part = {"type": "reasoning_text", "text": text}
            self._close(out, item, part, "response.reasoning_text.done", status, text=text)

    def _text(self, out: list[bytes], text: str) -> None:
        self._close_reasoning(out)
        if self._message is None:
            item = {
                "type": "message",
                "id": "msg_" + secrets.token_hex(12),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open(out, item, part)
            self._message, self._pieces = item, []
        if text:
            self._pieces.append(text)
            where = _where(self._message, len(self.response["output"]) - 1)
            self._event(out, "response.output_text.delta", **where, delta=text, logprobs=[])

    def _close_message(self, out: list[bytes], status: str = "completed") -> None:
        item, self._message = self._message, None
        if item is not None:
            text = "".join(self._pieces)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done = "response.output_text.done"
            self._close(out, item, part, done, status, text=text, logprobs=[])

    def _call_start(self, out: list[bytes], name: str) -> None:
        self._close_reasoning(out)
        self._close_message(out)
        item = {
            "type": "function_call",
            "id": "fc_" + secrets.token_hex(12),
            "call_id": self._new_call_id(),
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self._add(out, item)
        self._open_call = item

    def _call_arguments(self, out: list[bytes], text: str) -> None:
        item = self._open_call
        item["arguments"] += text
        where = {"item_id": item["id"], "output_index": self.response["output"].index(item)}
        self._event(out, "response.function_call_arguments.delta", **where, delta=text)

    def _call_end(self, out: list[bytes]) -> None:
        item, self._open_call = self._open_call, None
        index = self.response["output"].index(item)
        where = {"item_id": item["id"], "output_index": index}
        self._event(
            out,
            "response.function_call_arguments.done",
            **where,
            name=item["name"],
            arguments=item["arguments"],
        )
        item["status"] = "completed"
        self._event(out, "response.output_item.done", output_index=index, item=item)

    def _deltas(self, out: list[bytes], deltas: list) -> None:
        for delta in deltas:
            if isinstance(delta, Content):
                self._text(out, delta.text)
            elif isinstance(delta, Call):  # known whole: started, given and ended at once
                self._call_start(out, delta.call.name)
                self._call_arguments(out, delta.call.arguments)
                self._call_end(out)
            elif isinstance(delta, CallStart):
                self._call_start(out, delta.name)
            elif isinstance(delta, ArgumentsPiece):
                self._call_arguments(out, delta.text)
            elif isinstance(delta, CallEnd):
                self._call_end(out)

    # ── the reply ──────────────────────────────────────────────────────────────────────────────
    def think(self, thought: str) -> list[bytes]:
        """The model's thinking, before its answer: one reasoning item."""
        out: list[bytes] = []
        if thought:
            self._thought(out, thought)
        return out

    def feed(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._calls is None:
            if text:
                self._text(out, text)
        elif text:
            self._deltas(out, self._calls.feed(text))
        return out

    def finish(self, finish_reason: str, used: dict) -> list[bytes]:
        """End on ``stop`` or ``length``: close the open items, then the response."""
        out: list[bytes] = []
        if self._calls is not None:
            self._deltas(out, self._calls.finish())
        cut = finish_reason == "length"
        thought_only = all(i["type"] == "reasoning" for i in self.response["output"])
        if thought_only and not (cut and self._reasoning is not None):
            # a reply with nothing in it is still an (empty) message; one cut while thinking
            # ends with its thinking
            self._text(out, "")
        self._close_reasoning(out, "incomplete" if cut else "completed")
        self._close_message(out, "incomplete" if cut else "completed")
        self.response["usage"] = used
        if cut:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            self._lifecycle(out, "response.incomplete")
        else:
            self.response["status"] = "completed"
            self.response["completed_at"] = int(time.time())
            self._lifecycle(out, "response.completed")
        return out

    def fail(self, error: ApiError, used: dict) -> list[bytes]:
        """End mid-stream on an error: an ``error`` event, then ``response.failed``."""
        out: list[bytes] = []
        self._event(out, "error", code=error.code, message=error.message, param=error.param)
        self.response["status"] = "failed"
        self.response["usage"] = used
        # the response object's error codes are OpenAI's; ours rides in the message
        self.response["error"] = {
            "code": "server_error",
            "message": f"{error.message} ({error.code})",
        }
        self._lifecycle(out, "response.failed")
        return out


class ResponsesAnswer:
    """A response's one choice read as a response object, or as the events that build it."""

    def __init__(self, body: ResponsesRequest, parser: ToolCallFormat | None) -> None:
        self.body, self.parser = body, parser

    def whole(self, ex: Exchange, meta: dict) -> dict:
        builder = OutputBuilder(meta, self.body, self.parser, emit=False)
        builder.start()
        builder.think("".join(ex.reasoning[0]))
        builder.feed("".join(ex.texts[0]))
        builder.finish(ex.choices[0].finish_reason or "stop", _usage(ex))
        return builder.response

    async def stream(self, ex: Exchange, first: list, meta: dict) -> AsyncIterator[bytes]:
        builder = OutputBuilder(meta, self.body, self.parser, emit=True)
        for chunk in builder.start():
            yield chunk
        async for _, reply in ex.replies(first):
            for chunk in builder.think(reply.reasoning):
                yield chunk
            for chunk in builder.feed(reply.text):
                yield chunk
            if reply.finish_reason in NORMAL_ENDS:
                for chunk in builder.finish(reply.finish_reason, _usage(ex)):
                    yield chunk
                return
            if reply.finish_reason:
                for chunk in builder.fail(renamed(ex.error_for(reply)), _usage(ex)):
                    yield chunk
                return
        # over without a terminal reply: aborted (deadline, shutdown, a stage failing)
        for chunk in builder.fail(renamed(ex.error_for(None)), _usage(ex)):
            yield chunk
