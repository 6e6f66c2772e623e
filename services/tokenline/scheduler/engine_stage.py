"""What the scheduler stage does alike for a generating engine (stage.py) and a pooling one
(pooling/stage.py): the tombstones of aborts that overtook their request, the messages that mean
the same to either engine (abort, pause, resume, drop), refusals as `Failed`, and the gauges of
the engine's queues and caches. Each subclass admits requests, answers LoRA calls and reports
its status in its own way."""

from __future__ import annotations

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
from tokenline.scheduler.refusals import InvalidRequest

# An abort overtakes its request only while both are in flight (queued behind a restarted
# stage); a request that arrives later than this after its abort runs to its own deadline.
TOMBSTONE_TTL_S = 60.0
MAX_TOMBSTONES = 65_536


class EngineStage:
    """A scheduler stage around an engine that has ``abort``, ``pause``, ``resume``, ``drop``,
    ``expire``, ``counts``, ``has_work``, ``held_uids`` and ``step_uids``."""

    stage = "scheduler"

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        # An abort that overtakes its request (for example after a restart upstream) is
        # remembered here, so the request is refused when it arrives.
        self.tombstones = ExpiringSet(MAX_TOMBSTONES, TOMBSTONE_TTL_S)
        track_cache(self.stage, "tombstones", self.tombstones)
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

    # ── what each engine does its own way ──────────────────────────────────────────────────────
    def _admit(self, request: protocol.Tokenized, arrived: float) -> list[msgspec.Struct]:
        raise NotImplementedError

    def _ended_by_abort(self, request: protocol.Tokenized) -> list[msgspec.Struct]:
        """The terminal messages of a request whose abort overtook it: it never runs."""
        raise NotImplementedError

    def _lora_call(self, call: protocol.LoraCall) -> msgspec.Struct:
        raise NotImplementedError

    def _abort(self, uid: str) -> bool:
        """Whether the engine held ``uid`` (and so ends it with a terminal reply)."""
        raise NotImplementedError

    def _cache_counts(self) -> tuple[float, int, int]:
        """The KV cache's usage, and the prefix cache's queries and hits so far."""
        raise NotImplementedError

    def _engine_status(self) -> dict:
        """`StageStatus` fields beyond the queues: the cache, the model, what it refuses."""
        raise NotImplementedError

    # ── inbox ──────────────────────────────────────────────────────────────────────────────────
    def handle(self, message: msgspec.Struct, arrived: float) -> list[msgspec.Struct]:
        if isinstance(message, protocol.Tokenized):
            if message.uid in self.tombstones:
                self.tombstones.discard(message.uid)
                self._late.inc()
                return self._ended_by_abort(message)
            return self._admit(message, arrived)
        if isinstance(message, protocol.LoraCall):
            return [self._lora_call(message)]
        if isinstance(message, protocol.Abort):
            if not self._abort(message.uid):
                # The api sends a stop string's abort after the uid's first reply, so the
                # request came through here already: most often it has ended since.
                if message.reason != "stop_string":
                    self.tombstones.add(message.uid)
                return [message]
            return []  # the engine's terminal output leaves with the next step, behind the rest
        if isinstance(message, protocol.Pause):
            self.engine.pause(message.uid)
        elif isinstance(message, protocol.Resume):
            self.engine.resume(message.uid)
        else:  # Failed, TokenizerAnswer: on their way from the tokenizer to the api
            return [message]
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
        raise NotImplementedError

    def step_uids(self) -> list[str]:
        return list(self.engine.step_uids)

    def held(self) -> list[str]:
        return self.engine.held_uids()

    def status(self) -> protocol.StageStatus:
        counts = self.engine.counts()
        return protocol.StageStatus(
            stage=self.stage,
            instance="",
            waiting=counts["waiting"],
            running=counts["running"],
            **self._engine_status(),
        )

    def drop(self, uid: str) -> list[msgspec.Struct]:
        self.engine.drop(uid)
        return []

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        self.engine.expire(now)  # their terminal outputs leave with the next step
        self.tombstones.prune(now)
        counts = self.engine.counts()
        self._running.set(counts["running"])
        self._waiting.set(counts["waiting"])
        for buffer, gauge in self._depth.items():
            gauge.set(counts[buffer])
        usage, queries, hits = self._cache_counts()
        self._kv_usage.set(usage)
        self._prefix_queries.inc(queries - self._prefix_counted[0])
        self._prefix_hits.inc(hits - self._prefix_counted[1])
        self._prefix_counted = (queries, hits)
        return []

    def shutdown(self) -> list[msgspec.Struct]:
        for uid in self.engine.held_uids():  # drain time is up
            self.engine.abort(uid)
        return self.step()
