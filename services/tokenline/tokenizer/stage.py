"""The tokenizer stage: chat templates and tokenization, batched; rejects over-long prompts.

It holds no per-request state between batches: every message is forwarded, in order, in the
same loop iteration that received it, so aborts can never overtake their request here.
"""

from __future__ import annotations

import logging
import time

import msgspec

from tokenline import protocol
from tokenline.ledger import Ledger
from tokenline.lifecycle import Drain, freeze_startup_heap, instance_id
from tokenline.metrics import BUFFER_DEPTH, STAGE_LATENCY, serve_metrics
from tokenline.model_source import resolve
from tokenline.settings import Settings
from tokenline.transport import SyncRing

log = logging.getLogger(__name__)
BATCH_LIMIT = 256


class Tokenizer:
    """Turns `Generate` messages into `Tokenized` or terminal `Failed` ones."""

    def __init__(self, tokenizer, max_model_len: int) -> None:  # tokenizer: a transformers one
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def _render(self, request: protocol.Generate) -> str:
        if request.messages is None:
            return request.prompt or ""
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def process(
        self, requests: list[protocol.Generate]
    ) -> list[protocol.Tokenized | protocol.Failed]:
        texts: list[str | None] = []
        failures: dict[int, protocol.Failed] = {}
        for i, request in enumerate(requests):
            try:
                texts.append(self._render(request))
            except Exception as exc:  # a template error is the request's fault, not ours
                texts.append(None)
                failures[i] = protocol.Failed(
                    uid=request.uid,
                    code="invalid_request_error",
                    param="messages",
                    message=f"the chat template rejected the messages: {exc}",
                )
        # Chat templates already carry their special tokens; raw prompts get the tokenizer's.
        encoded: dict[int, list[int]] = {}
        for is_chat in (True, False):
            idx = [
                i
                for i, t in enumerate(texts)
                if t is not None and (requests[i].messages is not None) == is_chat
            ]
            if idx:
                batch = self.tokenizer([texts[i] for i in idx], add_special_tokens=not is_chat)
                encoded.update(zip(idx, batch["input_ids"], strict=True))
        out: list[protocol.Tokenized | protocol.Failed] = []
        for i, request in enumerate(requests):
            if i in failures:
                out.append(failures[i])
                continue
            out.append(self._check(request, encoded[i]))
        return out

    def _check(self, request: protocol.Generate, ids: list[int]):
        limit = self.max_model_len
        asked = request.sampling.max_tokens
        if len(ids) >= limit or (asked is not None and len(ids) + asked > limit):
            wanted = len(ids) + (asked or 0)
            return protocol.Failed(
                uid=request.uid,
                code="context_length_exceeded",
                param="messages" if request.messages is not None else "prompt",
                message=(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {wanted} tokens ({len(ids)} in the prompt, {asked or 0} for the "
                    "completion). Please reduce the prompt or max_tokens."
                ),
            )
        sampling = request.sampling
        if sampling.max_tokens is None:
            sampling = msgspec.structs.replace(sampling, max_tokens=limit - len(ids))
        return protocol.Tokenized(
            uid=request.uid,
            prompt_ids=ids,
            sampling=sampling,
            timeout_s=request.timeout_s,
        )


def run(settings: Settings) -> int:
    drain = Drain(settings.drain_timeout)
    source = resolve(settings.model, settings.model_cache_dir, settings.revision)
    tokenizer = Tokenizer(source.load_tokenizer(), source.max_model_len(settings.max_model_len))
    ring = SyncRing("tokenizer", settings.endpoints)
    if settings.metrics_port:
        serve_metrics(settings.metrics_port)
    me = instance_id()
    inbox_depth = BUFFER_DEPTH.labels(stage="tokenizer", buffer="inbox")
    latency = STAGE_LATENCY.labels(stage="tokenizer")
    ledger = Ledger("tokenizer")
    freeze_startup_heap()
    log.info("tokenizer ready: model %s, max_model_len %d", source.spec, tokenizer.max_model_len)
    try:
        while not drain.done(held=()):
            if not ring.poll(100):
                continue
            timed = ring.recv_timed(BATCH_LIMIT)
            messages = [message for _, message in timed]
            inbox_depth.set(len(messages))
            requests = [m for m in messages if isinstance(m, protocol.Generate)]
            for request in requests:  # held only while this batch is tokenized
                ledger.open(request.uid, request.timeout_s)
            results = iter(tokenizer.process(requests)) if requests else iter(())
            for arrived, message in timed:
                if isinstance(message, protocol.Generate):
                    result = next(results)
                    ledger.close(message.uid)
                    if isinstance(result, protocol.Tokenized):
                        result.tokenizer_s = time.monotonic() - arrived  # inbox wait included
                        latency.observe(result.tokenizer_s)
                    ring.send(result)
                elif isinstance(message, protocol.Heartbeat):
                    message.statuses.append(protocol.StageStatus(stage="tokenizer", instance=me))
                    ring.send(message)
                else:  # Abort, Pause, Resume: nothing held here, pass them on
                    ring.send(message)
            inbox_depth.set(0)
    finally:
        ring.close()
    return 0
