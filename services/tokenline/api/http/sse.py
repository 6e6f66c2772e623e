"""Server-sent events framing for OpenAI streams."""

from __future__ import annotations

import msgspec

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies such as nginx must not buffer the stream
}
DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode  # compact UTF-8, one event per token: kept cheap


def event(payload: dict) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"
