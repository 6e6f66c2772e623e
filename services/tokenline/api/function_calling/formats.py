"""Tool-call formats: one model family's markup for calls, the Lark grammar of a call in it
(so ``required`` and named tool choices can be constrained to it), how to recognise a chat
template that uses it, and its stream parser (api/function_calling/parsers.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenline.api.function_calling.parsers import (
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

    def stream(self) -> ToolCallStream:
        return self.stream_type()

    def parse(self, text: str) -> Parsed:
        return self.stream().parse(text)

    def call_rules(self, names_and_arguments: list[tuple[str, str]], parallel: bool) -> str:
        """Lark rules whose ``calls`` rule is one call (several if ``parallel``) of the given
        functions; each function's arguments are the Lark rule its name is paired with."""
        rules = self._call_alternatives(names_and_arguments, "", self.call_head)
        if parallel:
            rules.append(f"calls: call ({_lark_string(self.separator)} call)*")
        else:
            rules.append("calls: call")
        return "\n".join(rules)

    def text_or_calls_rules(
        self, names_and_arguments: list[tuple[str, str]], parallel: bool
    ) -> list[str]:
        """Lark rules whose ``start`` is free text in which every call is one of the given
        functions (several if ``parallel``), each checked as `call_rules` checks it.

        With a trigger, free text runs until the trigger appears; from there the call must
        follow (llguidance's lazy lexeme, as its structural tags do), so the model cannot call
        a function the request did not declare, nor write arguments its schema refuses.
        """
        if self.trigger is None:
            start = "start: FREE | calls | EMPTY"
            text = [f"FREE: /{self.text_start}(.|\\n)*/", 'EMPTY: ""']
            return ["%llguidance {}", start, *text, self.call_rules(names_and_arguments, parallel)]
        rest = self.call_head.removeprefix(self.trigger)
        rules = [
            "%llguidance {}",
            "start: (call)* TEXT" if parallel else "start: TEXT | call",
            "TEXT: /(.|\\n)*/",
            f"trigger[lazy]: TEXT {_lark_string(self.trigger)}",
        ]
        return rules + self._call_alternatives(names_and_arguments, "trigger ", rest)

    def _call_alternatives(
        self, names_and_arguments: list[tuple[str, str]], lead: str, head: str
    ) -> list[str]:
        """A ``call_i`` rule per function (``lead``, then ``head``, its name and arguments) and
        the ``call`` rule choosing among them."""
        rules = []
        for i, (name, arguments_rule) in enumerate(names_and_arguments):
            text = _lark_string(head + name + self.call_middle)
            rules.append(f"call_{i}: {lead}{text} {arguments_rule} {_lark_string(self.call_tail)}")
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
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}
PARSER_CHOICES = ("auto", *FORMATS)


def format_for(template: str | None, choice: str = "auto") -> ToolCallFormat:
    """The format named by ``choice`` (--tool-call-parser), or the one ``template`` uses.

    A template that shows no known format gets Hermes, the format of the tiny model and of
    Qwen, which most templates that learned tools copy.
    """
    if choice != "auto":
        return FORMATS[choice]
    text = template or ""
    for candidate in (HERMES, LLAMA3_JSON):
        if any(marker in text for marker in candidate.template_markers):
            return candidate
    return HERMES
