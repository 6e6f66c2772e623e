"""Tool-call formats: one model family's markup for calls, the Lark grammar of a call in it
(so ``required`` and named tool choices can be constrained to it), how to recognise a chat
template that uses it, and its stream parser (api/function_calling/parsers.py)."""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tokenline.api.function_calling.list_streams import (
    MISTRAL_TRIGGER,
    MistralStream,
    PythonicStream,
)
from tokenline.api.function_calling.marked_streams import (
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_SEP,
    DeepSeekV3Stream,
    Qwen3CoderStream,
)
from tokenline.api.function_calling.parsers import (
    CallsFirst,
    HermesStream,
    Llama3JsonStream,
    Parsed,
    ToolCallStream,
)


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallFormat:
    """One model family's tool-call format."""

    name: str
    stream_type: type[ToolCallStream]
    call_head: str  # before the name: ``<tool_call>\\n{"name": "``
    call_middle: str  # between the name and the arguments
    call_tail: str  # after the arguments
    separator: str  # between parallel calls
    template_markers: tuple[str, ...] = field(default=())
    # What starts a call inside free text (a prefix of call_head); None: a reply is all calls
    # or all text, told apart by how it starts (free text must not start like a call).
    trigger: str | None = None
    text_start: str = ""  # a regex class of what free text may start with, when trigger is None
    # Around the list of calls, for formats that write one ("[" ... "]"); with a trigger, the
    # opening starts with it.
    calls_open: str = ""
    calls_close: str = ""
    # How a call's arguments are written: "json" (an object), "python" (keyword arguments)
    # or "xml" (a <parameter=...> element each); grammars.py builds their rules.
    arguments: str = "json"
    # xml: each function's parameters schema, for reading values back as their types
    schemas: dict[str, Any] | None = None
    id_size: int = 0  # a call id of this many letters and digits (Mistral's templates need 9)
    # The markers that are special tokens of the served model's vocabulary (text, id), as
    # `for_vocabulary` finds them: the grammar writes each as that exact token (``<[id]>``),
    # since text never becomes a special token, and the reply is decoded with special tokens
    # kept so the parser sees them. Empty: every marker is text.
    special_markers: tuple[tuple[str, int], ...] = ()
    # The reply is calls from its first character or an answer with none (tools in auto
    # beside a JSON response_format): a marker inside the answer is its text, not a call.
    calls_first: bool = False

    def for_vocabulary(self, special_tokens: Mapping[str, int]) -> ToolCallFormat:
        """This format for a model whose special added tokens are ``special_tokens`` (text to
        id): those of its markers that are special, found in the text it writes."""
        written = (
            self.call_head,
            self.call_middle,
            self.call_tail,
            self.separator,
            self.calls_open,
            self.calls_close,
        )
        found = sorted(
            (text, token_id)
            for text, token_id in special_tokens.items()
            if text and any(text in part for part in written)
        )
        return replace(self, special_markers=tuple(found))

    def _literal(self, text: str) -> str:
        """``text`` as a Lark expression: quoted, with each special marker in it as its exact
        token. Without special markers it is just the quoted text."""
        if not self._special(text):
            return _lark_string(text)
        ids = dict(self.special_markers)
        pattern = "|".join(re.escape(m) for m in sorted(ids, key=len, reverse=True))
        pieces = []
        for piece in re.split(f"({pattern})", text):
            if piece in ids:
                pieces.append(f"<[{ids[piece]}]>")
            elif piece:
                pieces.append(_lark_string(piece))
        return " ".join(pieces)

    def _special(self, text: str) -> bool:
        return any(marker in text for marker, _ in self.special_markers)

    def stream(self) -> ToolCallStream:
        stream = (
            self.stream_type() if self.schemas is None else self.stream_type(schemas=self.schemas)
        )
        if self.calls_first and self.trigger is not None:
            return CallsFirst(stream, self.trigger)
        return stream

    def bound(self, schemas: dict[str, Any]) -> ToolCallFormat:
        """This format for a request whose functions have these parameter schemas."""
        return replace(self, schemas=schemas) if self.arguments == "xml" else self

    def call_id(self) -> str:
        if self.id_size:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.id_size))
        return "call_" + secrets.token_hex(12)

    def parse(self, text: str) -> Parsed:
        return self.stream().parse(text)

    def call_rules(self, names_and_arguments: list[tuple[str, str]], parallel: bool) -> str:
        """Lark rules whose ``calls`` rule is one call (several if ``parallel``) of the given
        functions; each function's arguments are the Lark rule its name is paired with."""
        rules = self._call_alternatives(names_and_arguments, "", self.call_head)
        opening, closing = self._literal(self.calls_open), self._literal(self.calls_close)
        body = self._body(parallel)
        rules.append(f"calls: {opening} {body} {closing}" if self.calls_open else f"calls: {body}")
        return "\n".join(rules)

    def _body(self, parallel: bool) -> str:
        return f"call ({self._literal(self.separator)} call)*" if parallel else "call"

    def text_or_calls_rules(
        self, names_and_arguments: list[tuple[str, str]], parallel: bool
    ) -> list[str]:
        """Lark rules whose ``start`` is free text in which every call is one of the given
        functions (several if ``parallel``), each checked as `call_rules` checks it.

        With a trigger, free text runs until the trigger appears; from there the call must
        follow (llguidance's lazy lexeme, as its structural tags do), so the model cannot call
        a function the request did not declare, nor write arguments its schema refuses. A
        trigger that is a special token needs no lazy lexeme: free text cannot hold it, so
        the text simply ends where the token comes (and a special token cannot sit inside a
        lexeme).
        """
        if self.trigger is None:
            start = "start: FREE | calls | EMPTY"
            text = [f"FREE: /{self.text_start}(.|\\n)*/", 'EMPTY: ""']
            return ["%llguidance {}", start, *text, self.call_rules(names_and_arguments, parallel)]
        text = "TEXT: /(.|\\n)*/"
        if self._special(self.trigger):
            trigger = f"trigger: TEXT {self._literal(self.trigger)}"
            # Spelled out in text tokens the marker decodes as the token does, and the parser
            # would read a call the grammar never held to its schema: free text never holds it.
            spelled = "".join(f"\\x{{{ord(c):x}}}" for c in self.trigger)
            text += f" & ~/(.|\\n)*{spelled}(.|\\n)*/"
        else:
            trigger = f"trigger[lazy]: TEXT {_lark_string(self.trigger)}"
        if self.calls_open:  # one list of calls, after free text
            rest = self._literal(self.calls_open.removeprefix(self.trigger))
            return [
                "%llguidance {}",
                "start: TEXT | block",
                text,
                trigger,
                f"block: trigger {rest} {self._body(parallel)} {self._literal(self.calls_close)}",
                *self._call_alternatives(names_and_arguments, "", self.call_head),
            ]
        rest = self.call_head.removeprefix(self.trigger)
        rules = [
            "%llguidance {}",
            "start: (call)* TEXT" if parallel else "start: TEXT | call",
            text,
            trigger,
        ]
        return rules + self._call_alternatives(names_and_arguments, "trigger ", rest)

    def _call_alternatives(
        self, names_and_arguments: list[tuple[str, str]], lead: str, head: str
    ) -> list[str]:
        """A ``call_i`` rule per function (``lead``, then ``head``, its name and arguments) and
        the ``call`` rule choosing among them."""
        rules = []
        for i, (name, arguments_rule) in enumerate(names_and_arguments):
            text = self._literal(head + name + self.call_middle)
            rules.append(f"call_{i}: {lead}{text} {arguments_rule} {self._literal(self.call_tail)}")
        alternatives = " | ".join(f"call_{i}" for i in range(len(names_and_arguments)))
        return [*rules, "call: " + alternatives]


