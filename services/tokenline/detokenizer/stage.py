"""The detokenizer stage: token ids to text for every live uid; one reply batch per step.

Per-uid state is created on `Begin` and freed on every terminal event: the scheduler's final
output, a stop string, a `Failed`, or an `Abort` for a uid still held.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tokenline import protocol
from tokenline.detokenizer.incremental import IncrementalDecoder
from tokenline.detokenizer.token_text import TokenTexts
from tokenline.ledger import Ledger
from tokenline.lifecycle import Drain, freeze_startup_heap, instance_id
from tokenline.metrics import BUFFER_DEPTH, LATE_REPLIES, STAGE_LATENCY, serve_metrics
from tokenline.model_source import resolve
from tokenline.settings import Settings
from tokenline.transport import SyncRing

log = logging.getLogger(__name__)


@dataclass
class _Live:
    decoder: IncrementalDecoder
    prompt_tokens: int
    tokenizer_s: float = 0.0
    queue_s: float = 0.0


class Detokenizer:
    def __init__(self, tokenizer, ring: SyncRing) -> None:  # tokenizer: tokenizers.Tokenizer
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.ring = ring
        self.live: dict[str, _Live] = {}
        self.ledger = Ledger("detokenizer")
        self.instance = instance_id()
        self._late = LATE_REPLIES.labels(stage="detokenizer")
        self._latency = STAGE_LATENCY.labels(stage="detokenizer")

    def handle(self, message: protocol.ToDetokenizer, arrived: float | None = None) -> None:
        """``arrived``: when the message reached this stage's inbox (monotonic)."""
        if isinstance(message, protocol.TokenBatch):
            started = time.monotonic() if arrived is None else arrived
            replies = [r for r in (self._decode(o, started) for o in message.outputs) if r]
            if replies:
                self.ring.send(protocol.ReplyBatch(replies=replies))
        elif isinstance(message, protocol.Begin):
            self.live[message.uid] = _Live(
                IncrementalDecoder(self.tokenizer, message.stop),
                message.prompt_tokens,
                message.tokenizer_s,
            )
            self.ledger.open(message.uid, message.timeout_s or 3600.0)
        elif isinstance(message, protocol.Heartbeat):
            message.statuses.append(
                protocol.StageStatus(stage="detokenizer", instance=self.instance)
            )
            self.ring.send(message)
        else:  # Failed, Abort: the end of a uid; free it if held, pass the message on
            self._release(message.uid)
            self.ring.send(message)

    def _decode(self, out: protocol.TokenOutput, started: float) -> protocol.Reply | None:
        live = self.live.get(out.uid)
        if live is None:
            if out.finish_reason is None:
                self._late.inc()  # tokens for a uid already ended here (stop string, abort)
                return None
            return protocol.Reply(
                uid=out.uid, text="", num_tokens=len(out.token_ids), finish_reason=out.finish_reason
            )
        if out.queue_s:
            live.queue_s = out.queue_s
        text = live.decoder.feed(out.token_ids)
        finish = out.finish_reason
        stop_string = live.decoder.stopped
        if stop_string:
            finish = "stop"
        elif finish is not None:
            text += live.decoder.flush()
        reply = protocol.Reply(
            uid=out.uid, text=text, num_tokens=len(out.token_ids), finish_reason=finish
        )
        if out.logprobs is not None:
            # After a stop string, the tokens up to the one that completed the match keep theirs.
            reply.logprobs = [self.token_texts.entry(lp) for lp in out.logprobs]
        if finish is not None:
            reply.stop_string = stop_string and out.finish_reason is None
            reply.prompt_tokens = live.prompt_tokens
            reply.tokenizer_s = live.tokenizer_s
            reply.queue_s = live.queue_s
            reply.scheduler_s = out.scheduler_s
            # the terminal message's own time: what this stage adds to the request's end
            reply.detokenizer_s = time.monotonic() - started
            if out.error_code:
                reply.error_code = out.error_code
            self._latency.observe(reply.detokenizer_s)
            self._release(out.uid)
        return reply

    def _release(self, uid: str) -> None:
        if self.live.pop(uid, None) is not None:
            self.ledger.close(uid)

    def sweep(self) -> None:
        for uid in self.ledger.sweep(list(self.live)):
            self.live.pop(uid, None)


def run(settings: Settings) -> int:
    drain = Drain(settings.drain_timeout)
    source = resolve(settings.model, settings.model_cache_dir, settings.revision)
    tokenizer = source.load_tokenizer().backend_tokenizer
    if settings.metrics_port:
        serve_metrics(settings.metrics_port)
    ring = SyncRing("detokenizer", settings.endpoints)
    stage = Detokenizer(tokenizer, ring)
    inbox_depth = BUFFER_DEPTH.labels(stage="detokenizer", buffer="inbox")
    next_sweep = 0.0
    freeze_startup_heap()
    log.info("detokenizer ready: %s", source.spec)
    try:
        while not drain.done(held=stage.live.keys()):
            if ring.poll(100):
                messages = ring.recv_timed()
                inbox_depth.set(len(messages))
                for arrived, message in messages:
                    stage.handle(message, arrived)
            if time.monotonic() > next_sweep:
                stage.sweep()
                next_sweep = time.monotonic() + 1.0
    finally:
        ring.close()
    return 0
