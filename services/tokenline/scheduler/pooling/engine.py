"""The pooling engine: prompts through the runner's chunked prefill over the paged KV cache,
pooled, never decoded.

A pooling request is a sequence that generates nothing (``max_tokens`` 0): the batch policy
(policy.py) admits it, chunks its prompt within the step's token budget beside other requests
and, the step its last chunk runs, ends it and gives its KV blocks back at once. Each step keeps
what the pooling needs of the rows it computed: the last row (LAST: the head over the rows
that end a prompt, which the runner computes anyway), every row (MEAN: summed in float32 across
a long prompt's chunks), or the first (CLS). A sequence preempted mid-prompt starts over from
position 0, and so does its sum. Prefix caching is kept only for LAST pooling: a cached block's
rows would be missing from a mean.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tokenline.protocol import Reply, SamplingParams
from tokenline.scheduler.engine import EngineLimits
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.policy import BatchPolicy, Chunk, StepOutput
from tokenline.scheduler.pooling.config import PoolingSetup
from tokenline.scheduler.pooling.engine_base import PoolingEngineBase, PoolingRequest
from tokenline.scheduler.refusals import check_fits
from tokenline.scheduler.runner import ModelRunner
from tokenline.scheduler.sequence import Sequence


@dataclass(frozen=True)
class CacheStatus:
    """The KV cache as the stage reports it (an encoder has none: all zero)."""

    usage: float = 0.0  # share of usable blocks referenced
    block_size: int = 0
    num_blocks: int = 0  # usable blocks
    cached_blocks: int = 0  # prefix-cached blocks
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, ever
    prefix_hits: int = 0  # of which found


@dataclass
class _Pooling:
    """One request's pooling state beside its sequence."""

    request: PoolingRequest
    total: torch.Tensor | None = None  # MEAN: the sum of the rows computed so far
    first: torch.Tensor | None = None  # CLS: the first row


class PoolingEngine(PoolingEngineBase):
    def __init__(
        self,
        runner: ModelRunner,
        setup: PoolingSetup,
        limits: EngineLimits,
        prefix_caching: bool = True,
    ) -> None:
        super().__init__(setup)
        self.runner = runner
        self.limits = limits
        caching = prefix_caching and setup.pooling_type == "LAST"
        self.pool = BlockPool(runner.num_blocks, runner.block_size, caching=caching)
        self.policy = BatchPolicy(
            self.pool,
            limits.max_num_seqs,
            limits.max_num_batched_tokens,
            max_model_len=limits.max_model_len,
        )
        self.states: dict[str, _Pooling] = {}

    # ── requests ───────────────────────────────────────────────────────────────────────────────
    def _admit(self, request: PoolingRequest) -> Sequence:
        size = len(request.ids)
        check_fits(size, self.pool.capacity, "input", param="input")
        seq = Sequence(
            uid=request.uid,
            prompt_ids=request.ids,
            sampling=SamplingParams(max_tokens=0),
            max_tokens=0,
            deadline=request.deadline,
            arrival=request.arrival,
        )
        self.policy.add(seq)
        self.states[request.uid] = _Pooling(request)
        return seq

    @property
    def size(self) -> int:
        """An embedding's length, or the classifier's number of labels."""
        score = getattr(self.runner.model, "score", None)
        if score is not None:
            return int(score.weight.shape[0])
        return int(self.runner.config.get_text_config().hidden_size)

    def _forget(self, uid: str) -> Sequence | None:
        self.states.pop(uid, None)
        return self.policy.remove(uid)

    def pause(self, uid: str) -> bool:
        return self.policy.pause(uid)

    def resume(self, uid: str) -> bool:
        return self.policy.resume(uid)

    def has_work(self) -> bool:
        return self.policy.has_work() or bool(self._finished)

    def _held(self) -> Mapping[str, Sequence]:
        return self.policy.by_uid

    def counts(self) -> dict[str, int]:
        policy = self.policy
        return {
            "waiting": len(policy.waiting),
            "running": len(policy.running),
            "paused": len(policy.paused),
        }

    def cache_status(self) -> CacheStatus:
        pool, policy = self.pool, self.policy
        return CacheStatus(
            usage=pool.usage,
            block_size=pool.block_size,
            num_blocks=pool.num_blocks - 1,
            cached_blocks=pool.num_cached,
            prefix_queries=policy.prefix_cache_queries,
            prefix_hits=policy.prefix_cache_hits,
        )

    # ── one step ───────────────────────────────────────────────────────────────────────────────
    def step(self) -> list[Reply]:
        """One forward pass over the scheduled chunks; the replies of every request whose
        prompt it finished, and of those ended since the last step."""
        self.step_uids = []  # a failure before the forward is no request's
        chunks = self.policy.schedule()
        self.step_uids = [c.seq.uid for c in chunks]
        computed = self._run(chunks) if chunks else []
        ended, self._finished = self._finished, []
        return ended + computed

    def _run(self, chunks: list[Chunk]) -> list[Reply]:
        kind = self.setup.pooling_type
        spans = []
        for k, chunk in enumerate(chunks):
            if kind == "MEAN":
                spans.append((k, 0, chunk.num_tokens))
            elif kind == "CLS" and chunk.start == 0:
                spans.append((k, 0, 1))
        inputs = self.runner.step_inputs(chunks)
        heads, hidden = self.runner.execute(inputs, spans)
        done = [c for c in chunks if c.samples]
        if kind != "LAST":
            self._keep(chunks, spans, hidden)
            if done:
                heads = self.runner.logits(torch.stack([self._pooled(c) for c in done]))
        results = heads.cpu()  # one copy to the host for the whole step
        self.policy.update_from_output(
            StepOutput(chunks=chunks, sampled=[], read_only=[c.seq for c in done])
        )
        now = time.monotonic()
        return [self._reply(c.seq, results[i], now) for i, c in enumerate(done)]

    def _keep(self, chunks: list[Chunk], spans, hidden: torch.Tensor) -> None:
        """MEAN: add each chunk's rows to its sequence's sum; CLS: keep its first row."""
        offset = 0
        for k, _, n in spans:
            rows, offset = hidden[offset : offset + n], offset + n
            chunk = chunks[k]
            state = self.states[chunk.seq.uid]
            if self.setup.pooling_type == "CLS":
                state.first = rows[0]
                continue
            part = rows.float().sum(0)
            restarted = chunk.start == 0 or state.total is None  # a preempted prompt too
            state.total = part if restarted else state.total + part

    def _pooled(self, chunk: Chunk) -> torch.Tensor:
        state = self.states[chunk.seq.uid]
        if self.setup.pooling_type == "CLS":
            return state.first
        return (state.total / len(chunk.seq.prompt_ids)).to(self.runner.dtype)

    def _reply(self, seq: Sequence, result: torch.Tensor, now: float) -> Reply:
        request = self.states.pop(seq.uid).request
        started = seq.first_scheduled or now
        return self._pooled_reply(request, result, started, now, seq.cached_tokens or 0)
