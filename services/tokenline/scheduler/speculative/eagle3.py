"""EAGLE-3 proposals (vLLM's ``eagle3``): a one-layer head (eagle3_head.py) reads the target's
hidden states and guesses a sequence's next tokens greedily, one row each; the target checks
them all in one forward (verify.py), so the output is the target's whatever the head guesses.

The target's forward keeps, while this proposer is on, the residual stream entering three of
its layers (the head's ``aux_layers``) for every row, and the runner hands them here after each
step (`Eagle3Proposer.observe`): the rows of sequences that speculate are combined by the head's
``fc`` and wait, with the tokens that were fed, for the sequence's next proposal. Nothing is
kept, and the forward is unchanged, without it.

At a proposal, a sequence of ``n`` tokens has the target's rows up to position ``n - 2``: each
waiting row whose fed tokens (and every token before them) are the sequence's own joins the
head's KV with the token after it (rows of rejected proposals are dropped), the head's guesses
of the last proposal are rolled back first, and the newest row's output gives the first guess;
each further guess is one row more, fed the guess and the head's own output. Positions a prefix
-cache hit skipped have no target rows: the head's KV goes without them (fewer right guesses,
never a wrong output). A sequence that does not propose for a while has its rows read after
the step once `MAX_WAITING` wait.

The head's KV is its one layer's, per sequence, in tensors of its own beside the target's pool
(a target of 32 layers: about 1/32 of its KV again), given back when the sequence has ended.
Decode steps run eagerly (no CUDA graphs): a replayed step keeps no hidden states. Under tensor
parallelism only rank 0 runs the head, with whole copies of the target's vocabulary rows
(whole_vocabulary.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tokenline.scheduler.policy import Chunk
from tokenline.scheduler.runner import ModelRunner
from tokenline.scheduler.sequence import Sequence, Status
from tokenline.scheduler.speculative.config import SpeculativeConfig
from tokenline.scheduler.speculative.eagle3_head import (
    Eagle3Head,
    HeadCache,
    HeadRefused,
    load_head,
)
from tokenline.scheduler.step_inputs import long_tensor, to_device

log = logging.getLogger(__name__)
MAX_WAITING = 256  # target rows a sequence holds before the head reads them unasked
CATCH_UP_ROWS = 512  # rows of one head forward: its attention mask is rows x context


@dataclass(eq=False)
class _Rows:
    """The target's rows of one sequence in one step: combined hidden states of the tokens
    fed at ``start`` onwards."""

    start: int
    tokens: list[int]
    hidden: torch.Tensor  # [len(tokens), hidden]


@dataclass(eq=False)
class _HeadSeq:
    target: Sequence
    cache: HeadCache
    waiting: list[_Rows] = field(default_factory=list)
    base: int = 0  # rows of ``cache`` from the target's hidden states; the rest are guesses
    next_position: int = 0  # the target's rows before it are in ``cache`` (or were skipped)
    newest: tuple[int, torch.Tensor] | None = None  # the newest target row: position, output


class Eagle3Proposer:
    def __init__(
        self, head: Eagle3Head, num_tokens: int, disable_by_batch_size: int | None = None
    ) -> None:
        self.head = head
        self.num_tokens = num_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.states: dict[str, _HeadSeq] = {}
        self._prune_at = 64

    @torch.inference_mode()
    def observe(self, chunks: list[Chunk], aux: torch.Tensor | None) -> None:
        """The runner's hook after a forward: ``aux`` holds the auxiliary hidden states of every
        row of ``chunks`` (a chunk's rows in a run); those of speculating sequences are kept."""
        if aux is None:
            return
        kept: list[tuple[Chunk, int]] = []
        rows: list[int] = []
        first = 0
        for chunk in chunks:
            if chunk.seq.speculates:
                kept.append((chunk, len(rows)))
                rows.extend(range(first, first + chunk.num_tokens))
            first += chunk.num_tokens
        if not kept:
            return
        if len(self.states) >= self._prune_at:
            self.prune()
        hidden = self.head.combine(aux.index_select(0, to_device(long_tensor(rows), aux.device)))
        for chunk, offset in kept:
            seq, n = chunk.seq, chunk.num_tokens
            fed = seq.token_slice(chunk.start, chunk.start + n - len(chunk.proposals))
            state = self._state(seq)
            state.waiting.append(
                _Rows(chunk.start, fed + chunk.proposals, hidden[offset : offset + n])
            )
            if sum(len(rows.tokens) for rows in state.waiting) > MAX_WAITING:
                # a sequence that does not propose for a while (a long prompt, a paused or a
                # big batch) has its rows read now, rather than holding them all
                self._catch_up(state, seq)

    @torch.inference_mode()
    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``min(limit, num_tokens)`` greedy guesses of the head."""
        limit = min(limit, self.num_tokens)
        if limit <= 0:
            return []
        state = self._state(seq)
        head, cache = self.head, state.cache
        self._catch_up(state, seq)
        if state.newest is None or state.newest[0] != seq.num_tokens - 2:
            return []  # the target's last row is missing: nothing to guess from
        position, out = state.newest
        guesses = [head.guess(out)]
        for _ in range(limit - 1):
            position += 1
            ids = torch.tensor([guesses[-1]], device=head.device)
            where = torch.tensor([position], device=head.device)
            out = head.forward(ids, out, where, cache)
            guesses.append(head.guess(out))
        return guesses

    def _catch_up(self, state: _HeadSeq, seq: Sequence) -> None:
        """The head's KV rolled back to the target's rows, then extended by the waiting rows
        that hold."""
        cache = state.cache
        cache.truncate(state.base)  # the last proposal's guesses: rolled back
        positions, tokens, hidden = self._new_rows(state, seq)
        if not positions:
            return
        device = self.head.device
        ids = to_device(long_tensor(tokens), device)
        where = to_device(long_tensor(positions), device)
        hidden_rows = torch.cat(hidden)
        for at in range(0, len(positions), CATCH_UP_ROWS):  # a long prompt: bounded masks
            rows = slice(at, at + CATCH_UP_ROWS)
            out = self.head.forward(ids[rows], hidden_rows[rows], where[rows], cache)
        state.base = cache.length
        state.newest = (positions[-1], out[-1:])

    def _new_rows(
        self, state: _HeadSeq, seq: Sequence
    ) -> tuple[list[int], list[int], list[torch.Tensor]]:
        """The waiting target rows that hold and whose next token is known: positions, the
        token after each, hidden states. Rows at positions the head has (a recompute after
        preemption) are skipped; rows whose next token is not known yet keep waiting."""
        end = seq.num_tokens - 1  # a row needs the token after it
        positions: list[int] = []
        tokens: list[int] = []
        hidden: list[torch.Tensor] = []
        waiting: list[_Rows] = []
        for rows in state.waiting:
            start = rows.start
            known = seq.token_slice(start, min(start + len(rows.tokens), seq.num_tokens))
            holds = 0
            while holds < len(known) and known[holds] == rows.tokens[holds]:
                holds += 1
            low, high = max(state.next_position - start, 0), min(holds, end - start)
            if low < high:
                positions.extend(range(start + low, start + high))
                tokens.extend(seq.token_slice(start + low + 1, start + high + 1))
                hidden.append(rows.hidden[low:high])
                state.next_position = start + high
            rest = max(low, high)
            if holds == len(known) and rest < len(rows.tokens):  # not known to be wrong yet
                waiting.append(_Rows(start + rest, rows.tokens[rest:], rows.hidden[rest:]))
        state.waiting = waiting
        return positions, tokens, hidden

    def _state(self, seq: Sequence) -> _HeadSeq:
        state = self.states.get(seq.uid)
        if state is None or state.target is not seq:  # a new request under an old uid
            state = self.states[seq.uid] = _HeadSeq(seq, self.head.new_cache())
        return state

    def prune(self) -> None:
        """Forget the sequences that have ended."""
        for uid, state in list(self.states.items()):
            if state.target.status is Status.FINISHED:
                del self.states[uid]
        self._prune_at = 2 * len(self.states) + 64


def eagle3_proposer(config: SpeculativeConfig, target: ModelRunner) -> Eagle3Proposer:
    """The EAGLE-3 head of ``config`` beside ``target``, wired to its forward; refused at start
    when it cannot serve there."""
    try:
        head = load_head(config.model, target)
    except HeadRefused as exc:
        raise SystemExit(f"--speculative-config: the EAGLE-3 head {config.model}: {exc}") from None
    proposer = Eagle3Proposer(head, config.num_speculative_tokens, config.disable_by_batch_size)
    if target.graphs is not None:
        # a replayed decode step keeps no hidden states: decode steps run eagerly instead
        log.info("speculative decoding with EAGLE-3: decode steps run without CUDA graphs")
        target.graphs = None
    if target.device.type == "cuda":
        _check_room(head, target)
    target.model.aux_layers = head.aux_layers
    target.aux_sink = proposer.observe
    log.info(
        "speculative decoding: EAGLE-3 head %s over the target's layers %s, %d guesses a step",
        config.model,
        list(head.aux_layers),
        config.num_speculative_tokens,
    )
    return proposer


def _check_room(head: Eagle3Head, target: ModelRunner) -> None:
    """Warn when the GPU has less free memory than the head's KV takes with the target's pool
    full (it lives outside the pool: an out-of-memory error would end the step)."""
    element = torch.tensor([], dtype=head.dtype).element_size()
    per_token = 2 * head.num_kv_heads * head.head_dim * element
    worst = target.num_blocks * target.block_size * per_token
    free, _ = torch.cuda.mem_get_info(target.device)
    if free < worst:
        log.warning(
            "speculative decoding with EAGLE-3: the head's KV takes up to %.2f GiB with the KV "
            "pool full and %.2f GiB are free; lower --gpu-memory-utilization if steps run "
            "out of memory",
            worst / 2**30,
            free / 2**30,
        )
