"""HTTP routes: OpenAI completions and chat completions, models, health, readiness, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenline import protocol
from tokenline.api import structured
from tokenline.api.errors import ApiError
from tokenline.api.exchange import Exchange
from tokenline.api.limits import check_request
from tokenline.api.pipeline import Pipeline
from tokenline.api.render import (
    NORMAL_ENDS,
    chat_events,
    completion_events,
    full_response,
    timings_header,
)
from tokenline.api.schemas import ChatCompletionRequest, CompletionRequest
from tokenline.api.sse import SSE_HEADERS
from tokenline.api.tool_parsers import ToolCallFormat, format_for
from tokenline.model_source import chat_template_text

router = APIRouter()


def _pipeline(request: Request) -> Pipeline:
    return request.app.state.pipeline


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    pipeline = _pipeline(request)
    problem = pipeline.problem()  # the same answer admission gives at this moment
    body = {
        "ready": problem is None,
        "problem": problem,
        "draining": pipeline.draining,
        "stages": {
            s: {"instance": st.instance, "waiting": st.waiting, "running": st.running}
            for s, st in pipeline.stage_statuses.items()
        },
    }
    return JSONResponse(body, status_code=200 if problem is None else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    name = _pipeline(request).model
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": request.app.state.started,
                "owned_by": "tokenline",
            }
        ],
    }


async def _tool_format(request: Request) -> ToolCallFormat:
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


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    structured.refuse_deprecated(body.functions, body.function_call)
    fmt = await _tool_format(request) if body.tools else None
    plan = structured.plan_tools(
        body.tools, body.tool_choice, body.parallel_tool_calls, body.response_format, fmt
    )
    body._tool_plan = plan
    messages = body.wire_messages()

    def build(uid: str, index: int) -> protocol.Generate:
        return protocol.Generate(
            uid=uid,
            sampling=msgspec.structs.replace(body.sampling(index), grammar=plan.grammar),
            messages=messages,
            tools=plan.tools,
            timeout_s=_pipeline(request).settings.request_timeout,
        )

    return await _serve(request, body, build, chat=True)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    grammar = structured.completion_grammar(body.response_format)

    def build(uid: str, index: int) -> protocol.Generate:
        return protocol.Generate(
            uid=uid,
            sampling=msgspec.structs.replace(body.sampling(index), grammar=grammar),
            prompt=body.prompt,
            timeout_s=_pipeline(request).settings.request_timeout,
        )

    return await _serve(request, body, build, chat=False)


# ── shared flow ────────────────────────────────────────────────────────────────────────────────
async def _watch_disconnect(request: Request, pipeline: Pipeline, ex: Exchange) -> None:
    """Turn a client disconnect into an abort the moment it happens, even mid-wait."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            pipeline.abort(ex, "client_disconnect")
            return


async def _serve(request: Request, body, build, chat: bool) -> Response:
    pipeline = _pipeline(request)
    if body.model != pipeline.model:
        raise ApiError(
            404,
            f"The model `{body.model}` does not exist; this server serves "
            f"`{pipeline.model}` (see /v1/models).",
            "model_not_found",
            "model",
        )
    check_request(body, request.app.state.settings)
    try:
        ex = pipeline.open(body.n, build)
    except (OverflowError, UnicodeError) as exc:
        # The schemas bound every field, so this is a gap in them; open() has already let go
        # of the request's uids.
        raise ApiError(
            400,
            f"the request holds a value the server cannot carry ({exc}); keep integers "
            "within their documented ranges and strings valid Unicode",
            "invalid_request_error",
        ) from exc
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
            "id": ("chatcmpl-" if chat else "cmpl-") + ex.uids[0],
            "created": int(time.time()),
            "model": pipeline.model,
        }
        if body.stream:
            events = (chat_events if chat else completion_events)(ex, body, first, meta)
            handed_over = True
            return ExchangeStream(events, pipeline, ex, watcher)
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
        return JSONResponse(full_response(ex, body, meta, chat), headers=headers)
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
