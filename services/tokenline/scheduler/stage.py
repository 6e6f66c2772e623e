"""The scheduler stage: routes ring messages into the engine and engine outputs onto the ring.

The runtime (`stage_runtime`) drains the inbox between engine steps and sends one batch per
step; this handler only decides what each message means for the engine.
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec

from tokenline import protocol
from tokenline.fetch.uri import redact
from tokenline.metrics import (
    KV_BLOCKS_HELD_FOR_TRANSFER,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_FAILURES,
    KV_TRANSFER_SECONDS,
    LORA_ADAPTERS,
    LORA_GENERATED_TOKENS,
    LORA_REQUESTS,
    SPEC_ACCEPTED_PER_POSITION,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
    STEP_PHASE_TIME,
    STEP_SEQUENCES,
    track_cache,
)
from tokenline.scheduler.engine import (
    Engine,
    InvalidRequest,
)
from tokenline.scheduler.engine_stage import EngineStage
from tokenline.scheduler.kv_events import KVEventPublisher
from tokenline.scheduler.lora.adapters import LoraError
from tokenline.scheduler.step_times import STEP_PHASES
from tokenline.scheduler.tenant_metrics import TenantMetrics
from tokenline.stage_runtime import internal_error

log = logging.getLogger(__name__)
PROMPT_TAIL = 8  # prompt ids the detokenizer primes its stream with


class LoraChanges(Protocol):
    """--lora-config's watcher (lora_config.LoraConfigWatcher): changes with ``action``
    (load or unload), ``name`` and ``uri``, since the last poll."""

    def poll(self) -> list: ...


class SchedulerStage(EngineStage):
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        kv_events: KVEventPublisher | None = None,
        lora_changes: LoraChanges | None = None,
    ) -> None:
        super().__init__(engine, model_name)
        self.kv_events = kv_events
        self.lora_changes = lora_changes
        # config changes that wait for an adapter of the same name to finish draining
        self._lora_pending: list = []
        track_cache(self.stage, "prefix_blocks", lambda pool=engine.pool: pool.num_cached)
        if engine.grammars is not None:
            track_cache(self.stage, "grammars", engine.grammars.cache)
        model = getattr(engine.runner, "model", None)  # a runner with no model: tests' stand-in
        self._model = {
            "architecture": getattr(model, "architecture", ""),
            "model_impl": getattr(model, "implementation", ""),
        }
        self._model_name = model_name
        # by tenant and priority, where those play a part (engine.tenant_log)
        self._tenants = TenantMetrics(engine) if engine.tenant_log is not None else None
        self._lora_series: set[str] = set()  # adapters with series of their own
        self._bytes_sent_counted = 0
        self._phases = {phase: STEP_PHASE_TIME.labels(phase=phase) for phase in STEP_PHASES}

    def lent(self) -> list[str]:
        """What a drain also waits for: prompt KV lent to decode pods, until they have read
        it or its lease ends (its uids ended here; the ledger does not count them)."""
        return [f"{uid} (KV lent)" for uid in self.engine.lent_uids()]

    # ── inbox ──────────────────────────────────────────────────────────────────────────────────
    def _abort(self, uid: str) -> bool:
        return self.engine.abort(uid) is not None

    def _ended_by_abort(self, request: protocol.Tokenized) -> list[msgspec.Struct]:
        uid = request.uid
        return [
            protocol.Begin(uid=uid, prompt_tokens=len(request.prompt_ids)),
            protocol.TokenBatch(
                outputs=[protocol.TokenOutput(uid=uid, token_ids=[], finish_reason="abort")]
            ),
        ]

    def _admit(self, request: protocol.Tokenized, arrived: float) -> list[msgspec.Struct]:
        uid = request.uid
        if request.pooling is not None:  # the api checks too, from a heartbeat that may lag
            refusal = InvalidRequest(
                "this model generates text; embeddings, rerank, score and classify need a "
                "model served with --runner pooling",
                param="model",
            )
            return [self._failed(uid, refusal)]
        try:
            self.engine.add(
                uid,
                request.prompt_ids,
                request.sampling,
                request.timeout_s,
                arrival=arrived,
                lora=request.lora,
                priority=request.priority,
                tenant=request.tenant,
            )
        except InvalidRequest as exc:
            return [self._failed(uid, exc)]
        if request.lora:
            LORA_REQUESTS.labels(adapter=request.lora).inc()
            self._lora_series.add(request.lora)
        return [
            protocol.Begin(
                uid=uid,
                prompt_tokens=len(request.prompt_ids),
                stop=request.sampling.stop,
                timeout_s=request.timeout_s,
                tokenizer_s=request.tokenizer_s,
                prompt_tail=request.prompt_ids[-PROMPT_TAIL:],
                reasoning=request.sampling.reasoning,
                skip_special_tokens=request.sampling.skip_special_tokens,
                include_stop_str_in_output=request.sampling.include_stop_str_in_output,
                min_tokens=request.sampling.min_tokens,
                stop_token_ids=request.sampling.stop_token_ids,
                echo_ids=request.prompt_ids if request.sampling.echo else [],
            )
        ]

    # ── engine ─────────────────────────────────────────────────────────────────────────────────
    def step(self) -> list[msgspec.Struct]:
        times_before = self.engine.last_step_times
        outputs = self.engine.step()
        times = self.engine.last_step_times
        if times is not times_before:  # the step ran the model
            for phase, histogram in self._phases.items():
                histogram.observe(getattr(times, phase))
            STEP_SEQUENCES.observe(times.sequences)
        if self.kv_events is not None:  # what this step stored and evicted, one batch
            self.kv_events.flush()
        if self.engine.lora_tokens:
            for adapter, count in self.engine.lora_tokens.items():
                LORA_GENERATED_TOKENS.labels(adapter=adapter).inc(count)
                self._lora_series.add(adapter)
            self.engine.lora_tokens.clear()
        if self.engine.acceptance.drafts:
            self._count_acceptance()
        if self._tenants is not None:
            self._tenants.after_step()
        if self.engine.transfers is not None:
            self._count_transfers()
        sent: list[msgspec.Struct] = [
            self._failed(uid, exc) for uid, exc in self.engine.take_rejected()
        ]
        sent += [internal_error(uid, self.stage, exc) for uid, exc in self.engine.take_failed()]
        if not outputs:
            return sent
        for out in outputs:
            if out.queue_s:
                self._queue_time.observe(out.queue_s)
            if out.finish_reason is not None:
                self._latency.observe(out.scheduler_s)
        return [*sent, protocol.TokenBatch(outputs=outputs)]

    def _count_acceptance(self) -> None:
        taken = self.engine.acceptance.take()
        model = self._model_name
        SPEC_DRAFTS.labels(model_name=model).inc(taken.drafts)
        SPEC_DRAFT_TOKENS.labels(model_name=model).inc(taken.draft_tokens)
        SPEC_ACCEPTED_TOKENS.labels(model_name=model).inc(taken.accepted_tokens)
        for position, count in enumerate(taken.accepted_per_position):
            SPEC_ACCEPTED_PER_POSITION.labels(model_name=model, position=str(position)).inc(count)

    def _count_transfers(self) -> None:
        transfers = self.engine.transfers
        sent = transfers.bytes_sent
        KV_TRANSFER_BYTES.labels(direction="sent").inc(sent - self._bytes_sent_counted)
        self._bytes_sent_counted = sent
        if transfers.lending is not None:
            KV_BLOCKS_HELD_FOR_TRANSFER.set(transfers.lending.held_blocks)
        pulls = transfers.pulls
        if pulls is None:
            return
        if pulls.bytes_read:
            KV_TRANSFER_BYTES.labels(direction="received").inc(pulls.bytes_read)
            pulls.bytes_read = 0
        for seconds in pulls.seconds:
            KV_TRANSFER_SECONDS.observe(seconds)
        pulls.seconds.clear()
        for reason, count in pulls.failures.items():
            KV_TRANSFER_FAILURES.labels(reason=reason).inc(count)
        pulls.failures.clear()

    # ── LoRA adapters ──────────────────────────────────────────────────────────────────────────
    def _lora_call(self, call: protocol.LoraCall) -> msgspec.Struct:
        """/v1/load_lora_adapter and /v1/unload_lora_adapter: the adapters served after it,
        or vLLM's error. Loading reads the adapter here, between steps (files of megabytes)."""
        loras = self.engine.loras
        try:
            if loras is None:
                raise LoraError("LoRA is not enabled; start the scheduler with --enable-lora")
            if call.action == "load":
                if not call.name or not call.uri:
                    raise LoraError("Both 'lora_name' and 'lora_path' must be provided.")
                loras.add(call.name, call.uri)
            else:
                loras.unload(call.name)  # its requests in flight finish first
        except LoraError as exc:
            code, status, message = exc.code, exc.http_status, str(exc)
        except Exception as exc:  # a corrupt file: the adapter is refused, the stage goes on
            log.exception("loading LoRA adapter %s from %s failed", call.name, redact(call.uri))
            code, status = "invalid_request_error", 400
            message = f"Loading lora {call.name} failed: {exc}"
        else:
            log.info("LoRA adapter %s %sed", call.name, call.action)
            return protocol.LoraAnswer(uid=call.uid, adapters=loras.names)
        return protocol.Failed(
            uid=call.uid, code=code, message=message, http_status=status, stage=self.stage
        )

    def _apply_lora_changes(self) -> None:
        """--lora-config: apply what changed in the file (loads of a name still draining
        wait for it to be gone)."""
        loras = self.engine.loras
        changes, self._lora_pending = [*self._lora_pending, *self.lora_changes.poll()], []
        for change in changes:
            try:
                if change.action == "unload":
                    if loras.known(change.name):
                        loras.unload(change.name)
                elif change.name in loras.draining:
                    self._lora_pending.append(change)
                elif change.name not in loras.uris:
                    loras.add(change.name, change.uri)
            except Exception as exc:  # logged: the file's other adapters still load
                log.error("--lora-config: %s %s failed: %s", change.action, change.name, exc)

    def poll_ms(self) -> int:
        """How long the loop may wait for messages when there is no step to run: a grammar
        being built on a worker thread is picked up within this."""
        return 2 if self.engine.compiling or self._reading() else 50

    def _reading(self) -> bool:
        transfers = self.engine.transfers
        return transfers is not None and transfers.in_flight()

    def _engine_status(self) -> dict:
        pool = self.engine.pool
        return {
            "kv_usage": pool.usage,
            "block_size": pool.block_size,
            "num_blocks": pool.num_blocks - 1,  # block 0 is reserved; usage counts the rest
            "grammar_refusal": self.engine.grammar_refusal,
            **self._model,
            **self._lora_status(),
        }

    def _lora_status(self) -> dict:
        loras = self.engine.loras
        if loras is None:
            return {}
        running, waiting = self.engine.lora_usage()
        return {
            "max_loras": loras.max_loras,
            "lora_running": running,
            "lora_waiting": waiting,
            "lora_adapters": loras.names,
        }

    def _cache_counts(self) -> tuple[float, int, int]:
        engine = self.engine
        return engine.pool.usage, engine.prefix_cache_queries, engine.prefix_cache_hits

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        super().housekeeping(now)
        if self._tenants is not None:
            self._tenants.housekeeping()
        if self.engine.transfers is not None:  # leases run out while no step runs too
            self._count_transfers()
        if self.engine.loras is not None:
            if self.lora_changes is not None:
                self._apply_lora_changes()
            for state, count in self.engine.loras.counts().items():
                LORA_ADAPTERS.labels(state=state).set(count)
            self._forget_unloaded_series()
        return []

    def _forget_unloaded_series(self) -> None:
        """An adapter gone (unloaded, its last request ended) takes its series with it: with
        runtime loads and unloads under new names, /metrics would otherwise grow forever."""
        gone = self._lora_series - set(self.engine.loras.uris)
        for adapter in gone:
            for metric in (LORA_REQUESTS, LORA_GENERATED_TOKENS):
                try:
                    metric.remove(adapter)
                except KeyError:  # no request of it got that far
                    pass
        self._lora_series -= gone

    def shutdown(self) -> list[msgspec.Struct]:
        last = super().shutdown()
        if self.engine.transfers is not None:  # its side channel and read worker
            self.engine.transfers.close()
        return last
