"""What a proposer is, how many guesses one step of a sequence has room for, and when a
sequence whose guesses keep failing stops guessing for a while.

A verification costs a forward over every proposal, kept or not. After a verification that
kept nothing, a sequence waits 1, 3, 7, then `MAX_PAUSE` steps before it proposes again (any
kept proposal resets this), so text that proposals cannot follow costs little more than
decoding without them, and a stretch they can follow is found again within a few steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tokenline.scheduler.sequence import Sequence

if TYPE_CHECKING:  # for annotations only
    from tokenline.scheduler.kv_cache import BlockPool


class Proposer(Protocol):
    """May also have ``disable_by_batch_size`` (vLLM's key): no proposals while more sequences
    than that run; and ``prune()``, which lets go of what it keeps for sequences that ended
    (it prunes as it grows; the engine calls it when it runs out of work, so an idle engine
    keeps nothing of any request)."""

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``limit`` guesses of the tokens after ``seq``'s last one."""
        ...


MAX_PAUSE = 8


def after_verification(seq: Sequence, accepted: int) -> None:
    """Count a verification of ``seq`` that kept ``accepted`` proposals (the policy calls it,
    as the writer of sequence state)."""
    if accepted:
        seq.proposal_misses = 0
        return
    seq.proposal_misses += 1
    seq.proposal_pause = min(2**seq.proposal_misses - 1, MAX_PAUSE)


def step_proposals(
    proposer: Proposer,
    seq: Sequence,
    budget: int,
    max_model_len: int | None,
    pool: BlockPool,
    running: int = 1,
) -> list[int]:
    """Guesses of a decoding sequence's next tokens, as many as the step's token budget, its
    max_tokens and the context leave room for, and only where the pool has the blocks at hand:
    a guess never preempts anyone."""
    if not seq.output_ids or len(seq.output_ids) < seq.sampling.min_tokens:
        return []  # prompt chunks are not guessed; the eos ban of min_tokens counts every row
    most = getattr(proposer, "disable_by_batch_size", None)
    if most is not None and running > most:
        return []  # a big batch already keeps the hardware busy: verification only adds work
    if seq.proposal_pause:
        seq.proposal_pause -= 1
        return []
    room = min(budget, seq.max_tokens - len(seq.output_ids)) - 1
    if max_model_len is not None:
        room = min(room, max_model_len - seq.num_tokens - 1)
    proposals = proposer.propose(seq, room) if room > 0 else []
    if proposals and not pool.can_grow(seq, 1 + len(proposals)):
        return []
    return proposals
