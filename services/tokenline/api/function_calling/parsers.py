"""Tool calls in a model's own output format: finding them in text, whole or as a stream.

Each format (api/function_calling/formats.py) has a stream parser here that splits generated
text into content and calls, so `auto` replies can be parsed. No I/O: tests drive the parsers
directly.

A reply is parsed by feeding it to a stream parser in one piece, so a streamed reply and a
whole one always split into the same content and the same calls.

A Hermes call written as templates and the constrained grammar write it, name first, streams:
its name as soon as it is known (`CallStart`), its arguments' JSON text as it is generated
(`ArgumentsPiece`), then `CallEnd`.

Markup is never content. A call cut off (max_tokens) once its arguments have begun stays a
call, its arguments as far as they were written, as OpenAI returns one: the reply's
``finish_reason`` is ``length``, which tells a client not to run it. A call cut off before
its arguments begin, and a block in call markup that holds no call, are dropped: neither
content nor a call. Streamed or whole, a reply splits the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenline.api.function_calling.scanners import ObjectScanner


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Call:
    index: int  # the call's position among the reply's calls
    call: ParsedCall


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    """A streamed call is complete; ``call`` holds its whole arguments."""

    index: int
    call: ParsedCall


Delta = Content | Call | CallStart | ArgumentsPiece | CallEnd


@dataclass
class Parsed:
    content: str | None  # None when the reply held only calls
    calls: list[ParsedCall]


def _as_call(value: object, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded JSON value, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = value.get(key, {}) if key else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or not value["name"]:
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """Splits a reply, piece by piece, into content and calls."""

    def _stream_call(self, name: str, rest: str) -> list[Delta]:
        """Begin the call ``name`` whose arguments (``rest`` starts them) stream as they come;
        for the streams that keep ``_pending``, ``_calls`` and ``_streaming``."""
        self._pending = rest
        self._streaming = (name, ObjectScanner(), [])
        return [CallStart(self._calls, name)]

    def feed(self, text: str) -> list[Delta]:
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        deltas = self.feed(text) + self.finish()
        content = "".join(d.text for d in deltas if isinstance(d, Content))
        calls = [d.call for d in deltas if isinstance(d, Call | CallEnd)]
        return Parsed(content if content or not calls else None, calls)


@dataclass
class CallsFirst(ToolCallStream):
    """A reply that is calls from its first character (``opening`` first) or else an answer
    that holds none, as the grammar of tools in auto beside a JSON ``response_format`` makes
    it: a marker inside the answer (in a JSON string) is the answer's text, never a call."""

    inner: ToolCallStream
    opening: str
    _pending: str = ""
    _mode: str = ""  # "" undecided, "calls" or "answer"

    def feed(self, text: str) -> list[Delta]:
        if self._mode == "calls":
            return self.inner.feed(text)
        if self._mode == "answer":
            return [Content(text)] if text else []
        self._pending += text
        if self.opening.startswith(self._pending):
            return []  # still possibly the opening
        pending, self._pending = self._pending, ""
        if pending.startswith(self.opening):
            self._mode = "calls"
            return self.inner.feed(pending)
        self._mode = "answer"
        return [Content(pending)]

    def finish(self) -> list[Delta]:
        if self._mode == "answer":
            return []
        pending, self._pending, self._mode = self._pending, "", "calls"
        return self.inner.feed(pending) + self.inner.finish()


# A call's head as templates and the grammar write it: name first, then the arguments object.
_STREAMABLE_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)'
)


