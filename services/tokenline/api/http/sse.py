"""Server-sent events: the one encoder of every stream, the response that sends them, and the
usage a chat or completions stream reports.

Each endpoint turns its exchange's replies into its own events and calls these helpers; they
never call an endpoint back. Chat and completions send ``data:`` lines ending in
``data: [DONE]``; the Responses API names each event (``event: <type>`` before its ``data:``)
and sends no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import msgspec
from fastapi.responses import StreamingResponse

from tokenline.api.openai.usage import Usage
from tokenline.api.ring.exchange import Exchange
from tokenline.protocol import Reply

log = logging.getLogger(__name__)
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies such as nginx must not buffer the stream
}
DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode  # compact UTF-8, one event per token: kept cheap


def event(payload: dict, name: str | None = None) -> bytes:
    """One event: ``data: {...}``, preceded by ``event: name`` when it has one."""
    data = b"data: " + _encode(payload) + b"\n\n"
    return data if name is None else b"event: " + name.encode() + b"\n" + data


class EventStream(StreamingResponse):
    """An SSE response that always runs ``on_close`` (closing the exchange and its disconnect
    watcher), however it ends; ``on_close`` gets the exception the events raised (the
    endpoint's own code failed, not the client), else None.

    It writes to the connection itself instead of through Starlette's ``StreamingResponse``,
    whose task group (ASGI before 2.4, what uvicorn speaks) starts the writer one event-loop
    turn later and adds a second disconnect listener: with 16 streams a turn took several
    milliseconds, and the first token waited 4.8 ms (p50) between reaching the api and being
    written, 1.5 ms here, where it is written in the turn it arrives. ``on_close`` runs in
    ``__call__``'s ``finally``, not in the generator: a generator that never started (client
    gone before the first byte) would never run its cleanup.
    """

    def __init__(
        self, events: AsyncIterator[bytes], on_close: Callable[[Exception | None], None]
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events, self._on_close = events, on_close
        self._task: asyncio.Task | None = None
        self._cut = False

    def cut_off(self) -> None:
        """End the response now, even while a write waits for a client that stopped reading
        (uvicorn's wait for the socket has no timeout): the connection is closed unfinished."""
        self._cut = True
        if self._task is not None:
            self._task.cancel()

    async def __call__(self, scope, receive, send) -> None:
        failure: Exception | None = None
        self._task = asyncio.current_task()
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            while not self._cut:
                try:
                    chunk = await anext(self._events)
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    failure = exc
                    raise
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not self._cut:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self._cut:
                raise
            # Ours: returning with the response unfinished makes uvicorn close the connection.
            self._task.uncancel()
            log.info("a stream to a client that stopped reading was cut off")
        finally:
            self._task = None
            self._on_close(failure)
            await self._events.aclose()


class RunningUsage:
    """Usage as a chat or completions stream has sent it so far (vLLM's
    ``continuous_usage_stats``); ``body`` is the request, ``per_prompt`` its n."""

    def __init__(self, ex: Exchange, body, per_prompt: int) -> None:
        self._ex, self._body, self._per_prompt = ex, body, per_prompt
        self._sent = [0] * len(ex.choices)

    def sent(self, index: int, reply: Reply) -> None:
        self._sent[index] += reply.num_tokens

    def of_chunk(self) -> dict:
        """What a chunk before the last says of usage: nothing unless asked, then null
        (OpenAI), or the usage so far with ``continuous_usage_stats`` (vLLM)."""
        if not self._body.include_usage:
            return {}
        if not self._body.continuous_usage:
            return {"usage": None}
        ex = self._ex
        usage = Usage.of(ex.choices, ex.cached_tokens, self._per_prompt, sum(self._sent))
        return {"usage": usage.completions_shape()}

    def final_events(self, head: dict) -> list[bytes]:
        """The stream's end: the request's error, or the usage if asked; then [DONE]."""
        ex = self._ex
        if ex.error is not None:
            return [event(ex.error.body()), DONE]
        if self._body.include_usage:
            usage = Usage.of(ex.choices, ex.cached_tokens, self._per_prompt).completions_shape()
            return [event({**head, "choices": [], "usage": usage}), DONE]
        return [DONE]
