"""Who runs next: admission, chunked prefill, pause, abort and preemption. No tensors here.

Each step gets a token budget. Running sequences go first, oldest first: a decoding sequence
takes one token, a sequence still in prefill takes a chunk of what remains of its prompt. Then
waiting sequences are admitted in arrival order while the budget, ``max_num_seqs`` and the KV
cache allow; a sequence is admitted only when the pool can hold its whole prompt, so admission
waits for room instead of failing. An admitted sequence starts with the longest prefix of its
tokens found in the prefix cache (kv_cache.py) already computed, and only the blocks it must
newly get count against the pool; one whose prompt logprobs are still to be computed starts
from nothing, since every prompt position must run through the model (its blocks are still
offered to the cache). When the pool runs dry mid-generation, paused sequences are parked
first (their blocks freed, recomputed on resume), then the newest running ones (preemption.py)
are preempted back to the head of the queue to be recomputed later: output is never corrupted.

LoRA: a sequence of an adapter is admitted only with its adapter in one of the device slots
(lora/slots.py): resident already, or loaded into a slot no running sequence uses. One that
finds none waits where it is in the queue while later sequences go ahead, and a running or
paused-with-KV sequence pins its slot until it ends or is preempted.

Priority and fair share (``scheduling``, waiting.py): admission by priority and tenant share;
an urgent request preempts a lower-priority one rather than wait; prefills in priority order.

Speculative decoding (``proposer`` set): a decoding sequence that allows it
(`speculation_serves`) gets the proposer's guesses of its next tokens fed after its last one,
as far as the budget, its max_tokens, the context and the free blocks allow (a guess never
preempts). Its chunk then samples a row per proposal too; only the rows verification keeps
count as computed, and blocks that held nothing but rejected guesses go back at once.

This is also the one writer of a sequence's state. After each forward pass the engine hands
what the step produced to ``update_from_output`` (vLLM's ``EngineCore`` shape): the tokens
computed, each sampled token and the prompt logprobs gathered; the policy counts them, offers
the filled blocks to the prefix cache, decides who finished (stopping.py) and takes them out.
The engine and the stage only read sequences.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.lora.slots import LoraSlots
from tokenline.scheduler.preemption import victim_for
from tokenline.scheduler.sequence import Sequence, Status
from tokenline.scheduler.speculative import proposals as speculation
from tokenline.scheduler.speculative.config import speculation_serves
from tokenline.scheduler.stopping import finish_reason
from tokenline.scheduler.waiting import Scheduling, WaitingQueue

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    seq: Sequence
    start: int  # first token position fed this step
    num_tokens: int  # rows fed this step, proposals included
    # speculation: tokens proposed after the last known one, checked by the same forward
    proposals: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a token is sampled."""
        return self.start + self.num_tokens - len(self.proposals) == self.seq.num_tokens


@dataclass
class StepOutput:
    """What one forward pass produced, for `update_from_output`."""

    chunks: list[Chunk]  # the chunks computed
    # each sequence that sampled, with the tokens it emits (one, or with proposals, those of
    # them the target kept and the target's own next token), in step order
    sampled: list[tuple[Sequence, list[int]]]
    # sequences that asked for no token (max_tokens 0): their prompt is read, so they end now
    read_only: list[Sequence] = field(default_factory=list)
    # prompt logprob entries gathered this step, per sequence, in prompt order
    prompt_logprobs: list[tuple[Sequence, list]] = field(default_factory=list)


@dataclass(slots=True)
class SequenceUpdate:
    """What changed for one sequence in a step, as the engine reports it."""

    seq: Sequence
    tokens: list[int]  # the tokens it took this step; none: a read-only sequence that ended
    finish_reason: str | None  # stop, length, error (its grammar broke); None: it goes on
    first: bool  # this is its first output
    prompt_logprobs: list | None = None  # handed over with the first output, when asked