HERMES = ToolCallFormat(
    name="hermes",
    stream_type=HermesStream,
    call_head='<tool_call>\n{"name": "',
    call_middle='", "arguments": ',
    call_tail="}\n</tool_call>",
    separator="\n",
    template_markers=("<tool_call>",),
    trigger="<tool_call>",
)
LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    stream_type=Llama3JsonStream,
    call_head='{"name": "',
    call_middle='", "parameters": ',
    call_tail="}",
    separator="; ",
    template_markers=("<|python_tag|>", '"parameters"'),
    text_start="[^{\\s]",
)
MISTRAL = ToolCallFormat(
    name="mistral",
    stream_type=MistralStream,
    call_head='{"name": "',
    call_middle='", "arguments": ',
    call_tail="}",
    separator=", ",
    template_markers=(MISTRAL_TRIGGER,),
    trigger=MISTRAL_TRIGGER,
    calls_open=MISTRAL_TRIGGER + "[",
    calls_close="]",
    id_size=9,
)
PYTHONIC = ToolCallFormat(
    name="pythonic",
    stream_type=PythonicStream,
    call_head="",
    call_middle="(",
    call_tail=")",
    separator=", ",
    # the instruction vLLM's pythonic templates (Llama 3.2, Llama 4) give the model
    template_markers=("[func_name1(", "<|python_start|>"),
    text_start="[^\\[\\s]",
    calls_open="[",
    calls_close="]",
    arguments="python",
)
QWEN3_CODER = ToolCallFormat(
    name="qwen3_coder",
    stream_type=Qwen3CoderStream,
    call_head="<tool_call>\n<function=",
    call_middle=">\n",
    call_tail="</function>\n</tool_call>",
    separator="\n",
    template_markers=("<function=", "<parameter="),
    trigger="<tool_call>",
    arguments="xml",
)
DEEPSEEK_V3 = ToolCallFormat(
    name="deepseek_v3",
    stream_type=DeepSeekV3Stream,
    call_head=DEEPSEEK_CALL_BEGIN + "function" + DEEPSEEK_SEP,
    call_middle="\n```json\n",
    call_tail="\n```" + DEEPSEEK_CALL_END,
    separator="\n",
    template_markers=(DEEPSEEK_CALLS_BEGIN, DEEPSEEK_SEP),
    trigger=DEEPSEEK_CALLS_BEGIN,
    calls_open=DEEPSEEK_CALLS_BEGIN,
    calls_close=DEEPSEEK_CALLS_END,
)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, QWEN3_CODER, DEEPSEEK_V3)}
# Most specific first: Qwen3-Coder's templates also show <tool_call>, pythonic ones may show
# Llama 3's <|python_tag|>.
_DETECTION_ORDER = (QWEN3_CODER, DEEPSEEK_V3, MISTRAL, HERMES, PYTHONIC, LLAMA3_JSON)
PARSER_CHOICES = ("auto", *FORMATS)


def format_for(template: str | None, choice: str = "auto") -> ToolCallFormat:
    """The format named by ``choice`` (--tool-call-parser), or the one ``template`` uses.

    A template that shows no known format gets Hermes, the format of the tiny model and of
    Qwen, which most templates that learned tools copy.
    """
    if choice != "auto":
        return FORMATS[choice]
    text = template or ""
    for candidate in _DETECTION_ORDER:
        if any(marker in text for marker in candidate.template_markers):
            return candidate
    return HERMES
