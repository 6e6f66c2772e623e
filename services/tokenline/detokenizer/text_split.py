"""Thinking kept apart from the answer on decoded text, for models whose ``<think>`` and
``</think>`` are not single tokens of their vocabulary (the model spells them in pieces).

The rules are the id split's (tokenline/reasoning.py): ``qwen3`` thinks only in a block the
prompt left open or the output opens first, ``deepseek_r1`` from the start unless the prompt
closed the block; a repeated ``<think>`` inside a block is dropped, and after ``</think>``
everything is answer, markers included. Text that may be the start of a marker is held until
the next token settles it, so a marker split across tokens never reaches either channel.
Each token is counted as thinking or answer; a token that holds only part of an opening
``<think>`` is counted once the marker completes.
"""

from __future__ import annotations

from tokenline.reasoning import END, START, ReasoningFormat


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that could begin one of ``markers``."""
    for size in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


class TextSplit:
    """One request's reasoning state, fed the text of its generated tokens one at a time."""

    def __init__(self, fmt: ReasoningFormat, prompt: list[int]) -> None:
        state = fmt.prompt_state(prompt)
        self.reasoning = fmt.opens_at_start if state is None else state  # text is thinking
        self.ended = state is False
        self._first = not self.reasoning and not self.ended  # the output may open a block
        self._pending = ""  # text that may be a marker's start
        self._undecided = 0  # tokens whose text is all pending, before a block opened
        self.reasoning_tokens = 0  # tokens of thinking and markers so far

    def feed(self, text: str) -> list[tuple[bool, str]]:
        """One token's text as (reasoning, text) pieces, markers left out."""
        was = self.reasoning
        out = self._split(self._pending + text)
        if was or self.reasoning:
            self.reasoning_tokens += 1 + self._undecided
            self._undecided = 0
        elif self._pending and not out:
            self._undecided += 1
        else:
            self._undecided = 0
        return out

    def finish(self) -> list[tuple[bool, str]]:
        """What was held back, at the end of the output: text of the channel it is in."""
        pending, self._pending, self._undecided = self._pending, "", 0
        return [(self.reasoning, pending)] if pending else []

    def _split(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        self._pending = ""
        while text:
            if self._first:  # only the output's very start may open a block
                if text.startswith(START):
                    self._first, self.reasoning, text = False, True, text[len(START) :]
                elif START.startswith(text):
                    self._pending = text
                    return out
                else:
                    self._first = False
                continue
            if not self.reasoning:
                out.append((False, text))
                return out
            cuts = [(i, m) for m in (END, START) if (i := text.find(m)) >= 0]
            if cuts:
                at, marker = min(cuts)
                if at:
                    out.append((True, text[:at]))
                text = text[at + len(marker) :]
                if marker == END:
                    self.reasoning, self.ended = False, True
                continue
            keep = _held(text, (END, START))
            if len(text) > keep:
                out.append((True, text[: len(text) - keep]))
            self._pending = text[len(text) - keep :]
            return out
        return out
