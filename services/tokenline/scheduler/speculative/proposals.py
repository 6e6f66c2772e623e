"""What a proposer is, and how many guesses one step of a sequence has room for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tokenline.scheduler.sequence import Sequence

if TYPE_CHECKING:  # for annotations only
    from tokenline.scheduler.kv_cache import BlockPool


class Proposer(Protocol):
    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``limit`` guesses of the tokens after ``seq``'s last one."""
        ...


def step_proposals(
    proposer: Proposer, seq: Sequence, budget: int, max_model_len: int | None, pool: BlockPool
) -> list[int]:
    """Guesses of a decoding sequence's next tokens, as many as the step's token budget, its
    max_tokens and the context leave room for, and only where the pool has the blocks at hand:
    a guess never preempts anyone."""
    if not seq.output_ids or len(seq.output_ids) < seq.sampling.min_tokens:
        return []  # prompt chunks are not guessed; the eos ban of min_tokens counts every row
    room = min(budget, seq.max_tokens - len(seq.output_ids)) - 1
    if max_model_len is not None:
        room = min(room, max_model_len - seq.num_tokens - 1)
    proposals = proposer.propose(seq, room) if room > 0 else []
    if proposals and not pool.can_grow(seq, 1 + len(proposals)):
        return []
    return proposals
