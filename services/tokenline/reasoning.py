"""Thinking kept apart from the answer: which generated tokens are reasoning, by token id.

Reasoning models write their thinking between ``<think>`` and ``</think>``, which their
tokenizers hold as single tokens. The split is made here, on token ids, before any text is
decoded, so it holds whether or not the markers decode to text, and the markers themselves
never reach either channel. vLLM's parser names:

- ``qwen3``: the answer is plain text unless the output opens ``<think>`` first, or the prompt
  left a ``<think>`` open (templates of thinking-only models end the prompt with it); a prompt
  whose block is already closed (``enable_thinking: false`` renders ``<think></think>``) gives
  a plain answer.
- ``deepseek_r1``: everything before ``</think>`` is reasoning, whether the template or the
  model opened the block, unless the prompt already closed it.

Two stages follow the same split, each with a `ReasoningSplit` a request: the detokenizer, to
send the thinking and the answer apart, and the scheduler, for a request whose answer follows a
grammar, which must hold from the first token of the answer and not before. No I/O: tests drive
it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"
PROMPT_WINDOW = 8  # the prompt's last ids, where a template opens or closes a block
THOUGHT, MARKER, ANSWER = "thought", "marker", "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start_id: int
    end_id: int
    #: the output is reasoning from its first token (deepseek_r1), not only after ``<think>``
    opens_at_start: bool


def reasoning_format(name: str, tokenizer) -> ReasoningFormat | None:
    """The parser ``name`` over ``tokenizer`` (a `tokenizers.Tokenizer`); None for ``none``.

    Raises ValueError when the markers are not single tokens of this vocabulary: a split made
    on text the model may spell in pieces would put thinking in the answer unnoticed.
    """
    if name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; use one of none, {', '.join(PARSERS)}"
        )
    ids = {marker: tokenizer.token_to_id(marker) for marker in (START, END)}
    missing = [marker for marker, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(
            f"--reasoning-parser {name} needs {' and '.join(missing)} as single tokens of the "
            "model's vocabulary, and this tokenizer has none; this model does not think in "
            "that format: start without --reasoning-parser (or with none)"
        )
    return ReasoningFormat(name, ids[START], ids[END], opens_at_start=name == "deepseek_r1")


def parser_for(setting: str, hf_tokenizer) -> tuple[str, ReasoningFormat | None]:
    """``--reasoning-parser`` for this model: its name (``auto`` read from the chat template)
    and format; both stages that split call this, so they agree. Raises ValueError."""
    tokenizer = hf_tokenizer.backend_tokenizer
    name = setting
    if name == "auto":
        template = getattr(hf_tokenizer, "chat_template", None)
        name = detect(template if isinstance(template, str) else None, tokenizer)
    return name, reasoning_format(name, tokenizer)


def detect(template: str | None, tokenizer) -> str:
    """``auto``: the parser the chat template and vocabulary show, or ``none``."""
    if not template or START not in template or END not in template:
        return "none"
    if tokenizer.token_to_id(START) is None or tokenizer.token_to_id(END) is None:
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
    """One request's reasoning state, fed its generated ids in order."""

    def __init__(self, fmt: ReasoningFormat, prompt: list[int]) -> None:
        self.fmt = fmt
        tail = prompt[-PROMPT_WINDOW:]
        opened = _open_in_prompt(fmt, tail)
        if opened is None:  # the prompt says nothing: the format's own default
            opened = fmt.opens_at_start
        self.reasoning = opened  # the next token is thinking
        self.ended = opened is False and fmt.end_id in tail
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


def _open_in_prompt(fmt: ReasoningFormat, tail: list[int]) -> bool | None:
    """Whether the prompt's end leaves a block open (True), closed (False), or has none."""
    for token_id in reversed(tail):
        if token_id == fmt.end_id:
            return False
        if token_id == fmt.start_id:
            return True
    return None
