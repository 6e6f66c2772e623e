"""Tool calls as OpenAI shows them: ``message.tool_calls`` whole, ``delta.tool_calls`` streamed.

A streamed call goes out as its id, type and name first (arguments empty), then its arguments
in pieces, the way the official client's stream helpers assemble them: piece by piece as they
are generated where the parser can stream them (`tool_parsers.CallStart`), in one piece once
the call's markup closes where it cannot. The content around calls streams as it is generated.
"""

from __future__ import annotations

import secrets

from tokenline.api.function_calling.formats import ToolCallFormat
from tokenline.api.function_calling.parsers import (
    ArgumentsPiece,
    Call,
    CallEnd,
    CallStart,
    Content,
    Delta,
    ParsedCall,
)


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(call: ParsedCall, parser: ToolCallFormat) -> dict:
    return {
        "id": parser.call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _arguments(index: int, text: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A reply that stopped after calling tools says so; one cut off by length keeps length."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def message(text: str, parser: ToolCallFormat | None) -> tuple[dict, bool]:
    """The assistant message of a whole reply, and whether it holds calls."""
    if parser is None:
        return {"role": "assistant", "content": text}, False
    parsed = parser.parse(text)
    body: dict = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        body["tool_calls"] = [_call(c, parser) for c in parsed.calls]
    return body, bool(parsed.calls)


class DeltaStream:
    """One choice's streamed text turned into chat deltas: content pieces and call chunks."""

    def __init__(self, parser: ToolCallFormat) -> None:
        self._parser = parser
        self._stream = parser.stream()
        self.has_calls = False

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self._stream.feed(text))

    def finish(self) -> list[dict]:
        return self._deltas(self._stream.finish())

    def _deltas(self, deltas: list[Delta]) -> list[dict]:
        out: list[dict] = []
        for delta in deltas:
            if isinstance(delta, Content):
                out.append({"content": delta.text})
            elif isinstance(delta, Call):
                self.has_calls = True
                head = _call(delta.call, self._parser)
                arguments = head["function"]["arguments"]
                head["function"]["arguments"] = ""
                out.append({"tool_calls": [{"index": delta.index, **head}]})
                out.append(_arguments(delta.index, arguments))
            elif isinstance(delta, CallStart):
                self.has_calls = True
                head = _call(ParsedCall(delta.name, ""), self._parser)
                out.append({"tool_calls": [{"index": delta.index, **head}]})
            elif isinstance(delta, ArgumentsPiece):
                out.append(_arguments(delta.index, delta.text))
            elif isinstance(delta, CallEnd):
                pass  # every piece has gone out
        return out
