"""Draft-model proposals (vLLM's ``draft_model``): a smaller model of the target's vocabulary
guesses a sequence's next tokens greedily, one forward each, and the target checks them all in
one forward (verify.py). Greedy guesses are deterministic, so verification keeps the target's
output exactly, whatever the draft says; a good draft only makes it faster.

The draft keeps its own KV pool. Each sequence's draft copy holds the target's known tokens and
the draft's last guesses: at the next proposal the guesses the target kept stay computed, the
rest are rolled back, and the target's new tokens are fed first (the first proposal of a
sequence prefills its whole context in the draft). Drafts of finished sequences go back to the
pool when it runs short, and every few proposals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenline.model_source import resolve
from tokenline.protocol import SamplingParams
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.policy import Chunk
from tokenline.scheduler.runner import ModelRunner, RunnerOptions
from tokenline.scheduler.sequence import Sequence, Status
from tokenline.scheduler.speculative.config import SpeculativeConfig

log = logging.getLogger(__name__)
_UNBOUNDED = 1 << 30
# A sequence's first proposal prefills its whole context in the draft; it is fed this many
# tokens a step (without guesses until done), so a long prompt never stalls the step.
CATCH_UP_TOKENS = 256
_FREE_SAMPLING = SamplingParams()


@dataclass(eq=False)
class _Draft:
    target: Sequence
    seq: Sequence  # the draft's copy: the target's tokens, then the draft's guesses
    known: int  # the first ``known`` tokens of ``seq`` are the target's


class DraftModelProposer:
    def __init__(
        self, runner: ModelRunner, num_tokens: int, disable_by_batch_size: int | None = None
    ) -> None:
        self.runner = runner
        self.num_tokens = num_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.pool = BlockPool(runner.num_blocks, runner.block_size, caching=False)
        self.drafts: dict[str, _Draft] = {}
        self._prune_at = 64

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``min(limit, num_tokens)`` greedy guesses of the draft model."""
        # within the draft's own context, which may be shorter than the target's
        limit = min(limit, self.num_tokens, self.runner.max_model_len - seq.num_tokens - 1)
        if limit <= 0:
            return []
        if len(self.drafts) >= self._prune_at:
            self.prune()
        draft = self._synced(seq)
        guesses: list[int] = []
        copy = draft.seq
        for _ in range(limit):
            feed = min(copy.num_uncomputed, CATCH_UP_TOKENS)
            if not self._room(copy, feed):
                break  # the draft pool is full of live sequences: fewer guesses
            logits = self._feed(copy, feed)
            if copy.num_uncomputed:  # still catching up: guesses from the next step on
                break
            guess = int(logits[0].argmax())
            copy.output_ids.append(guess)
            guesses.append(guess)
        return guesses

    def _room(self, copy: Sequence, count: int) -> bool:
        if self.pool.can_grow(copy, count):
            return True
        self.prune()
        return self.pool.can_grow(copy, count)

    def _feed(self, copy: Sequence, count: int) -> torch.Tensor:
        """``count`` more of ``copy``'s tokens through the draft (the caller made room); the
        logits after the last of them (none for a catch-up chunk that ends before it)."""
        self.pool.grow(copy, count)
        logits = self.runner.forward([Chunk(copy, copy.num_computed, count)])
        copy.num_computed += count
        return logits

    def _synced(self, seq: Sequence) -> _Draft:
        """``seq``'s draft copy, holding its tokens now; the guesses it kept stay computed."""
        draft = self.drafts.get(seq.uid)
        if draft is None or draft.target is not seq:
            if draft is not None:
                self.pool.release(draft.seq)
            copy = Sequence(
                uid=seq.uid,
                prompt_ids=seq.prompt_ids,
                sampling=_FREE_SAMPLING,
                max_tokens=_UNBOUNDED,
            )
            draft = self.drafts[seq.uid] = _Draft(seq, copy, len(seq.prompt_ids))
        copy, prompt_len = draft.seq, len(seq.prompt_ids)
        guessed = copy.output_ids[draft.known - prompt_len :]
        new = seq.token_slice(draft.known, seq.num_tokens)
        kept = 0
        while kept < min(len(guessed), len(new)) and guessed[kept] == new[kept]:
            kept += 1
        copy.num_computed = min(copy.num_computed, draft.known + kept)
        del copy.output_ids[draft.known - prompt_len :]
        copy.output_ids.extend(new)
        self.pool.trim(copy)
        draft.known = seq.num_tokens
        return draft

    def prune(self) -> None:
        """Give back the drafts of sequences that have ended."""
        for uid, draft in list(self.drafts.items()):
            if draft.target.status is Status.FINISHED:
                self.pool.release(draft.seq)
                del self.drafts[uid]
        self._prune_at = 2 * len(self.drafts) + 64


def draft_proposer(config: SpeculativeConfig, target: ModelRunner) -> DraftModelProposer:
    """The draft model of ``config``, on the target's device and in its dtype, with a KV pool
    of a quarter of the target's bytes; refused at start unless it shares the target's
    vocabulary."""
    source = resolve(config.model)  # start.py made it a local directory (fetched if need be)
    kv_bytes = target.kv_cache.numel() * target.kv_cache.element_size() // 4
    if target.device.type == "cuda":  # the target sized its pool first: half of what is left
        free, _ = torch.cuda.mem_get_info(target.device)
        kv_bytes = min(kv_bytes, free // 2)
    options = RunnerOptions(
        device=target.device.type,
        dtype=str(target.dtype).removeprefix("torch."),
        kv_cache_memory=max(kv_bytes, 1 << 20),
        dense_decode=False,  # its rollbacks rewrite positions a dense row would hold
        torch_threads=torch.get_num_threads(),  # the target's choice, kept
        max_model_len=min(target.max_model_len, source.max_model_len()),
    )
    runner = ModelRunner(source, options)
    if runner.vocab_size != target.vocab_size:
        raise SystemExit(
            f"--speculative-config: the draft model {config.model} has a vocabulary of "
            f"{runner.vocab_size} tokens and the target {target.vocab_size}; a draft must "
            "share the target's tokenizer"
        )
    log.info(
        "speculative decoding: draft model %s, %d guesses a step",
        config.model,
        config.num_speculative_tokens,
    )
    return DraftModelProposer(runner, config.num_speculative_tokens, config.disable_by_batch_size)
