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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenline.protocol import PoolingParams, Reply, SamplingParams
from tokenline.scheduler.engine import (
    DEADLINE_MARGIN_S,
    EngineLimits,
    InvalidRequest,
    KVCacheTooSmall,
)
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.policy import BatchPolicy, Chunk, StepOutput
from tokenline.scheduler.pooling.config import PoolingSetup
from tokenline.scheduler.runner import ModelRunner
from tokenline.scheduler.sequence import Sequence


class WrongRunner(InvalidRequest):
    """A request of the other kind: generation on a pooling model, or the reverse task."""

    code = "invalid_request_error"
    param = "model"


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

    params: PoolingParams
    tokenizer_s: float
    total: torch.Tensor | None = None  # MEAN: the sum of the rows computed so far
    first: torch.Tensor | None = None  # CLS: the first row


def finish_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> bytes:
    """An embedding as the wire carries it: cut to ``dimensions`` (Matryoshka) and then
    normalised when the model asks (vLLM's order), float32 little-endian."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = F.normalize(vector, dim=-1)
    return vector.to(torch.float32).numpy().astype("<f4").tobytes()


class PoolingEngine:
    def __init__(
        self,
        runner: ModelRunner,
        setup: PoolingSetup,
        limits: EngineLimits,
        prefix_caching: bool = True,
    ) -> None:
        self.runner = runner
        self.setup = setup
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
        self._finished: list[Reply] = []  # ends not tied to a forward pass (aborts)
        self.step_uids: list[str] = []

    # ── requests ───────────────────────────────────────────────────────────────────────────────
    def add(
        self,
        uid: str,
        prompt_ids: list[int],
        params: PoolingParams,
        timeout_s: float = float("inf"),
        arrival: float | None = None,
        tokenizer_s: float = 0.0,
        token_type_ids: list[int] | None = None,  # decoders read no segments
    ) -> Sequence:
        check_params(params, self.setup, self.size)
        if not prompt_ids:  # the tokenizer stage refuses these: a caller that skipped it
            raise ValueError(f"{uid}: an empty prompt; pooling needs at least one token")
        if not self.policy.fits_at_all(len(prompt_ids)):
            raise KVCacheTooSmall(
                f"the input needs {len(prompt_ids)} tokens of KV cache but the pool holds "
                f"{(self.pool.num_blocks - 1) * self.pool.block_size}; raise --kv-cache-memory",
                param="input",
            )
        now = time.monotonic()
        seq = Sequence(
            uid=uid,
            prompt_ids=list(prompt_ids),
            sampling=SamplingParams(max_tokens=0),
            max_tokens=0,
            deadline=now + timeout_s,
            arrival=now if arrival is None else arrival,
        )
        self.policy.add(seq)
        self.states[uid] = _Pooling(params, tokenizer_s)
        return seq

    @property
    def size(self) -> int:
        """An embedding's length, or the classifier's number of labels."""
        score = getattr(self.runner.model, "score", None)
        if score is not None:
            return int(score.weight.shape[0])
        return int(self.runner.config.get_text_config().hidden_size)

    def abort(self, uid: str, finish_reason: str = "abort") -> bool:
        """End ``uid`` now (its KV blocks back at once); its terminal reply leaves next step."""
        seq = self.policy.remove(uid)
        self.states.pop(uid, None)
        if seq is None:
            return False
        scheduler_s = time.monotonic() - seq.arrival
        reply = Reply(uid=uid, text="", num_tokens=0, finish_reason=finish_reason)
        reply.scheduler_s = scheduler_s
        self._finished.append(reply)
        return True

    def drop(self, uid: str) -> bool:
        """Forget ``uid`` without a reply (the caller reports its end)."""
        self.states.pop(uid, None)
        return self.policy.remove(uid) is not None

    def pause(self, uid: str) -> bool:
        return self.policy.pause(uid)

    def resume(self, uid: str) -> bool:
        return self.policy.resume(uid)

    def has_work(self) -> bool:
        return self.policy.has_work() or bool(self._finished)

    def holds(self, uid: str) -> bool:
        return uid in self.policy.by_uid

    def held_uids(self) -> list[str]:
        return list(self.policy.by_uid)

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

    def expire(self, now: float | None = None) -> list[str]:
        """Abort requests past their deadline plus a margin (the api's backstop, as in
        `Engine.expire`)."""
        now = time.monotonic() if now is None else now
        late = [u for u, s in self.policy.by_uid.items() if now > s.deadline + DEADLINE_MARGIN_S]
        for uid in late:
            self.abort(uid)
        return late

    # ── one step ───────────────────────────────────────────────────────────────────────────────
    def step(self) -> list[Reply]:
        """One forward pass over the scheduled chunks; the replies of every request whose
        prompt it finished, and of those ended since the last step."""
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
        state = self.states.pop(seq.uid)
        if self.setup.task == "embed":
            data = finish_embedding(result, state.params.dimensions, self.setup.normalize)
        else:
            data = result.to(torch.float32).numpy().astype("<f4").tobytes()
        return Reply(
            uid=seq.uid,
            text="",
            num_tokens=0,
            finish_reason="stop",
            prompt_tokens=len(seq.prompt_ids),
            tokenizer_s=state.tokenizer_s,
            queue_s=(seq.first_scheduled or now) - seq.arrival,
            scheduler_s=now - seq.arrival,
            cached_tokens=seq.cached_tokens or 0,
            pooled=data,
        )


def check_params(params: PoolingParams | None, setup: PoolingSetup, size: int) -> None:
    """Refuse a request this pooling model cannot serve, naming the mismatch."""
    if params is None:
        raise WrongRunner(
            "this model is served with --runner pooling (embeddings, rerank, score, classify): "
            "it generates no text; use /v1/embeddings, /rerank, /score or /classify, or serve a "
            "generative model for chat and completions"
        )
    if params.task != setup.task:
        served = "embeddings (/v1/embeddings)" if setup.task == "embed" else "scores"
        raise WrongRunner(
            f"this model serves {served} (--convert {setup.task}), not {params.task} requests"
        )
    dims = params.dimensions
    if dims is None:
        return
    if setup.matryoshka == [] or not 1 <= dims <= size:
        allowed = (
            "this model was not trained for shorter embeddings (no Matryoshka dimensions in "
            "its config); leave dimensions out"
            if setup.matryoshka == []
            else f"ask for 1 to {size}"
        )
        raise InvalidRequest(f"dimensions {dims}: {allowed}", param="dimensions")
    if setup.matryoshka and dims not in setup.matryoshka:
        raise InvalidRequest(
            f"dimensions {dims}: this model serves {setup.matryoshka}", param="dimensions"
        )
