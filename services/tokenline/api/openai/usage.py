"""Token usage: one count of a request's tokens, in the two shapes OpenAI reports it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Counted(Protocol):
    """What a choice knows of its tokens (`ring.exchange.Choice`)."""

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int


@dataclass(frozen=True)
class Usage:
    prompt: int
    completion: int
    cached: int  # prompt tokens served from the prefix cache
    reasoning: int = 0  # completion tokens that were thinking

    @classmethod
    def of(
        cls,
        choices: Sequence[Counted],
        cached: int,
        per_prompt: int = 1,
        completion: int | None = None,
    ) -> Usage:
        """Usage of a whole request. Choices go prompt by prompt, ``per_prompt`` (n) each, and
        a prompt counts once however many choices it has; ``completion``: the tokens sent so
        far, where a stream reports them before the choices have counted them all."""
        prompt = sum(c.prompt_tokens for c in choices[::per_prompt])
        if completion is None:
            completion = sum(c.completion_tokens for c in choices)
        return cls(prompt, completion, cached, sum(c.reasoning_tokens for c in choices))

    def completions_shape(self) -> dict:
        """Chat completions' and completions' ``usage``; the thinking's share when there was
        any (a model without a reasoning parser answers as before)."""
        usage = {
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }
        if self.reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning}
        return usage

    def responses_shape(self) -> dict:
        """The Responses API's ``usage``."""
        return {
            "input_tokens": self.prompt,
            "input_tokens_details": {"cached_tokens": self.cached, "cache_write_tokens": 0},
            "output_tokens": self.completion,
            "output_tokens_details": {"reasoning_tokens": self.reasoning},
            "total_tokens": self.prompt + self.completion,
        }
