"""Server-sent events framing for OpenAI streams."""

from __future__ import annotations

import json

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies such as nginx must not buffer the stream
}
DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    return (
        b"data: "
        + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        + (b"\n\n")
    )
