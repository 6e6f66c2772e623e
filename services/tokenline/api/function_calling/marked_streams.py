"""Stream parsers for formats whose calls sit in marked blocks among free text: DeepSeek-V3's
``<｜tool▁calls▁begin｜>`` block and Qwen3-Coder's ``<tool_call><function=...>`` XML.

They share `MarkedStream`: content streams until a block opens (an end of a piece that may be
the opening marker's start is held until the next piece settles it), and the block's closing
marker returns to content. A DeepSeek-V3 call written as its template and the grammar write it
(the name, then a fenced JSON object) streams as a Hermes one does: its name once known, its
arguments' JSON text as it is generated, then its end; a call cut off once its arguments have
begun stays a call, as far as it was written (``finish_reason`` says ``length``). Any other
call (Qwen3-Coder's, one whose arguments are no object) is handed out whole once its own
closing markup has arrived, and dropped if cut off before it. As in parsers.py, markup is never
content and whitespace next to a call belongs to the markup. A reply splits the same way in
any pieces: every decision waits until the text settles it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from tokenline.api.function_calling.parsers import (
    ArgumentsPiece,
    Call,
    CallEnd,
    Content,
    Delta,
    ParsedCall,
    ToolCallStream,
    _held_prefix,
)
from tokenline.api.function_calling.scanners import ObjectScanner


@dataclass
class MarkedStream(ToolCallStream):
    """Free text with blocks between ``OPEN`` and ``CLOSE`` that hold calls."""

    OPEN = ""
    CLOSE = ""
    CALL_START = ""  # what begins one call inside the block
    CALL_END = ""  # what ends a call whose arguments were streamed

    _pending: str = ""
    _in_block: bool = False
    _space: str = ""  # trailing whitespace of content, sent only if more content follows
    _after_block: bool = False
    _calls: int = 0
    _calls_before_block: int = 0
    # the call whose arguments are streaming: its name, scanner and the arguments so far
    _streaming: tuple[str, ObjectScanner, list[str]] | None = None
    _skipping: bool = False  # a streamed call's arguments closed; its own markup follows

    def _head(self, body: str) -> re.Match | None:
        """A streamable call's head at the start of ``body`` (its name in group 1), whose
        arguments object starts right after it; None: none (yet)."""
        return None

    def _stream_arguments(self) -> list[Delta]:
        _, scanner, pieces = self._streaming
        size = scanner.take(self._pending)
        piece, self._pending = self._pending[:size], self._pending[size:]
        out: list[Delta] = []
        if piece:
            pieces.append(piece)
            out.append(ArgumentsPiece(self._calls, piece))
        if scanner.closed:
            out += self._end_streamed()
            self._skipping = True
        return out

    def _end_streamed(self) -> list[Delta]:
        name, _, pieces = self._streaming
        self._streaming = None
        self._calls += 1
        return [CallEnd(self._calls - 1, ParsedCall(name, "".join(pieces)))]

    def _take_calls(self, body: str) -> tuple[list[ParsedCall | None], int]:
        """The calls complete at the start of ``body`` (None for one that holds no call) and
        how much of it they used."""
        raise NotImplementedError

    def _content(self, text: str) -> list[Delta]:
        if self._after_block:
            text = text.lstrip()
            if not text:
                return []
            self._after_block = False
        text = self._space + text
        ready = text.rstrip()
        self._space = text[len(ready) :]
        return [Content(ready)] if ready else []

    def _close_block(self) -> None:
        # whitespace after a call belongs to its markup; after a block of none, to the text
        self._in_block = False
        self._after_block = self._calls > self._calls_before_block

    def _emit(self, calls: list[ParsedCall | None]) -> list[Delta]:
        out: list[Delta] = []
        for call in calls:
            if call is not None:
                out.append(Call(self._calls, call))
                self._calls += 1
        return out

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        out: list[Delta] = []
        while True:
            if self._streaming is not None:
                out += self._stream_arguments()
                if self._streaming is not None:
                    return out
                continue
            if self._skipping:  # the rest of a streamed call's markup: never content
                end = self._pending.find(self.CALL_END)
                close = self._pending.find(self.CLOSE)
                if end < 0 and close < 0:
                    return out
                self._skipping = False
                if end < 0 or 0 <= close < end:  # the block ends with the call unclosed
                    self._pending = self._pending[close + len(self.CLOSE) :]
                    self._close_block()
                    continue
                self._pending = self._pending[end + len(self.CALL_END) :]
                continue
            if self._in_block:
                head = self._head(self._pending)
                if head is not None:
                    out += self._stream_call(head.group(1), self._pending[head.end() :])
                    continue
                calls, used = self._take_calls(self._pending)
                self._pending = self._pending[used:]
                out += self._emit(calls)
                if used:
                    continue
                end = self._pending.find(self.CLOSE)
                if end < 0 or self.CALL_START in self._pending[:end]:
                    return out  # the block or its next call is still being written
                self._pending = self._pending[end + len(self.CLOSE) :]
                self._close_block()
                continue
            start = self._pending.find(self.OPEN)
            if start >= 0:
                out += self._content(self._pending[:start])
                self._space = ""  # whitespace before a block belongs to its markup
                self._pending = self._pending[start + len(self.OPEN) :]
                self._in_block, self._calls_before_block = True, self._calls
                continue
            keep = _held_prefix(self._pending, self.OPEN)
            ready, self._pending = (
                self._pending[: len(self._pending) - keep],
                self._pending[len(self._pending) - keep :],
            )
            return out + self._content(ready)

    def finish(self) -> list[Delta]:
        if self._streaming is not None or self._skipping:  # cut off: the call as written
            self._pending, self._in_block, self._skipping = "", False, False
            return self._end_streamed() if self._streaming is not None else []
        pending, self._pending = self._pending, ""
        if self._in_block:  # an unclosed block: its whole calls count, a cut-off one does not
            self._in_block = False
            return self._emit(self._take_calls(pending)[0])
        out = self._content(pending)
        if self._space and not self._calls:
            out.append(Content(self._space))
        self._space = ""
        return out


def _arguments_object(text: str) -> str | None:
    """JSON text of an arguments object, or None when ``text`` is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


