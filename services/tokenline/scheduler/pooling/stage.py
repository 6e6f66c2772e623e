"""The scheduler stage of a pooling model (``--runner pooling``): routes ring messages into the
pooling engine and sends each step's pooled results on as terminal replies, past the
detokenizer (it has no text to render)."""

from __future__ import annotations

import logging

import msgspec

from tokenline import protocol
from tokenline.metrics import track_cache
from tokenline.scheduler.engine_stage import EngineStage
from tokenline.scheduler.pooling.encoder_engine import EncoderEngine
from tokenline.scheduler.pooling.engine import PoolingEngine
from tokenline.scheduler.refusals import InvalidRequest

log = logging.getLogger(__name__)


class PoolingStage(EngineStage):
    def __init__(self, engine: PoolingEngine | EncoderEngine, model_name: str) -> None:
        super().__init__(engine, model_name)
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

    # ── inbox ──────────────────────────────────────────────────────────────────────────────────
    def _lora_call(self, call: protocol.LoraCall) -> msgspec.Struct:
        refusal = InvalidRequest("LoRA adapters are not served with --runner pooling")
        return self._failed(call.uid, refusal)

    def _abort(self, uid: str) -> bool:
        return self.engine.abort(uid)

    def _ended_by_abort(self, request: protocol.Tokenized) -> list[msgspec.Struct]:
        ended = protocol.Reply(uid=request.uid, text="", num_tokens=0, finish_reason="abort")
        return [protocol.ReplyBatch(replies=[ended])]

    def _admit(self, request: protocol.Tokenized, arrived: float) -> list[msgspec.Struct]:
        uid = request.uid
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

    # ── engine ─────────────────────────────────────────────────────────────────────────────────
    def step(self) -> list[msgspec.Struct]:
        replies = self.engine.step()
        for reply in replies:
            if reply.queue_s:
                self._queue_time.observe(reply.queue_s)
            self._latency.observe(reply.scheduler_s)
        return [protocol.ReplyBatch(replies=replies)] if replies else []

    def poll_ms(self) -> int:
        return 50

    def _engine_status(self) -> dict:
        cache = self.engine.cache_status()
        return {
            "kv_usage": cache.usage,
            "block_size": cache.block_size,
            "num_blocks": cache.num_blocks,
            "grammar_refusal": "pooling models generate no text",
            **self._status,
        }

    def _cache_counts(self) -> tuple[float, int, int]:
        cache = self.engine.cache_status()
        return cache.usage, cache.prefix_queries, cache.prefix_hits
