"""Thinking kept apart from the answer: which generated tokens are reasoning.

Reasoning models write their thinking between ``<think>`` and ``</think>``. Where their
tokenizers hold both as single tokens (Qwen3's, DeepSeek-R1's), the split is made here, on
token ids, before any text is decoded, so it holds whether or not the markers decode to text,
and the markers themselves never reach either channel. Where they do not, the markers are text
the model spells in pieces, and the detokenizer splits the decoded text instead
(detokenizer/text_split.py), as vLLM's parsers do. vLLM's parser names:

- ``qwen3``: the answer is plain text unless the output opens ``<think>`` first, or the prompt
  left a ``<think>`` open (templates of thinking-only models end the prompt with it); a prompt
  whose block is already closed (``enable_thinking: false`` renders ``<think></think>``) gives
  a plain answer.
- ``deepseek_r1``: everything before ``</think>`` is reasoning, whether the template or the
  model opened the block, unless the prompt already closed it.

Two stages follow the same split, each with a `ReasoningSplit` a request: the detokenizer, to
send the thinking and the answer apart, and the scheduler, for a request whose answer follows a
grammar, which must hold from the first token of the answer and not before. With text markers
that first token cannot be told exactly (the token that ends ``</think>`` may begin the answer
too), so such a request is refused unless its prompt already closed the block. No I/O: tests
drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenline.scheduler.refusals import InvalidRequest

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"
# The prompt's last ids, where a template opens or closes a block: what the detokenizer is
# sent of the prompt (scheduler/stage.py's PROMPT_TAIL), so both stages read the same ids.
PROMPT_WINDOW = 8
THOUGHT, MARKER, ANSWER = "thought", "marker", "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start_id: int | None  # None: the markers are not single tokens, and split as text
    end_id: int | None
    #: the output is reasoning from its first token (deepseek_r1), not only after ``<think>``
    opens_at_start: bool
    #: text markers: the `tokenizers.Tokenizer` that reads the prompt's end as text
    tokenizer: Any = field(default=None, compare=False, repr=False)

    @property
    def by_text(self) -> bool:
        return self.start_id is None or self.end_id is None

    def prompt_state(self, prompt: list[int]) -> bool | None:
        """Whether the prompt's end leaves a block open (True), closed (False), or has none."""
        tail = prompt[-PROMPT_WINDOW:]
        if not self.by_text:
            for token_id in reversed(tail):
                if token_id == self.end_id:
                    return False
                if token_id == self.start_id:
                    return True
            return None
        return _text_state(self.tokenizer.decode(tail, skip_special_tokens=False))


def _text_state(text: str) -> bool | None:
    """`ReasoningFormat.prompt_state` of a prompt's end read as text: the last marker in it
    decides (``</think>`` does not hold ``<think>``, so neither is found inside the other)."""
    opened, closed = text.rfind(START), text.rfind(END)
    if opened < 0 and closed < 0:
        return None
    return opened > closed


class MarkersAreText(InvalidRequest):
    """A request whose answer follows a grammar, on a model whose reasoning markers are text:
    where the answer starts cannot be told token by token, so the grammar cannot start there."""

    def __init__(self) -> None:
        super().__init__(
            f"this model's reasoning markers {START} and {END} are not single tokens of its "
            "vocabulary, so the token where its answer starts cannot be told exactly, and a "
            "response_format or tool grammar must hold from exactly there. Send the request "
            "without response_format and tools (or with tool_choice none), or with "
            'chat_template_kwargs that switch thinking off (e.g. {"enable_thinking": false}) '
            "where the chat template closes the block, or serve the model with "
            "--reasoning-parser none",
            param="response_format",
        )


def reasoning_format(name: str, tokenizer) -> ReasoningFormat | None:
    """The parser ``name`` over ``tokenizer`` (a `tokenizers.Tokenizer`); None for ``none``.

    Markers that are not single tokens of this vocabulary give a format split on text.
    """
    if name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; use one of none, {', '.join(PARSERS)}"
        )
    start_id, end_id = tokenizer.token_to_id(START), tokenizer.token_to_id(END)
    if start_id is None or end_id is None:  # text: both markers are read from the text
        start_id = end_id = None
    return ReasoningFormat(name, start_id, end_id, name == "deepseek_r1", tokenizer)


def parser_for(setting: str, hf_tokenizer) -> tuple[str, ReasoningFormat | None]:
    """``--reasoning-parser`` for this model: its name (``auto`` read from the chat template)
    and format; both stages that split call this, so they agree. Raises ValueError."""
    tokenizer = hf_tokenizer.backend_tokenizer
    name = setting
    if name == "auto":
        template = getattr(hf_tokenizer, "chat_template", None)
        name = detect(template if isinstance(template, str) else None)
    return name, reasoning_format(name, tokenizer)


def detect(template: str | None) -> str:
    """``auto``: the parser the chat template shows, or ``none``."""
    if not template or START not in template or END not in template:
        return "none"
    # Qwen3's template switches thinking with enable_thinking and lets the model open the
    # block; DeepSeek-R1's opens it itself at the generation prompt.
    return "qwen3" if "enable_thinking" in template else "deepseek_r1"


@dataclass
class Segment:
    reasoning: bool
    token_ids: list[int]  # to decode into this channel (markers left out)
    tokens: int  # generated tokens it stands for, markers included


class ReasoningSplit:
    """One request's reasoning state, fed its generated ids in order.

    A format whose markers are text is split by id only where the prompt closed the block,
    so that every token is answer; otherwise it raises `MarkersAreText` (the scheduler's
    grammar is the one user of an id split for such a format; the detokenizer splits their
    text)."""

    def __init__(self, fmt: ReasoningFormat, prompt: list[int]) -> None:
        self.fmt = fmt
        state = fmt.prompt_state(prompt)
        if fmt.by_text and state is not False:
            raise MarkersAreText()
        self.reasoning = fmt.opens_at_start if state is None else state  # the next is thinking
        self.ended = state is False
        self._first = True

    @property
    def may_open(self) -> bool:
        """The next token may open a block: the output's first, where the format lets the
        model open one itself (a grammar must then allow ``<think>`` beside its own)."""
        return self._first and not self.reasoning and not self.ended

    def step(self, token_id: int) -> str:
        """What ``token_id``, the next generated token, is: THOUGHT, ANSWER or a MARKER."""
        first, self._first = self._first, False
        if not self.ended and token_id == self.fmt.start_id and (first or self.reasoning):
            self.reasoning = True  # the block opens (again: a repeated <think> is dropped)
            return MARKER
        if self.reasoning and token_id == self.fmt.end_id:
            self.reasoning, self.ended = False, True
            return MARKER
        return THOUGHT if self.reasoning else ANSWER

    def segments(self, token_ids: list[int]) -> list[Segment]:
        out: list[Segment] = []
        for token_id in token_ids:
            kind = self.step(token_id)
            _add(out, kind != ANSWER, None if kind == MARKER else token_id)
        return out


def _add(out: list[Segment], reasoning: bool, token_id: int | None) -> None:
    if not out or out[-1].reasoning != reasoning:
        out.append(Segment(reasoning, [], 0))
    if token_id is not None:
        out[-1].token_ids.append(token_id)
    out[-1].tokens += 1
