"""The tokenizer stage: chat templates and tokenization, batched; rejects over-long prompts.

It holds no per-request state between batches: every message is forwarded, in order, in the
same loop iteration that received it, so aborts can never overtake their request here.
"""

from __future__ import annotations

import json
import logging
import time

import msgspec

from tokenline import protocol
from tokenline.lifecycle import Drain
from tokenline.metrics import STAGE_LATENCY, serve_metrics
from tokenline.model_source import resolve
from tokenline.settings import Settings
from tokenline.stage_runtime import StepFreeHandler, serve_stage
from tokenline.transport import SyncRing

log = logging.getLogger(__name__)


def _template_message(message: protocol.ChatMessage) -> dict:
    """A message as chat templates read it. A call's arguments are an object there (Qwen's
    template writes them with ``tojson``), not the JSON text OpenAI carries them as."""
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


class Tokenizer:
    """Turns `Generate` messages into `Tokenized` or terminal `Failed` ones."""

    def __init__(self, tokenizer, max_model_len: int) -> None:  # tokenizer: a transformers one
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def _render(self, request: protocol.Generate) -> str:
        if request.messages is None:
            return request.prompt or ""
        messages = [_template_message(m) for m in request.messages]
        return self.tokenizer.apply_chat_template(
            messages, tools=request.tools, tokenize=False, add_generation_prompt=True
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
        param = "messages" if request.messages is not None else "prompt"
        if not ids:
            return protocol.Failed(
                uid=request.uid,
                code="invalid_request_error",
                param=param,
                message=f"the {param} is empty after tokenization; send at least one token",
            )
        limit = self.max_model_len
        asked = request.sampling.max_tokens
        if len(ids) >= limit or (asked is not None and len(ids) + asked > limit):
            wanted = len(ids) + (asked or 0)
            return protocol.Failed(
                uid=request.uid,
                code="context_length_exceeded",
                param=param,
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


class TokenizerStage(StepFreeHandler):
    """The tokenizer as a stage handler: it holds nothing between batches, so every message
    leaves in the batch that brought it, in order, and aborts never overtake their request."""

    stage = "tokenizer"
    batch_limit = 256  # a batch is tokenized at once; heartbeats wait behind it

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._latency = STAGE_LATENCY.labels(stage="tokenizer")

    def handle_batch(self, batch: list[tuple[float, msgspec.Struct]]) -> list[msgspec.Struct]:
        requests = [m for _, m in batch if isinstance(m, protocol.Generate)]
        results = iter(self.tokenizer.process(requests)) if requests else iter(())
        out: list[msgspec.Struct] = []
        for arrived, message in batch:
            if isinstance(message, protocol.Generate):
                result = next(results)
                if isinstance(result, protocol.Tokenized):
                    result.tokenizer_s = time.monotonic() - arrived  # inbox wait included
                    self._latency.observe(result.tokenizer_s)
                out.append(result)
            else:  # Abort, Pause, Resume: nothing held here, pass them on
                out.append(message)
        return out

    def handle(self, message: msgspec.Struct, arrived: float) -> list[msgspec.Struct]:
        return self.handle_batch([(arrived, message)])

    def held(self) -> tuple[str, ...]:
        return ()

    def status(self) -> protocol.StageStatus:
        return protocol.StageStatus(stage=self.stage, instance="")

    def fail(self, uid: str) -> list[msgspec.Struct]:
        return []


def run(settings: Settings) -> int:
    drain = Drain(settings.drain_timeout)
    source = resolve(settings.model, settings.model_cache_dir, settings.revision)
    tokenizer = Tokenizer(source.load_tokenizer(), source.max_model_len(settings.max_model_len))
    if settings.metrics_port:
        serve_metrics(settings.metrics_port)
    ring = SyncRing("tokenizer", settings.endpoints, settings.ring_security)
    log.info("tokenizer ready: model %s, max_model_len %d", source.spec, tokenizer.max_model_len)
    serve_stage(TokenizerStage(tokenizer), ring, drain)
    return 0
