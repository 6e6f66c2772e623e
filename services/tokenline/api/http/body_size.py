"""The body size limit (--max-body-size), checked before a request's body is held.

Pure ASGI middleware: a declared ``Content-Length`` over the limit is refused before a byte of
the body is read, and a chunked body is counted as it arrives and refused the moment it passes
the limit, so an oversized body is never held in memory. What a parsed request may ask of the
stages is api/openai/request_limits.py.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenline.api.http.errors import ApiError


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` while a body is read. An HTTPException, because FastAPI turns any
    other exception met while reading a body into a 400 "error parsing the body"."""

    def __init__(self, limit: int) -> None:
        # close: the rest of an oversized body is not worth reading to keep the connection
        super().__init__(413, _too_large_message(limit), headers={"connection": "close"})


def _too_large_message(limit: int) -> str:
    return (
        f"the request body is larger than this server accepts ({limit} bytes, "
        "--max-body-size); send a smaller request"
    )


def _error_bytes(status: int, message: str, code: str) -> tuple[dict, bytes]:
    body = json.dumps(ApiError(status, message, code).body()).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),  # the unread rest of the body is not waited for
        ],
    }
    return start, body


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                declared = value
                break
        if declared is not None:
            refusal = None
            if not declared.strip().isdigit():
                message = "the Content-Length header is not a number"
                refusal = (400, message, "invalid_request_error")
            elif int(declared) > self.max_bytes:
                refusal = (413, _too_large_message(self.max_bytes), "request_too_large")
            if refusal is not None:
                start, body = _error_bytes(*refusal)
                await send(start)
                await send({"type": "http.response.body", "body": body})
                return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            # Read outside FastAPI's body parsing (its handlers answer it there): answer here.
            if started:
                raise
            start, body = _error_bytes(413, _too_large_message(self.max_bytes), "request_too_large")
            await send(start)
            await send({"type": "http.response.body", "body": body})
