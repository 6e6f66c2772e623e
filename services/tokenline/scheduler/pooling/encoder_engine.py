"""The engine of a BERT-style encoder: the same interface, admission, aborts, deadlines and
replies as the decoder's pooling engine (engine.py), over a model that runs each input whole.

There is no KV cache and no chunking: a step takes waiting requests in arrival order (paused
ones left waiting) while the padded batch, its rows times its longest input, fits
``max_num_batched_tokens`` and its rows ``max_num_seqs``, runs them in one forward and ends
them all. The first request of a step always runs, so an input longer than the token budget
but within the encoder's positions still runs, alone. Nothing is held between steps but the
waiting requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tokenline.protocol import PoolingParams, Reply
from tokenline.scheduler.engine import DEADLINE_MARGIN_S, EngineLimits
from tokenline.scheduler.pooling.config import PoolingSetup
from tokenline.scheduler.pooling.encoder import EncoderRunner
from tokenline.scheduler.pooling.engine import CacheStatus, check_params, finish_embedding
from tokenline.scheduler.refusals import InvalidRequest


class InputTooLong(InvalidRequest):
    """An input beyond the encoder's positions (or --max-model-len): it can never run."""

    code = "context_length_exceeded"
    param = "input"


@dataclass
class _Request:
    uid: str
    ids: list[int]
    types: list[int] | None
    params: PoolingParams
    deadline: float
    arrival: float
    tokenizer_s: float


class EncoderEngine:
    def __init__(self, runner: EncoderRunner, setup: PoolingSetup, limits: EngineLimits) -> None:
        self.runner = runner
        self.setup = setup
        self.limits = limits
        self.max_model_len = min(limits.max_model_len or runner.max_model_len, runner.max_model_len)
        self.waiting: dict[str, _Request] = {}  # arrival order
        self.paused: set[str] = set()
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
        token_type_ids: list[int] | None = None,
    ) -> None:
        check_params(params, self.setup, self.size)
        if not prompt_ids:  # the tokenizer stage refuses these: a caller that skipped it
            raise ValueError(f"{uid}: an empty prompt; pooling needs at least one token")
        if len(prompt_ids) > self.max_model_len:
            raise InputTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens (the "
                f"encoder's positions, or --max-model-len). However, the input has "
                f"{len(prompt_ids)} tokens. Please reduce the input."
            )
        if token_type_ids is not None and len(token_type_ids) != len(prompt_ids):
            raise ValueError(f"{uid}: {len(token_type_ids)} token types for {len(prompt_ids)} ids")
        now = time.monotonic()
        self.waiting[uid] = _Request(
            uid,
            list(prompt_ids),
            token_type_ids,
            params,
            deadline=now + timeout_s,
            arrival=now if arrival is None else arrival,
            tokenizer_s=tokenizer_s,
        )

    @property
    def size(self) -> int:
        """An embedding's length, or the classifier's number of labels."""
        return self.runner.size

    def abort(self, uid: str, finish_reason: str = "abort") -> bool:
        """End ``uid`` now; its terminal reply leaves with the next step."""
        request = self.waiting.pop(uid, None)
        self.paused.discard(uid)
        if request is None:
            return False
        reply = Reply(uid=uid, text="", num_tokens=0, finish_reason=finish_reason)
        reply.scheduler_s = time.monotonic() - request.arrival
        self._finished.append(reply)
        return True

    def drop(self, uid: str) -> bool:
        """Forget ``uid`` without a reply (the caller reports its end)."""
        self.paused.discard(uid)
        return self.waiting.pop(uid, None) is not None

    def pause(self, uid: str) -> bool:
        if uid not in self.waiting:
            return False
        self.paused.add(uid)
        return True

    def resume(self, uid: str) -> bool:
        if uid not in self.paused:
            return False
        self.paused.discard(uid)
        return True

    def has_work(self) -> bool:
        return len(self.waiting) > len(self.paused) or bool(self._finished)

    def holds(self, uid: str) -> bool:
        return uid in self.waiting

    def held_uids(self) -> list[str]:
        return list(self.waiting)

    def counts(self) -> dict[str, int]:
        # nothing runs between steps: every held request waits (or is paused)
        paused = len(self.paused)
        return {"waiting": len(self.waiting) - paused, "running": 0, "paused": paused}

    def cache_status(self) -> CacheStatus:
        return CacheStatus()  # no KV cache: nothing is kept between steps

    def expire(self, now: float | None = None) -> list[str]:
        """Abort requests past their deadline plus a margin (the api's backstop)."""
        now = time.monotonic() if now is None else now
        late = [u for u, r in self.waiting.items() if now > r.deadline + DEADLINE_MARGIN_S]
        for uid in late:
            self.abort(uid)
        return late

    # ── one step ───────────────────────────────────────────────────────────────────────────────
    def step(self) -> list[Reply]:
        """One forward over the next batch; the replies of every request it ran, and of those
        ended since the last step."""
        batch = self._schedule()
        self.step_uids = [r.uid for r in batch]
        computed = self._run(batch) if batch else []
        ended, self._finished = self._finished, []
        return ended + computed

    def _schedule(self) -> list[_Request]:
        batch: list[_Request] = []
        width = 0
        for uid, request in self.waiting.items():
            if uid in self.paused:
                continue
            wider = max(width, len(request.ids))
            padded = (len(batch) + 1) * wider
            if batch and (
                len(batch) >= self.limits.max_num_seqs
                or padded > self.limits.max_num_batched_tokens
            ):
                break  # in arrival order: a long input is not overtaken for ever
            batch.append(request)
            width = wider
        for request in batch:
            del self.waiting[request.uid]
        return batch

    def _run(self, batch: list[_Request]) -> list[Reply]:
        started = time.monotonic()
        results = self.runner.forward([(r.ids, r.types) for r in batch])
        now = time.monotonic()
        return [self._reply(r, results[i], started, now) for i, r in enumerate(batch)]

    def _reply(self, request: _Request, result: torch.Tensor, started: float, now: float) -> Reply:
        if self.setup.task == "embed":
            data = finish_embedding(result, request.params.dimensions, self.setup.normalize)
        else:
            data = result.to(torch.float32).numpy().astype("<f4").tobytes()
        return Reply(
            uid=request.uid,
            text="",
            num_tokens=0,
            finish_reason="stop",
            prompt_tokens=len(request.ids),
            tokenizer_s=request.tokenizer_s,
            queue_s=started - request.arrival,
            scheduler_s=now - request.arrival,
            pooled=data,
        )
