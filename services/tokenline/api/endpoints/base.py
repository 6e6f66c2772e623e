"""One generation request's life in the api: admit, wait for the first reply, answer.

Every generating route (chat, completions, responses) goes through `serve`; the routes say
what to send into the ring (``build``) and how the answer looks (a `Renderer`), this module
owns the rest: the model check, the limits, the disconnect watcher, the early-error status
code, and closing the exchange on every path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenline import protocol
from tokenline.api.endpoints.completions import NORMAL_ENDS, timings_header
from tokenline.api.http.errors import ApiError, unencodable
from tokenline.api.http.limits import check_request
from tokenline.api.http.sse import SSE_HEADERS
from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.ring.exchange import Exchange
from tokenline.api.ring.pipeline import Pipeline
from tokenline.api.tools.grammars import ToolPlan
from tokenline.api.tools.parsers import ToolCallFormat, format_for
from tokenline.model_source import chat_template_text

Build = Callable[[str, int], protocol.Generate]


@dataclass(frozen=True)
class Renderer:
    """How one kind of response looks: ``meta`` is id, created and model."""

    id_prefix: str
    # (exchange, first batch of replies, meta) -> SSE bytes
    stream: Callable[[Exchange, list, dict], AsyncIterator[bytes]]
    # (exchange, meta) -> the whole JSON body
    full: Callable[[Exchange, dict], dict]


def pipeline_of(request: Request) -> Pipeline:
    return request.app.state.pipeline


def check_model(request: Request, model: str | None) -> None:
    """A request for another model is a 404 in OpenAI's shape; None means "the one served"."""
    served = pipeline_of(request).model
    if model is not None and model != served:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{served}` (see /v1/models).",
            "model_not_found",
            "model",
        )


async def tool_format(request: Request) -> ToolCallFormat:
    """The model's tool-call format: --tool-call-parser, or read once from its chat template."""
    state = request.app.state
    if getattr(state, "tool_format", None) is None:
        settings = state.settings
        template = None
        if settings.tool_call_parser == "auto":
            template = await asyncio.to_thread(
                chat_template_text, settings.model, settings.model_cache_dir, settings.revision
            )
        state.tool_format = format_for(template, settings.tool_call_parser)
    return state.tool_format


def chat_builder(request: Request, chat: ChatCompletionRequest, plan: ToolPlan) -> Build:
    """What a chat request (or a Responses request turned into one) sends per choice."""
    messages = chat.wire_messages()
    timeout = pipeline_of(request).settings.request_timeout

    def build(uid: str, index: int) -> protocol.Generate:
        return protocol.Generate(
            uid=uid,
            sampling=msgspec.structs.replace(chat.sampling(index), grammar=plan.grammar),
            messages=messages,
            tools=plan.tools,
            timeout_s=timeout,
        )

    return build


async def _watch_disconnect(request: Request, pipeline: Pipeline, ex: Exchange) -> None:
    """Turn a client disconnect into an abort the moment it happens, even mid-wait."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            pipeline.abort(ex, "client_disconnect")
            return


async def serve(request: Request, body, n: int, build: Build, render: Renderer) -> Response:
    """Admit ``n`` choices built by ``build`` and answer as ``render`` says."""
    pipeline = pipeline_of(request)
    check_model(request, body.model)
    check_request(body, request.app.state.settings)
    try:
        ex = pipeline.open(n, build)
    except (OverflowError, UnicodeError) as exc:
        # The schemas bound every field, so this is a gap in them; open() has already let go
        # of the request's uids.
        raise unencodable(exc) from exc
    # One watcher for the request's whole life; a stream takes it over with the exchange.
    watcher = asyncio.create_task(_watch_disconnect(request, pipeline, ex))
    handed_over = False  # once an ExchangeStream owns the exchange, it closes it
    try:
        # Wait for the first reply before answering, so an early error (prompt too long,
        # stage down) gets its own status code instead of a broken 200 stream.
        first = await ex.next_batch()
        if ex.error is not None and not first:
            return ex.error.response()
        meta = {
            "id": render.id_prefix + ex.uids[0],
            "created": int(time.time()),
            "model": pipeline.model,
        }
        if body.stream:
            handed_over = True
            return ExchangeStream(render.stream(ex, first, meta), pipeline, ex, watcher)
        ex.keep(first)
        await ex.collect()
        pipeline.close(ex)
        if ex.error is not None:
            return ex.error.response()
        failed = [c for c in ex.choices if c.finish_reason not in NORMAL_ENDS]
        if failed:
            reason = failed[0].finish_reason
            return ApiError(500, f"generation ended with {reason}", "engine_error").response()
        headers = {"X-Tokenline-Timings": timings_header(ex)}
        return JSONResponse(render.full(ex, meta), headers=headers)
    finally:
        if not handed_over:
            watcher.cancel()
            pipeline.close(ex)


class ExchangeStream(StreamingResponse):
    """An SSE response that always closes its exchange and its disconnect watcher.

    It writes to the connection itself instead of through Starlette's ``StreamingResponse``,
    whose task group (ASGI before 2.4, what uvicorn speaks) starts the writer one event-loop
    turn later and adds a second disconnect listener: with 16 streams a turn took several
    milliseconds, and the first token waited 4.8 ms (p50) between reaching the api and being
    written, 1.5 ms here, where it is written in the turn it arrives. The exchange is closed in
    ``__call__``'s ``finally``, not in the generator: a generator that never started (client
    gone before the first byte) would never run its cleanup.
    """

    def __init__(
        self,
        events: AsyncIterator[bytes],
        pipeline: Pipeline,
        ex: Exchange,
        watcher: asyncio.Task,
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._pipeline, self._ex, self._watcher = pipeline, ex, watcher
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            async for chunk in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._watcher.cancel()
            self._pipeline.close(self._ex)
            await self._events.aclose()
