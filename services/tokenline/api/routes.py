"""HTTP routes: OpenAI completions and chat completions, models, health, readiness, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenline import protocol
from tokenline.api.errors import ApiError
from tokenline.api.exchange import Exchange
from tokenline.api.pipeline import Pipeline
from tokenline.api.schemas import ChatCompletionRequest, CompletionRequest
from tokenline.api.sse import DONE, SSE_HEADERS, event

router = APIRouter()
NORMAL_ENDS = ("stop", "length")


def _pipeline(request: Request) -> Pipeline:
    return request.app.state.pipeline


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    pipeline = _pipeline(request)
    body = {
        "ready": pipeline.ready,
        "draining": pipeline.draining,
        "stages": {
            s: {"instance": st.instance, "waiting": st.waiting, "running": st.running}
            for s, st in pipeline.stage_statuses.items()
        },
    }
    return JSONResponse(body, status_code=200 if pipeline.ready else 503)


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


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    messages = body.wire_messages()

    def build(uid: str, index: int) -> protocol.Generate:
        return protocol.Generate(
            uid=uid,
            sampling=body.sampling(index),
            messages=messages,
            timeout_s=_pipeline(request).settings.request_timeout,
        )

    return await _serve(request, body, build, chat=True)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    def build(uid: str, index: int) -> protocol.Generate:
        return protocol.Generate(
            uid=uid,
            sampling=body.sampling(index),
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


@contextlib.asynccontextmanager
async def _disconnect_watch(request: Request, pipeline: Pipeline, ex: Exchange):
    watcher = asyncio.create_task(_watch_disconnect(request, pipeline, ex))
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


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
    ex = pipeline.open(body.n, build)
    handed_over = False  # once an ExchangeStream owns the exchange, it closes it
    try:
        async with _disconnect_watch(request, pipeline, ex):
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
                events = (_chat_events if chat else _completion_events)(ex, body, first, meta)
                handed_over = True
                return ExchangeStream(events, request, pipeline, ex)
            ex.keep(first)
            await ex.collect()
        pipeline.close(ex)
        if ex.error is not None:
            return ex.error.response()
        failed = [c for c in ex.choices if c.finish_reason not in NORMAL_ENDS]
        if failed:
            reason = failed[0].finish_reason
            return ApiError(500, f"generation ended with {reason}", "engine_error").response()
        headers = {"X-Tokenline-Timings": _timings_header(ex)}
        return JSONResponse(_full_response(ex, body, meta, chat), headers=headers)
    finally:
        if not handed_over:
            pipeline.close(ex)


def _timings_header(ex: Exchange) -> str:
    return ", ".join(f"{k.removesuffix('_s')}={v * 1000:.3f}ms" for k, v in ex.timings.items())


def _usage(ex: Exchange) -> dict:
    completion = sum(c.completion_tokens for c in ex.choices)
    return {
        "prompt_tokens": ex.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": ex.prompt_tokens + completion,
    }


# ── logprobs ───────────────────────────────────────────────────────────────────────────────────
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM report this instead


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _chat_logprobs(entries: list[protocol.LogprobEntry]) -> dict:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _logprob(e.logprob),
                "bytes": e.bytes,
                "top_logprobs": [
                    {"token": t.token, "logprob": _logprob(t.logprob), "bytes": t.bytes}
                    for t in e.top
                ],
            }
            for e in entries
        ]
    }


def _completion_logprobs(entries: list[protocol.LogprobEntry], offset: int = 0) -> dict:
    """The legacy completions shape; ``offset``: where the first token's text starts."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": [{t.token: _logprob(t.logprob) for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def _full_response(ex: Exchange, body, meta: dict, chat: bool) -> dict:
    choices = []
    wanted = body.wanted_logprobs() is not None
    for choice in ex.choices:
        text = "".join(ex.texts[choice.index])
        entries = ex.logprobs[choice.index]
        if chat:
            choices.append(
                {
                    "index": choice.index,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": choice.finish_reason,
                    "logprobs": _chat_logprobs(entries) if wanted else None,
                }
            )
        else:
            choices.append(
                {
                    "index": choice.index,
                    "text": text,
                    "finish_reason": choice.finish_reason,
                    "logprobs": _completion_logprobs(entries) if wanted else None,
                }
            )
    return {
        **meta,
        "object": "chat.completion" if chat else "text_completion",
        "choices": choices,
        "usage": _usage(ex),
    }