class BatchPolicy:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        loras: LoraSlots | None = None,
        proposer: speculation.Proposer | None = None,
        scheduling: Scheduling = Scheduling(),
    ) -> None:
        self.pool = pool
        # speculative decoding: what guesses a decoding sequence's next tokens; None: off
        self.proposer = proposer
        # LoRA device slots: a sequence of an adapter is admitted only with its adapter in a
        # slot (resident, or loaded into one no running sequence uses); else it waits
        self.loras = loras
        self.eos_ids = frozenset(eos_ids)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # --scheduling-policy priority: waiting sequences admitted by priority, running ones
        # preempted lowest priority first; `shares` (--tenant-weights): fair share of tenants
        self.by_priority = scheduling.policy == "priority"
        self.shares = scheduling.shares()
        self.waiting = WaitingQueue(self.by_priority, self.shares)
        # preemptions by (tenant, priority), counted where tenants or priorities matter
        self.preempted: Counter[tuple[str, int]] = Counter()
        self.running: list[Sequence] = []
        self.paused: dict[str, Sequence] = {}
        self.by_uid: dict[str, Sequence] = {}
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache and found there, as vLLM counts them:
        # once per request, at its first admission; a preempted request's recompute is not
        # counted again (its cache hits then are a side effect of preemption, not of traffic).
        # Nothing is counted while prefix caching is off.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # sequences that failed on their own while being scheduled (an adapter's files gone
        # bad since it was loaded): already out; the engine ends each with an internal error
        self.failed: list[tuple[str, Exception]] = []

    # ── requests in and out ────────────────────────────────────────────────────────────────────
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        seq.speculates = self.proposer is not None and speculation_serves(seq.sampling)
        self.waiting.append(seq)
        self.by_uid[seq.uid] = seq
        if self.shares is not None:
            self.shares.enter(seq.tenant)
        if seq.lora and self.loras is not None:
            self.loras.enter(seq.lora)

    def remove(self, uid: str) -> Sequence | None:
        """Take a sequence out wherever it is and give its KV blocks back at once."""
        seq = self.by_uid.pop(uid, None)
        if seq is None:
            return None
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.PAUSED:
            del self.paused[uid]
        self.pool.release(seq)
        self._release_slot(seq)
        seq.num_computed = 0
        seq.status = Status.FINISHED
        if self.shares is not None:
            self.shares.leave(seq.tenant)
        if seq.lora and self.loras is not None:
            self.loras.leave(seq.lora)  # an unloaded adapter goes with its last sequence
        return seq

    def pause(self, uid: str) -> bool:
        seq = self.by_uid.get(uid)
        if seq is None or seq.status is Status.PAUSED:
            return False
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = Status.PAUSED
        self.paused[uid] = seq
        return True

    def resume(self, uid: str) -> bool:
        seq = self.paused.pop(uid, None)
        if seq is None:
            return False
        if seq.block_table:
            seq.status = Status.RUNNING
            self.running.append(seq)
        else:  # parked while paused: recompute from the queue's head
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ── one step ───────────────────────────────────────────────────────────────────────────────
    def schedule(self) -> list[Chunk]:
        budget = self.max_num_batched_tokens
        block_size = self.pool.block_size
        chunks: list[Chunk] = []
        running = list(self.running)
        if self.by_priority:  # a high priority's prefill chunks are never queued behind a low one's
            self._preempt_for_waiting()
            running = sorted(self.running, key=attrgetter("priority"))
        for seq in running:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            if n <= 0:
                continue
            proposals = []
            if n == 1 and seq.speculates and self.proposer is not None:
                proposals = self._proposals(seq, budget)
            n += len(proposals)
            # most decode steps land in a block the sequence holds: nothing to make room for
            if seq.num_computed + n > len(seq.block_table) * block_size:
                if not self._make_room(seq, n):
                    continue
                self.pool.grow(seq, n)
            chunks.append(Chunk(seq, seq.num_computed, n, proposals))
            budget -= n
        # sequences whose adapter finds no free slot wait, in order, behind later ones
        held_back: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            # a prompt still to be scored computes every position; its blocks are still cached
            looks_up = self.pool.caching and not seq.scores_prompt
            hits = self.pool.lookup(seq) if looks_up else []
            if not self.pool.can_admit(seq, seq.num_tokens + 1, hits):
                break
            try:
                acquired = self._acquire_slot(seq)
            except Exception as exc:  # this sequence's failure, not the step's
                log.exception("%s: its adapter %s could not be put in a slot", seq.uid, seq.lora)
                self.remove(seq.uid)
                self.failed.append((seq.uid, exc))
                continue
            if not acquired:
                held_back.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            seq.num_computed = self.pool.share(seq, hits)
            if seq.cached_tokens is None:
                seq.cached_tokens = seq.num_computed
                if looks_up:
                    self.prefix_cache_queries += len(seq.prompt_ids)
                    self.prefix_cache_hits += seq.num_computed
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            n = min(seq.num_uncomputed, budget)
            self.pool.grow(seq, n)
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        for seq in reversed(held_back):
            self.waiting.appendleft(seq)
        return chunks

    def _proposals(self, seq: Sequence, budget: int) -> list[int]:
        """The proposer's guesses for ``seq``; a proposer that fails costs the sequence its
        speculation, not its answer (guesses only ever save steps)."""
        try:
            return speculation.step_proposals(
                self.proposer, seq, budget, self.max_model_len, self.pool, len(self.running)
            )
        except Exception:
            log.exception("%s: proposing its next tokens failed; it decodes without", seq.uid)
            seq.speculates = False
            return []

    def _preempt_for_waiting(self) -> None:
        """Priority: while the most urgent waiting sequence cannot be admitted (no sequence
        slot, or no room in the pool) and a running one is of a lower priority, that one
        (the lowest, newest first) is preempted for it: a flood of low-priority work never
        holds an urgent request back for longer than a step."""
        while self.waiting and self.running:
            seq = self.waiting.peek()
            worst = max(self.running, key=attrgetter("priority", "arrival"))
            if worst.priority <= seq.priority:
                return
            hits = self.pool.lookup(seq) if self.pool.caching and not seq.scores_prompt else []
            has_slot = len(self.running) < self.max_num_seqs
            if has_slot and self.pool.can_admit(seq, seq.num_tokens + 1, hits):
                return
            self._preempt(worst)

    def update_from_output(self, output: StepOutput) -> list[SequenceUpdate]:
        """Apply one step's results: the only place sequences' counters change after a
        forward pass. Returns what changed, read-only ends first, then each sequence that
        sampled, in step order; finished sequences are already out (their blocks back in the
        pool)."""
        proposing: dict[int, Chunk] = {}
        if self.shares is not None:  # service is the tokens computed for a tenant
            for chunk in output.chunks:
                self.shares.charge(chunk.seq.tenant, chunk.num_tokens)
        for chunk in output.chunks:
            if chunk.proposals:  # counted once its tokens are known: only kept rows count
                proposing[id(chunk.seq)] = chunk
                continue
            chunk.seq.num_computed += chunk.num_tokens
            self.pool.cache_full_blocks(chunk.seq)
        for seq, entries in output.prompt_logprobs:
            seq.prompt_logprobs.extend(entries)
        updates = []
        for seq in output.read_only:
            self.remove(seq.uid)
            updates.append(SequenceUpdate(seq, [], "length", True, _hand_over(seq)))
        for seq, tokens in output.sampled:
            first = not seq.output_ids
            taken: list[int] = []
            reason = None
            for token in tokens:  # a token after one that ends the sequence is not emitted
                seq.output_ids.append(token)
                taken.append(token)
                reason = finish_reason(seq, token, self.eos_ids, self.max_model_len)
                if reason is not None:
                    break
            if id(seq) in proposing:
                # the last token fed and the proposals kept have their K/V; the rejected
                # proposals' slots are overwritten later, and their blocks go back now
                speculation.after_verification(seq, len(tokens) - 1)
                seq.num_computed += len(taken)
                self.pool.cache_full_blocks(seq)
                self.pool.trim(seq)
            if reason is not None:
                self.remove(seq.uid)
            handed = _hand_over(seq) if first else None
            updates.append(SequenceUpdate(seq, taken, reason, first, handed))
        return updates

    def _make_room(self, seq: Sequence, n: int) -> bool:
        while not self.pool.can_grow(seq, n):
            victim = victim_for(
                seq, self.paused.values(), self.running, self.by_priority, self.shares
            )
            if victim is None:
                self._preempt(seq)
                return False
            self._preempt(victim)
        return True

    def _acquire_slot(self, seq: Sequence) -> bool:
        """Give ``seq`` its adapter's device slot; False: every slot serves another adapter's
        running sequences, so it waits. Paused sequences holding slots are parked first."""
        if not seq.lora or self.loras is None or seq.lora_slot >= 0:
            return True
        slot = self.loras.acquire(seq.lora)
        if slot is None:
            for parked in [p for p in self.paused.values() if p.lora_slot >= 0]:
                self._preempt(parked)
            slot = self.loras.acquire(seq.lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0 and self.loras is not None:
            self.loras.release(seq.lora)
        seq.lora_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        if self.by_priority or self.shares is not None:
            self.preempted[seq.tenant, seq.priority] += 1
        self.pool.release(seq)
        self._release_slot(seq)
        seq.num_computed = 0  # its KV is gone: recomputed from the start when it runs again
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
        # a paused sequence stays paused, parked without KV; resume sends it to the queue


def _hand_over(seq: Sequence) -> list | None:
    """The prompt logprobs leave the sequence with its first output."""
    handed, seq.prompt_logprobs = seq.prompt_logprobs, None
    return handed
