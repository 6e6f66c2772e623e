"""Stream parsers for formats that write calls as a list: Mistral's ``[TOOL_CALLS]`` JSON list
(and its newer ``[TOOL_CALLS]name[ARGS]{...}`` form) and the pythonic form of Llama 3.2/4
(``[get_weather(city="Paris"), other(x=1)]``).

A Mistral call written as its templates and the grammar write it (``{"name": ..., "arguments":
{...}}``, or ``NAME[ARGS]{...}``) streams as a Hermes one does: its name once known, its
arguments' JSON text as it is generated, then its end; cut off once its arguments have begun,
it stays a call as far as it was written (``finish_reason`` says ``length``). Other calls (a
pythonic one, a JSON item written arguments first) are handed out whole once they close, and
dropped if cut off before. As everywhere in function_calling, markup is never content and a
reply splits the same way in any pieces.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from tokenline.api.function_calling.marked_streams import MarkedStream
from tokenline.api.function_calling.parsers import (
    _STREAMABLE_HEAD,
    Call,
    Content,
    Delta,
    ParsedCall,
    ToolCallStream,
    _as_call,
    _held_prefix,
)
from tokenline.api.function_calling.scanners import ObjectScanner, PythonScanner

# ── Mistral ────────────────────────────────────────────────────────────────────────────────────
MISTRAL_TRIGGER = "[TOOL_CALLS]"
# the newer form: a name, optionally Magistral's call id, optionally [ARGS], then the object
_MISTRAL_NAMED = re.compile(
    r"\s*([A-Za-z0-9_.-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]{1,64})?(?:\[ARGS\])?"
)


@dataclass
class MistralStream(MarkedStream):
    """Free text, then ``[TOOL_CALLS]`` and either a JSON list of ``{"name", "arguments"}``
    objects (Mistral 7B v0.3, Nemo, Small 3.1's templates) or ``NAME[ARGS]{...}``, each call
    after its own ``[TOOL_CALLS]`` (tokenizers v11 and later)."""

    OPEN = MISTRAL_TRIGGER
    _form: str = ""  # "list" or "named" once the block shows which
    _scanner: ObjectScanner | None = None
    _seen: int = 0  # how much of the object in _pending the scanner has read
    _item_rest: bool = False  # the scanner skips what follows a streamed call's arguments

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        out: list[Delta] = []
        while True:
            if self._in_block:
                deltas, progressed = self._step()
                out += deltas
                if not progressed:
                    return out
                continue
            start = self._pending.find(self.OPEN)
            if start >= 0:
                out += self._content(self._pending[:start])
                self._space = ""
                self._pending = self._pending[start + len(self.OPEN) :]
                self._in_block, self._form = True, ""
                self._calls_before_block = self._calls
                continue
            keep = _held_prefix(self._pending, self.OPEN)
            cut = len(self._pending) - keep
            ready, self._pending = self._pending[:cut], self._pending[cut:]
            return out + self._content(ready)

    def _leave(self, rest: str) -> None:
        self._pending = rest
        self._close_block()

    def _step(self) -> tuple[list[Delta], bool]:
        """One move inside the block: the deltas it gives and whether it got anywhere."""
        body = self._pending
        if not self._form:
            head = body.lstrip()
            if not head:
                return [], False
            self._form = "list" if head.startswith("[") else "named"
            self._pending = head[1:] if self._form == "list" else head
            return [], True
        if self._streaming is not None:
            deltas = self._stream_arguments()
            if self._streaming is not None:
                return deltas, False  # every piece taken; the arguments go on
            self._skipping = False
            if self._form == "named":  # the next call comes after its own [TOOL_CALLS]
                self._leave(self._pending)
            else:  # the rest of the list item, after its arguments
                self._scanner, self._seen, self._item_rest = ObjectScanner(depth=1), 0, True
            return deltas, True
        if self._scanner is not None:  # inside an object: wait for it to close
            head = None if self._item_rest else _STREAMABLE_HEAD.match(body)
            if head is not None:
                return self._start_streaming(head.group(1), body[head.end() :]), True
            self._seen += self._scanner.take(body[self._seen :])
            if not self._scanner.closed:
                return [], False
            whole, self._pending = body[: self._seen], body[self._seen :]
            self._scanner = None
            if self._item_rest:
                self._item_rest = False
                return [], True
            return self._emit([self._object_call(whole)]), True
        if self._form == "named":
            match = _MISTRAL_NAMED.match(body)
            if match is None:  # no name: not a call, and the marker is dropped
                self._leave(body)
                return [], True
            rest = body[match.end() :]
            if not rest.startswith("{"):
                if rest == "" or any(m.startswith(rest) for m in ("[ARGS]", "[CALL_ID]")):
                    return [], False  # the name, its id or [ARGS] is still being written
                self._leave(body)  # a word after the marker, not a call: the text goes on
                return [], True
            return self._start_streaming(match.group(1), rest), True
        head = body.lstrip()  # the list form, between its items
        if not head:
            return [], False
        if head.startswith(","):
            self._pending = head[1:]
            return [], True
        if head.startswith("]"):
            self._leave(head[1:])
            return [], True
        if not head.startswith("{"):  # not a list of calls: the rest is markup, dropped
            self._pending = ""
            return [], False
        self._pending, self._scanner, self._seen = head, ObjectScanner(), 0
        return [], True

    def _start_streaming(self, name: str, rest: str) -> list[Delta]:
        self._scanner = None
        return self._stream_call(name, rest)

    def _object_call(self, text: str) -> ParsedCall | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return _as_call(value, ("arguments", "parameters"))

    def finish(self) -> list[Delta]:
        if self._in_block:  # cut off: a streaming call as written; one not begun is dropped
            out = self._end_streamed() if self._streaming is not None else []
            self._pending, self._in_block, self._scanner = "", False, None
            self._item_rest = self._skipping = False
            return out
        return super().finish()


# ── pythonic ───────────────────────────────────────────────────────────────────────────────────
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CALLS_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_HEAD = re.compile(r"(\[(\s*([A-Za-z_][\w.]*\s*)?)?)?")


def python_call(text: str) -> ParsedCall | None:
    """``name(key=literal, ...)`` as a call, or None when it is not one."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    if not isinstance(node.func, ast.Name | ast.Attribute):
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # bytes, sets, complex numbers: no JSON for them
        return None
    return ParsedCall(ast.unparse(node.func), text)


@dataclass
class PythonicStream(ToolCallStream):
    """A reply that is a Python list of calls, ``[f(a=1), g(b="x")]`` (optionally inside
    Llama 4's ``<|python_start|>``/``<|python_end|>``), or else plain text.

    Whether a reply is calls shows once it starts ``[name(``: until then it is held, and text
    that cannot start so streams as content at once. After the list, nothing is content.
    """

    _pending: str = ""
    _mode: str = ""  # "" undecided, "content" or "calls"
    _position: int = 0  # in calls: where the next item starts in _pending
    _item_start: int = -1
    _scanner: PythonScanner = field(default_factory=PythonScanner)
    _calls: int = 0
    _closed: bool = False

    def feed(self, text: str) -> list[Delta]:
        if self._mode == "content":
            return [Content(text)] if text else []
        self._pending += text
        if self._mode == "calls":
            return self._items()
        head = self._pending.lstrip()
        head = head.removeprefix(PYTHON_START).lstrip() if head.startswith(PYTHON_START) else head
        if (PYTHON_START.startswith(head) and head) or _MAYBE_HEAD.fullmatch(head):
            return []  # could still become a list of calls
        if _CALLS_HEAD.match(head):
            self._mode = "calls"
            self._pending = head[1:]
            return self._items()
        self._mode = "content"
        pending, self._pending = self._pending, ""
        return [Content(pending)]

    def _items(self) -> list[Delta]:
        out: list[Delta] = []
        while not self._closed:
            if self._item_start < 0:  # between items: a comma, the list's end, or an item
                rest = self._pending[self._position :]
                head = rest.lstrip()
                self._position += len(rest) - len(head)
                if not head:
                    return out
                if head[0] == ",":
                    self._position += 1
                    continue
                if head[0] == "]":
                    self._closed = True
                    return out
                self._item_start = self._position
                self._scanner = PythonScanner()
            end, whole = self._scanner.item_end(self._pending, self._position)
            self._position = end
            if not whole:
                return out
            call = python_call(self._pending[self._item_start : end])
            self._item_start = -1
            if call is None:  # an item that is no call: the rest is markup, dropped
                self._closed = True
                return out
            out.append(Call(self._calls, call))
            self._calls += 1
        return out

    def finish(self) -> list[Delta]:
        if self._mode:
            return []  # content went out as it came; a call cut off is dropped
        pending, self._pending = self._pending, ""
        head = pending.strip()
        if head and (_MAYBE_HEAD.fullmatch(head) or PYTHON_START.startswith(head)):
            return []  # the start of a call list, cut off
        return [Content(pending)] if pending else []