@dataclass
class HermesStream(ToolCallStream):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among plain text.

    Content streams as it arrives, except an end that may be the start of ``<tool_call>``
    (held until the next piece settles it) and whitespace next to a call (dropped, as the
    template put it there, not the answer).
    """

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    _pending: str = ""
    _in_call: bool = False
    _after_call: bool = False  # drop the whitespace that follows a call
    _calls: int = 0
    _held_space: str = ""
    # the call whose arguments are streaming: its name, scanner and the arguments so far
    _streaming: tuple[str, ObjectScanner, list[str]] | None = None

    def _content(self, text: str, final: bool = False) -> list[Delta]:
        if self._after_call:
            text = text.lstrip()
            if text:
                self._after_call = False
        text = self._held_space + text
        stripped = text.rstrip()
        self._held_space = "" if final else text[len(stripped) :]
        if final:
            stripped = text
        return [Content(stripped)] if stripped else []

    def _block(self, body: str) -> list[Delta]:
        try:
            call = _as_call(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        self._held_space = ""
        if call is None:  # markup that holds no call: dropped, never shown as content
            return []
        self._after_call = True
        self._calls += 1
        return [Call(self._calls - 1, call)]

    def _stream_arguments(self) -> list[Delta]:
        _, scanner, pieces = self._streaming
        if scanner.closed:
            return []
        size = scanner.take(self._pending)
        piece, self._pending = self._pending[:size], self._pending[size:]
        if not piece:
            return []
        pieces.append(piece)
        return [ArgumentsPiece(self._calls, piece)]

    def _end_streamed(self) -> list[Delta]:
        name, _, pieces = self._streaming
        self._streaming = None
        self._after_call = True
        self._calls += 1
        return [CallEnd(self._calls - 1, ParsedCall(name, "".join(pieces)))]

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        out: list[Delta] = []
        while True:
            if self._in_call and self._streaming is not None:
                out += self._stream_arguments()
                end = self._pending.find(self.CLOSE)
                if not self._streaming[1].closed or end < 0:
                    return out
                self._pending = self._pending[end + len(self.CLOSE) :]
                self._in_call = False
                out += self._end_streamed()
                continue
            if self._in_call:
                head = _STREAMABLE_HEAD.match(self._pending)
                if head is not None:
                    self._held_space = ""
                    out += self._stream_call(head.group(1), self._pending[head.end() :])
                    continue
                end = self._pending.find(self.CLOSE)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(self.CLOSE) :]
                self._in_call = False
                out += self._block(body)
                continue
            start = self._pending.find(self.OPEN)
            if start >= 0:
                before = self._pending[:start]
                self._pending = self._pending[start + len(self.OPEN) :]
                out += self._content(before)
                self._held_space = ""  # the newline before a call belongs to the markup
                self._in_call = True
                continue
            keep = _held_prefix(self._pending, self.OPEN)
            ready = self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep :]
            return out + self._content(ready)

    def finish(self) -> list[Delta]:
        if self._streaming is not None:  # ended before its closing tag: the call as written
            self._in_call = False
            self._pending = ""
            return self._end_streamed()
        pending, self._pending = self._pending, ""
        if self._in_call:  # ended before its closing tag: a call if its JSON is whole
            self._in_call = False
            try:
                call = _as_call(json.loads(pending), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:  # cut before its arguments began: dropped
                return []
            self._calls += 1
            return [Call(self._calls - 1, call)]
        if self._calls:
            return self._content(pending.rstrip(), final=True) if pending.strip() else []
        return self._content(pending, final=True)


@dataclass
class Llama3JsonStream(ToolCallStream):
    """Llama 3's JSON calls: the whole reply is ``{"name": ..., "parameters": {...}}`` (several
    joined by ``;``), optionally after ``<|python_tag|>``.

    Whether a reply is a call shows only at its end, so a reply that starts like one (``{`` or
    the tag) is held until then; any other streams as content at once.
    """

    TAG = "<|python_tag|>"

    _pending: str = ""
    _decided: bool = False  # True once the reply is known to be plain content

    def feed(self, text: str) -> list[Delta]:
        if self._decided:
            return [Content(text)] if text else []
        self._pending += text
        head = self._pending.lstrip()
        if not head or self.TAG.startswith(head) or head.startswith(("{", self.TAG)):
            return []
        self._decided = True
        pending, self._pending = self._pending, ""
        return [Content(pending)]

    def finish(self) -> list[Delta]:
        pending, self._pending = self._pending, ""
        if self._decided:
            return []
        calls = self._calls(pending.strip().removeprefix(self.TAG))
        if calls:
            return [Call(i, c) for i, c in enumerate(calls)]
        if self._looks_like_a_call(pending):  # a call cut off, or markup holding none
            return []
        return [Content(pending)] if pending else []

    @classmethod
    def _looks_like_a_call(cls, text: str) -> bool:
        head = text.strip()
        if head.startswith(cls.TAG):
            return True
        try:
            json.loads(head)
            return False  # a whole JSON document that is no call: an answer, content
        except ValueError:
            pass
        compact = re.sub(r"\s+", "", head)
        opening = '{"name"'
        return compact.startswith(opening) or (bool(compact) and opening.startswith(compact))

    @staticmethod
    def _calls(text: str) -> list[ParsedCall] | None:
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        position = 0
        while position < len(text):
            try:
                value, position = decoder.raw_decode(text, position)
            except ValueError:
                return None
            call = _as_call(value, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = text[position:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            position = len(text) - len(rest.removeprefix(";").lstrip())
        return calls
