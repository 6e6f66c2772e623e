"""The scheduler stage of a pooling model (``--runner pooling``): routes ring messages into the
pooling engine and sends each step's pooled results on as terminal replies, past the
detokenizer (it has no text to render)."""

from __future__ import annotations

import logging

import msgspec

from tokenline import protocol
from tokenline.bounded import ExpiringSet
from tokenline.metrics import (
    BUFFER_DEPTH,
    KV_CACHE_USAGE,
    LATE_REPLIES,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    QUEUE_TIME,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    STAGE_LATENCY,
    track_cache,
)
from tokenline.scheduler.pooling.encoder_engine import EncoderEngine
from tokenline.scheduler.pooling.engine import PoolingEngine
from tokenline.scheduler.refusals import InvalidRequest
from tokenline.scheduler.stage import MAX_TOMBSTONES, TOMBSTONE_TTL_S

log = logging.getLogger(__name__)


class PoolingStage:
    stage = "scheduler"

    def __init__(self, engine: PoolingEngine | EncoderEngine, model_name: str) -> None:
        self.engine = engine
        # an abort that overtook its request (a restart upstream): refused when it comes
        self.tombstones = ExpiringSet(MAX_TOMBSTONES, TOMBSTONE_TTL_S)
        track_cache(self.stage, "tombstones", self.tombstones)
        track_cache(self.stage, "prefix_blocks", lambda: engine.cache_status().cached_blocks)
        runner = engine.runner
        setup = engine.setup
        config = runner.config
        labels = getattr(config, "id2label", None) or {}
        classify = setup.task == "classify"
        self._status = {
            "architecture": setup.architecture,
            "model_impl": getattr(runner, "implementation", "")
            or getattr(runner.model, "implementation", ""),
            "pooling": protocol.PoolingInfo(
                task=setup.task,
                size=engine.size,
                matryoshka=setup.matryoshka,
                labels=[str(labels[i]) for i in sorted(labels)] if classify else [],
                problem_type=(getattr(config, "problem_type", None) or "") if classify else "",
            ),
        }
        self._late = LATE_REPLIES.labels(stage="scheduler")
        self._latency = STAGE_LATENCY.labels(stage="scheduler")
        self._queue_time = QUEUE_TIME.labels(model=model_name)
        self._running = REQUESTS_RUNNING.labels(model=model_name)
        self._waiting = REQUESTS_WAITING.labels(model=model_name)
        self._kv_usage = KV_CACHE_USAGE.labels(model=model_name)
        self._prefix_queries = PREFIX_CACHE_QUERIES.labels(model=model_name)
        self._prefix_hits = PREFIX_CACHE_HITS.labels(model=model_name)
        self._prefix_counted = (0, 0)
        self._depth = {
            b: BUFFER_DEPTH.labels(stage="scheduler", buffer=b)
            for b in ("waiting", "running", "paused")
        }

    # ── inbox ──────────────────────────────────────────────────────────────────────────────────
    def handle(self, message: msgspec.Struct, arrived: float) -> list[msgspec.Struct]:
        if isinstance(message, protocol.Tokenized):
            return self._admit(message, arrived)
        if isinstance(message, protocol.LoraCall):
            return [
                self._failed(
                    message.uid,
                    InvalidRequest("LoRA adapters are not served with --runner pooling"),
                )
            ]
        if isinstance(message, protocol.Abort):
            if not self.engine.abort(message.uid):
                if message.reason != "stop_string":
                    self.tombstones.add(message.uid)
                return [message]
            return []  # the engine's terminal reply leaves with the next step
        if isinstance(message, protocol.Pause):
            self.engine.pause(message.uid)
        elif isinstance(message, protocol.Resume):
            self.engine.resume(message.uid)
        else:  # Failed, TokenizerAnswer: on their way to the api
            return [message]
        return []

    def _admit(self, request: protocol.Tokenized, arrived: float) -> list[msgspec.Struct]:
        uid = request.uid
        if uid in self.tombstones:
            self.tombstones.discard(uid)
            self._late.inc()
            ended = protocol.Reply(uid=uid, text="", num_tokens=0, finish_reason="abort")
            return [protocol.ReplyBatch(replies=[ended])]
        try:
            self.engine.add(
                uid,
                request.prompt_ids,
                request.pooling,
                request.timeout_s,
                arrival=arrived,
                tokenizer_s=request.tokenizer_s,
                token_type_ids=request.token_type_ids,
            )
        except InvalidRequest as exc:
            return [self._failed(uid, exc)]
        return []

    def _failed(self, uid: str, exc: InvalidRequest) -> protocol.Failed:
        return protocol.Failed(
            uid=uid,
            code=exc.code,
            message=str(exc),
            param=exc.param,
            http_status=exc.http_status,
            stage=self.stage,
        )

    # ── engine ─────────────────────────────────────────────────────────────────────────────────
    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> list[msgspec.Struct]:
        replies = self.engine.step()
        for reply in replies:
            if reply.queue_s:
                self._queue_time.observe(reply.queue_s)
            self._latency.observe(reply.scheduler_s)
        return [protocol.ReplyBatch(replies=replies)] if replies else []

    def poll_ms(self) -> int:
        return 50

    def step_uids(self) -> list[str]:
        return list(self.engine.step_uids)

    def held(self) -> list[str]:
        return self.engine.held_uids()

    def status(self) -> protocol.StageStatus:
        counts = self.engine.counts()
        cache = self.engine.cache_status()
        return protocol.StageStatus(
            stage=self.stage,
            instance="",
            waiting=counts["waiting"],
            running=counts["running"],
            kv_usage=cache.usage,
            block_size=cache.block_size,
            num_blocks=cache.num_blocks,
            grammar_refusal="pooling models generate no text",
            **self._status,
        )

    def drop(self, uid: str) -> list[msgspec.Struct]:
        self.engine.drop(uid)
        return []

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        self.engine.expire(now)  # their terminal replies leave with the next step
        self.tombstones.prune(now)
        counts = self.engine.counts()
        self._running.set(counts["running"])
        self._waiting.set(counts["waiting"])
        cache = self.engine.cache_status()
        self._kv_usage.set(cache.usage)
        for buffer, gauge in self._depth.items():
            gauge.set(counts[buffer])
        queries, hits = cache.prefix_queries, cache.prefix_hits
        self._prefix_queries.inc(queries - self._prefix_counted[0])
        self._prefix_hits.inc(hits - self._prefix_counted[1])
        self._prefix_counted = (queries, hits)
        return []

    def shutdown(self) -> list[msgspec.Struct]:
        for uid in self.engine.held_uids():  # drain time is up
            self.engine.abort(uid)
        return self.step()