# ── DeepSeek-V3 ────────────────────────────────────────────────────────────────────────────────
DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALLS_END = "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEK_CALL_END = "<｜tool▁call▁end｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"
_DEEPSEEK_CALL = re.compile(
    re.escape(DEEPSEEK_CALL_BEGIN)
    + r"\s*\w+\s*"  # the call's type: "function"
    + re.escape(DEEPSEEK_SEP)
    + r"\s*([A-Za-z0-9_.-]{1,64})\s*```(?:json)?\s*(.*?)\s*```\s*"
    + re.escape(DEEPSEEK_CALL_END),
    re.DOTALL,
)
# As the template and the grammar write a call: its arguments an object right after the fence
_DEEPSEEK_HEAD = re.compile(
    r"\s*"
    + re.escape(DEEPSEEK_CALL_BEGIN)
    + r"\s*\w+\s*"
    + re.escape(DEEPSEEK_SEP)
    + r"\s*([A-Za-z0-9_.-]{1,64})\s*```(?:json)?\s*(?=\{)"
)


@dataclass
class DeepSeekV3Stream(MarkedStream):
    """DeepSeek-V3's calls: ``<｜tool▁calls▁begin｜>`` then, per call,
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and a fenced JSON block closed by
    ``<｜tool▁call▁end｜>``, the calls joined by newlines, then ``<｜tool▁calls▁end｜>``."""

    OPEN = DEEPSEEK_CALLS_BEGIN
    CLOSE = DEEPSEEK_CALLS_END
    CALL_START = DEEPSEEK_CALL_BEGIN
    CALL_END = DEEPSEEK_CALL_END

    def _head(self, body: str) -> re.Match | None:
        return _DEEPSEEK_HEAD.match(body)

    def _take_calls(self, body: str) -> tuple[list[ParsedCall | None], int]:
        calls: list[ParsedCall | None] = []
        used = 0
        while True:
            start = body.find(self.CALL_START, used)
            close = body.find(self.CLOSE, used)
            if start < 0 or (0 <= close < start):
                return calls, used
            end = body.find(DEEPSEEK_CALL_END, start)
            if end < 0:
                return calls, used
            end += len(DEEPSEEK_CALL_END)
            match = _DEEPSEEK_CALL.fullmatch(body, start, end)
            arguments = _arguments_object(match.group(2)) if match else None
            calls.append(ParsedCall(match.group(1), arguments) if arguments else None)
            used = end


# ── Qwen3-Coder's XML ──────────────────────────────────────────────────────────────────────────
_XML_FUNCTION = re.compile(r"\s*<function=([A-Za-z0-9_.-]{1,64})>(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]{1,128})>\n?(.*?)\n?</parameter>", re.DOTALL)


def _types(schema: Any) -> set[str]:
    """The JSON types a property's schema names, at its top or in its anyOf/oneOf."""
    if not isinstance(schema, dict):
        return set()
    found = schema.get("type", [])
    names = set(found if isinstance(found, list) else [found])
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []) if isinstance(schema.get(key), list) else []:
            names |= _types(sub)
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        names.add("string")
    return names


def xml_value(text: str, schema: Any) -> Any:
    """A parameter's value as its schema types it: text for strings, JSON for the rest (with
    Python's True/False/None, which templates that print values with ``string`` write)."""
    types = _types(schema)
    if not types or types == {"string"} or ("string" in types and text != "null"):
        return text  # undeclared or untyped parameters stay text, as vLLM keeps them
    try:
        return json.loads(text)
    except ValueError:
        python = {"True": True, "False": False, "None": None}
        return python.get(text, text)


@dataclass
class Qwen3CoderStream(MarkedStream):
    """Qwen3-Coder's calls: ``<tool_call>\\n<function=NAME>\\n`` then, per argument,
    ``<parameter=ARG>\\nVALUE\\n</parameter>\\n``, then ``</function>\\n</tool_call>``.

    A value is text; it is read back as the tool's schema types it (``schemas``: each
    function's parameters), as vLLM's qwen3_coder parser does.
    """

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    CALL_START = "<function="
    schemas: dict[str, dict] = field(default_factory=dict)

    def _take_calls(self, body: str) -> tuple[list[ParsedCall | None], int]:
        start = body.find(self.CALL_START)
        close = body.find(self.CLOSE)
        if start < 0 or (0 <= close < start):
            return [], 0
        end = body.find("</function>", start)
        if end < 0:
            return [], 0
        end += len("</function>")
        match = _XML_FUNCTION.fullmatch(body, start, end)
        return [self._call(match.group(1), match.group(2)) if match else None], end

    def _call(self, name: str, body: str) -> ParsedCall | None:
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        arguments = {}
        for match in _XML_PARAMETER.finditer(body):
            key = match.group(1).strip()
            arguments[key] = xml_value(match.group(2), properties.get(key, {}))
        if _XML_PARAMETER.sub("", body).strip():
            return None  # text between the parameters that is none of them: not a call
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))
