"""The scheduler stage: drains its inbox between engine steps and sends one batch per step."""

from __future__ import annotations

import logging
import time

from tokenline import protocol
from tokenline.ledger import BoundedSet, Ledger
from tokenline.lifecycle import Drain, freeze_startup_heap, instance_id
from tokenline.metrics import (
    BUFFER_DEPTH,
    KV_CACHE_USAGE,
    LATE_REPLIES,
    QUEUE_TIME,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    STAGE_LATENCY,
    serve_metrics,
)
from tokenline.model_source import resolve
from tokenline.scheduler.engine import (
    Engine,
    EngineLimits,
    InvalidRequest,
    default_token_budget,
)
from tokenline.scheduler.runner import ModelRunner
from tokenline.settings import Settings
from tokenline.transport import SyncRing

log = logging.getLogger(__name__)
HOUSEKEEPING_INTERVAL_S = 0.5


class SchedulerStage:
    """Routes ring messages into the engine and engine outputs onto the ring."""

    def __init__(self, engine: Engine, ring: SyncRing, model_name: str) -> None:
        self.engine = engine
        self.ring = ring
        self.instance = instance_id()
        self.ledger = Ledger("scheduler")
        # An abort that overtakes its request (for example after a restart upstream) is
        # remembered here, so the request is refused when it arrives.
        self.tombstones = BoundedSet(65_536)
        self._late = LATE_REPLIES.labels(stage="scheduler")
        self._latency = STAGE_LATENCY.labels(stage="scheduler")
        self._queue_time = QUEUE_TIME.labels(model=model_name)
        self._running = REQUESTS_RUNNING.labels(model=model_name)
        self._waiting = REQUESTS_WAITING.labels(model=model_name)
        self._kv_usage = KV_CACHE_USAGE.labels(model=model_name)
        self._depth = {
            b: BUFFER_DEPTH.labels(stage="scheduler", buffer=b)
            for b in ("waiting", "running", "paused", "inbox")
        }
        self._next_housekeeping = 0.0

    # ── inbox ──────────────────────────────────────────────────────────────────────────────────
    def handle(self, message: protocol.ToScheduler, arrived: float | None = None) -> None:
        """``arrived``: when the message reached this stage's inbox (monotonic)."""
        if isinstance(message, protocol.Tokenized):
            self._admit(message, time.monotonic() if arrived is None else arrived)
        elif isinstance(message, protocol.Abort):
            if self.engine.abort(message.uid) is None:
                self.tombstones.add(message.uid)
                self.ring.send(message)
            # else: the engine emits the terminal output behind everything sent so far
        elif isinstance(message, protocol.Pause):
            self.engine.pause(message.uid)
        elif isinstance(message, protocol.Resume):
            self.engine.resume(message.uid)
        elif isinstance(message, protocol.Heartbeat):
            sched = self.engine.scheduler
            message.statuses.append(
                protocol.StageStatus(
                    stage="scheduler",
                    instance=self.instance,
                    waiting=len(sched.waiting),
                    running=len(sched.running),
                )
            )
            self.ring.send(message)
        else:  # Failed: a terminal error from upstream, on its way to the api
            self.ring.send(message)

    def _admit(self, request: protocol.Tokenized, arrived: float) -> None:
        uid = request.uid
        if uid in self.tombstones:
            self.tombstones.discard(uid)
            self._late.inc()
            self.ring.send(protocol.Begin(uid=uid, prompt_tokens=len(request.prompt_ids)))
            self.ring.send(
                protocol.TokenBatch(
                    outputs=[protocol.TokenOutput(uid=uid, token_ids=[], finish_reason="abort")]
                )
            )
            return
        try:
            self.engine.add(
                uid, request.prompt_ids, request.sampling, request.timeout_s, arrival=arrived
            )
        except InvalidRequest as exc:
            self.ring.send(
                protocol.Failed(uid=uid, code=exc.code, message=str(exc), param=exc.param)
            )
            return
        self.ledger.open(uid, request.timeout_s)
        self.ring.send(
            protocol.Begin(
                uid=uid,
                prompt_tokens=len(request.prompt_ids),
                stop=request.sampling.stop,
                timeout_s=request.timeout_s,
                tokenizer_s=request.tokenizer_s,
            )
        )

    # ── engine ─────────────────────────────────────────────────────────────────────────────────
    def step(self) -> None:
        outputs = self.engine.step()
        if not outputs:
            return
        for out in outputs:
            if out.queue_s:
                self._queue_time.observe(out.queue_s)
            if out.finish_reason is not None:
                self.ledger.close(out.uid)
                self._latency.observe(out.scheduler_s)
        self.ring.send(protocol.TokenBatch(outputs=outputs))

    def housekeeping(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_housekeeping:
            return
        self._next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
        self.engine.expire(now)
        held = list(self.engine.scheduler.by_uid)
        for uid in self.ledger.sweep(held):
            self.engine.abort(uid)
        sched = self.engine.scheduler
        self._running.set(len(sched.running))
        self._waiting.set(len(sched.waiting))
        self._kv_usage.set(self.engine.pool.usage)
        self._depth["waiting"].set(len(sched.waiting))
        self._depth["running"].set(len(sched.running))
        self._depth["paused"].set(len(sched.paused))

    def loop(self, drain: Drain) -> None:
        while not drain.done(held=self.engine.scheduler.by_uid.keys()):
            busy = self.engine.has_work()
            if self.ring.poll(0 if busy else 50):
                messages = self.ring.recv_timed()
                self._depth["inbox"].set(len(messages))
                for arrived, message in messages:
                    self.handle(message, arrived)
            if self.engine.has_work():
                self.step()
            self.housekeeping()
        for uid in list(self.engine.scheduler.by_uid):  # drain time is up
            self.engine.abort(uid)
        self.step()
        self.housekeeping(force=True)


def run(settings: Settings) -> int:
    drain = Drain(settings.drain_timeout)
    source = resolve(settings.model, settings.model_cache_dir, settings.revision)
    if settings.metrics_port:
        serve_metrics(settings.metrics_port)
    runner = ModelRunner(
        source,
        settings.device,
        settings.dtype,
        settings.block_size,
        settings.kv_cache_memory,
        settings.gpu_memory_utilization,
        settings.torch_threads,
        compile_layers=settings.compile,
    )
    budget = settings.max_num_batched_tokens or default_token_budget(runner.device.type)
    limits = EngineLimits(
        source.max_model_len(settings.max_model_len), settings.max_num_seqs, budget
    )
    engine = Engine(runner, limits, source.eos_token_ids())
    ring = SyncRing("scheduler", settings.endpoints)
    stage = SchedulerStage(engine, ring, settings.model_name)
    stage.housekeeping(force=True)
    freeze_startup_heap()
    log.info("scheduler ready: %s, %d KV blocks", source.spec, runner.num_blocks)
    try:
        stage.loop(drain)
    finally:
        ring.close()
    return 0
