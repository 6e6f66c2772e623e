"""Which proposed tokens a verification forward keeps.

The target model ran over the sequence's last token and the ``k`` proposals, so it gave ``k +
1`` rows of logits: row ``j`` is its distribution for the token after proposal ``j`` (row 0:
after the last real token). Each row is sampled as a step without speculation would sample
it, and the proposals are kept while each equals the token sampled before it; the first
sample that differs (or the one after the last proposal) ends the step.

This keeps the target's output exactly. Greedy: every token kept is the argmax given the
tokens before it, so the output is the one-token-per-step output. Sampled: the proposals are
a deterministic function of the context (a point mass, ``q(d) = 1``), and standard rejection
sampling with such a ``q`` accepts ``d`` with probability ``p(d)`` and otherwise draws from
``p`` without ``d``: the same law as drawing from ``p`` and comparing, which is what this
does. Every token emitted is a draw from the target's distribution given the real tokens
before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: the policy's chunks are read, never built here
    from tokenline.scheduler.policy import Chunk
    from tokenline.scheduler.sequence import Sequence


def accepted_tokens(proposals: list[int], sampled: list[int]) -> list[int]:
    """The tokens a step emits: ``sampled[j]`` for each row up to and including the first whose
    proposal was wrong (``len(sampled) == len(proposals) + 1``)."""
    for j, proposal in enumerate(proposals):
        if sampled[j] != proposal:
            return sampled[: j + 1]
    return sampled


def emitted(
    samplers: list[Chunk], tokens: list[int], logprobs: list, acceptance: Acceptance
) -> tuple[list[tuple[Sequence, list[int]]], dict[int, list]]:
    """Each sampling chunk's tokens, from its rows' samples (``tokens``, ``logprobs``: one
    per row, a chunk's rows in a run): one, or for a chunk with proposals those that
    verification keeps (counted in ``acceptance``); and the logprob entries of the sequences
    that asked, by ``id`` of the sequence."""
    sampled: list[tuple[Sequence, list[int]]] = []
    logprob_of: dict[int, list] = {}
    row = 0
    for chunk in samplers:
        width = 1 + len(chunk.proposals)
        kept = tokens[row : row + width]
        if chunk.proposals:
            kept = accepted_tokens(chunk.proposals, kept)
            acceptance.record(len(chunk.proposals), len(kept) - 1)
        sampled.append((chunk.seq, kept))
        if logprobs[row] is not None:  # only rows that asked carry logprobs
            logprob_of[id(chunk.seq)] = logprobs[row : row + len(kept)]
        row += width
    return sampled, logprob_of


class Acceptance:
    """What verification kept, in vLLM's counters: verifications (drafts), tokens proposed,
    tokens accepted, and accepted by position (the first proposal, the second, ...)."""

    def __init__(self) -> None:
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position: list[int] = []

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        positions = self.accepted_per_position
        if len(positions) < proposed:
            positions.extend([0] * (proposed - len(positions)))
        for position in range(accepted):
            positions[position] += 1

    def take(self) -> Acceptance:
        """These counts, and zero from now on."""
        taken = Acceptance()
        taken.drafts, self.drafts = self.drafts, 0
        taken.draft_tokens, self.draft_tokens = self.draft_tokens, 0
        taken.accepted_tokens, self.accepted_tokens = self.accepted_tokens, 0
        taken.accepted_per_position, self.accepted_per_position = self.accepted_per_position, []
        return taken
