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
from collections.abc import Mapping

from tokenline.protocol import Reply
from tokenline.scheduler.engine import EngineLimits
from tokenline.scheduler.pooling.config import PoolingSetup
from tokenline.scheduler.pooling.encoder import EncoderRunner
from tokenline.scheduler.pooling.engine import CacheStatus
from tokenline.scheduler.pooling.engine_base import PoolingEngineBase, PoolingRequest
from tokenline.scheduler.refusals import InvalidRequest


class InputTooLong(InvalidRequest):
    """An input beyond the encoder's positions (or --max-model-len): it can never run."""

    code = "context_length_exceeded"
    param = "input"


class EncoderEngine(PoolingEngineBase):
    def __init__(self, runner: EncoderRunner, setup: PoolingSetup, limits: EngineLimits) -> None:
        super().__init__(setup)
        self.runner = runner
        self.limits = limits
        self.max_model_len = min(limits.max_model_len or runner.max_model_len, runner.max_model_len)
        self.waiting: dict[str, PoolingRequest] = {}  # arrival order
        self.paused: set[str] = set()

    # ── requests ───────────────────────────────────────────────────────────────────────────────
    def _admit(self, request: PoolingRequest) -> None:
        size = len(request.ids)
        if size > self.max_model_len:
            raise InputTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens (the "
                f"encoder's positions, or --max-model-len). However, the input has "
                f"{size} tokens. Please reduce the input."
            )
        if request.types is not None and len(request.types) != size:
            raise ValueError(f"{request.uid}: {len(request.types)} token types for {size} ids")
        self.waiting[request.uid] = request

    @property
    def size(self) -> int:
        """An embedding's length, or the classifier's number of labels."""
        return self.runner.size

    def _forget(self, uid: str) -> PoolingRequest | None:
        self.paused.discard(uid)
        return self.waiting.pop(uid, None)

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

    def _held(self) -> Mapping[str, PoolingRequest]:
        return self.waiting

    def counts(self) -> dict[str, int]:
        # nothing runs between steps: every held request waits (or is paused)
        paused = len(self.paused)
        return {"waiting": len(self.waiting) - paused, "running": 0, "paused": paused}

    def cache_status(self) -> CacheStatus:
        return CacheStatus()  # no KV cache: nothing is kept between steps

    # ── one step ───────────────────────────────────────────────────────────────────────────────
    def step(self) -> list[Reply]:
        """One forward over the next batch; the replies of every request it ran, and of those
        ended since the last step."""
        batch = self._schedule()
        self.step_uids = [r.uid for r in batch]
        computed = self._run(batch) if batch else []
        ended, self._finished = self._finished, []
        return ended + computed

    def _schedule(self) -> list[PoolingRequest]:
        batch: list[PoolingRequest] = []
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

    def _run(self, batch: list[PoolingRequest]) -> list[Reply]:
        started = time.monotonic()
        results = self.runner.forward([(r.ids, r.types) for r in batch])
        now = time.monotonic()
        return [self._pooled_reply(r, results[i], started, now) for i, r in enumerate(batch)]
