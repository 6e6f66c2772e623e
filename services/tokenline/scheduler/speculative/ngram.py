"""N-gram proposals (vLLM's ``ngram``, prompt lookup): the tokens that followed the last
earlier occurrence of the sequence's own last n tokens, for the longest n in
``[prompt_lookup_min, prompt_lookup_max]`` that occurred before. No model: strong where an
answer quotes its prompt (summaries, code edits, RAG, structured output), silent elsewhere.

Each sequence keeps an index of its n-grams, extended by the tokens added since its last
proposal, so a step costs a few dictionary lookups whatever the context's length. No tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenline.scheduler.sequence import Sequence


@dataclass(slots=True)
class NgramIndex:
    """One sequence's n-grams: each maps to the position right after its latest occurrence
    that ends before the sequence's last token (so at least one token follows it)."""

    after: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in ``after``


class NgramProposer:
    def __init__(
        self,
        num_tokens: int,
        lookup_min: int,
        lookup_max: int,
        disable_by_batch_size: int | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self.disable_by_batch_size = disable_by_batch_size

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``min(limit, num_tokens)`` guesses of the tokens after ``seq``'s last one."""
        limit = min(limit, self.num_tokens)
        if limit <= 0:
            return []
        index = seq.ngrams
        if index is None:
            index = seq.ngrams = NgramIndex()
        end = seq.num_tokens
        low, high = self.lookup_min, self.lookup_max
        after = index.after
        for stop in range(max(index.indexed, low), end):  # ends before the last token
            window = seq.token_slice(max(0, stop - high), stop)
            for n in range(low, min(high, stop) + 1):
                after[tuple(window[len(window) - n :])] = stop
        index.indexed = max(index.indexed, end)
        tail = seq.token_slice(max(0, end - high), end)
        for n in range(min(high, end), low - 1, -1):
            start = after.get(tuple(tail[len(tail) - n :]))
            if start is not None:
                return seq.token_slice(start, min(start + limit, end))
        return []
