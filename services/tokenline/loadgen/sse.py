"""Server-Sent Events decoding and reading OpenAI stream chunks.

``SSEDecoder`` follows the SSE field rules that matter for OpenAI streams: ``data:`` lines
(one optional space after the colon is dropped) accumulate, joined by newlines, until a blank
line dispatches the event; comment lines (``:``) and other fields are ignored. ``read_chunk``
turns one decoded ``data`` payload into what the load generator counts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SSEDecoder:
    """Line-at-a-time SSE decoder: feed lines (without line endings), get event data back."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Take one line; return the event's data when this line completes an event."""
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, sep, value = line.partition(":")
        if not sep:
            field, value = line, ""
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        return None

    def flush(self) -> str | None:
        """Dispatch the pending event, if any (also used at end of stream)."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


async def iter_sse_data(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """Yield the data of each SSE event as soon as its last line arrives.

    A final event without its trailing blank line is still delivered at end of stream.
    """
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield data
    data = decoder.flush()
    if data is not None:
        yield data


@dataclass(frozen=True)
class Chunk:
    """What one OpenAI stream chunk tells the load generator."""

    text: str = ""
    completion_tokens: int | None = None  # from a `usage` object, when the chunk has one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    error: str | None = None


def _choice_text(choice: dict[str, Any], endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        parts = [delta.get(key) for key in ("content", "reasoning_content", "reasoning")]
        return "".join(part for part in parts if isinstance(part, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def read_chunk(data: str, endpoint: str) -> Chunk:
    """Read one ``data`` payload of a ``completions`` or ``chat`` stream.

    Raises ``ValueError`` when the payload is not a JSON object.
    """
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"stream chunk is not a JSON object: {data[:200]!r}")
    if obj.get("error") is not None:
        error = obj["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return Chunk(error=str(message))
    text, finish_reason = "", None
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            text = _choice_text(choice, endpoint)
            finish_reason = choice.get("finish_reason")
    usage = obj.get("usage")
    completion_tokens = prompt_tokens = cached_tokens = None
    if isinstance(usage, dict):
        completion_tokens = usage.get("completion_tokens")
        prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached_tokens = details.get("cached_tokens")
    return Chunk(
        text=text,
        completion_tokens=completion_tokens,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        finish_reason=finish_reason,
    )