class ExchangeStream(StreamingResponse):
    """An SSE response that always closes its exchange and watches for disconnects.

    The exchange is closed in ``__call__``'s ``finally``, not in the generator: a generator
    that never started (client gone before the first byte) would never run its cleanup.
    """

    def __init__(
        self, events: AsyncIterator[bytes], request: Request, pipeline: Pipeline, ex: Exchange
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._request, self._pipeline, self._ex = request, pipeline, ex
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with _disconnect_watch(self._request, self._pipeline, self._ex):
                await super().__call__(scope, receive, send)
        finally:
            self._pipeline.close(self._ex)
            await self._events.aclose()


def _coalesce(batch: list[tuple[int, protocol.Reply]]) -> list[tuple[int, protocol.Reply]]:
    """Merge consecutive pieces of one choice, so a client that fell behind gets fewer,
    larger events instead of one per token."""
    merged: list[tuple[int, protocol.Reply]] = []
    for index, reply in batch:
        if merged and merged[-1][0] == index and merged[-1][1].finish_reason is None:
            last = merged[-1][1]
            merged[-1] = (
                index,
                msgspec.structs.replace(
                    last,
                    text=last.text + reply.text,
                    num_tokens=last.num_tokens + reply.num_tokens,
                    finish_reason=reply.finish_reason,
                    logprobs=_merge_logprobs(last.logprobs, reply.logprobs),
                ),
            )
        else:
            merged.append((index, reply))
    return merged


def _merge_logprobs(
    first: list[protocol.LogprobEntry] | None, second: list[protocol.LogprobEntry] | None
) -> list[protocol.LogprobEntry] | None:
    if first is None or second is None:
        return first if second is None else second
    return first + second


async def _replies(ex: Exchange, first: list) -> AsyncIterator[tuple[int, protocol.Reply]]:
    batch = first
    while batch:
        for item in _coalesce(batch):
            yield item
        batch = await ex.next_batch()


def _error_event(ex: Exchange, reply: protocol.Reply | None) -> bytes:
    if ex.error is not None:
        return event(ex.error.body())
    reason = reply.finish_reason if reply else "error"
    return event(
        ApiError(
            500,
            f"generation ended with {reason}",
            reply.error_code if reply and reply.error_code else "engine_error",
        ).body()
    )


async def _chat_events(
    ex: Exchange, body: ChatCompletionRequest, first: list, meta: dict
) -> AsyncIterator[bytes]:
    head = {**meta, "object": "chat.completion.chunk"}
    wanted = body.wanted_logprobs() is not None

    def chunk(
        index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None
    ) -> bytes:
        return event(
            {
                **head,
                "choices": [
                    {
                        "index": index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                ],
            }
        )

    for choice in ex.choices:
        yield chunk(choice.index, {"role": "assistant", "content": ""})
    async for index, reply in _replies(ex, first):
        if wanted and reply.logprobs:
            # tokens whose text is still held back get their chunk now, with empty content
            yield chunk(index, {"content": reply.text}, logprobs=_chat_logprobs(reply.logprobs))
        elif reply.text:
            yield chunk(index, {"content": reply.text})
        if reply.finish_reason in NORMAL_ENDS:
            yield chunk(index, {}, reply.finish_reason)
        elif reply.finish_reason:
            yield _error_event(ex, reply)
            yield DONE
            return
    if ex.error is not None:
        yield _error_event(ex, None)
    elif body.include_usage:
        yield event({**head, "choices": [], "usage": _usage(ex)})
    yield DONE


async def _completion_events(
    ex: Exchange, body: CompletionRequest, first: list, meta: dict
) -> AsyncIterator[bytes]:
    head = {**meta, "object": "text_completion"}
    wanted = body.wanted_logprobs() is not None
    offsets = [0] * len(ex.choices)  # per choice: where the next token's text starts

    def chunk(index: int, reply: protocol.Reply, finish: str | None = None) -> bytes:
        logprobs = None
        if wanted:
            entries = reply.logprobs or []
            logprobs = _completion_logprobs(entries, offsets[index])
            offsets[index] += sum(len(e.token) for e in entries)
        return event(
            {
                **head,
                "choices": [
                    {
                        "index": index,
                        "text": reply.text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                ],
            }
        )

    async for index, reply in _replies(ex, first):
        if reply.finish_reason in NORMAL_ENDS:
            yield chunk(index, reply, reply.finish_reason)
        elif reply.finish_reason:
            yield _error_event(ex, reply)
            yield DONE
            return
        elif reply.text or (wanted and reply.logprobs):
            yield chunk(index, reply)
    if ex.error is not None:
        yield _error_event(ex, None)
    elif body.include_usage:
        yield event({**head, "choices": [], "usage": _usage(ex)})
    yield DONE
