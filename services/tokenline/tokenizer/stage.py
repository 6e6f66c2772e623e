"""The tokenizer stage: chat templates and tokenization, batched.

It owns the rules on a prompt's length (`PromptEncoder._check`): an empty prompt and one that
leaves the context no room are refused here, ``max_tokens`` is held to the rest of the context
(an unset one becomes it; a larger one is cut to it, as vLLM 0.32's ``get_max_tokens`` cuts),
and a ``min_tokens`` above it is refused; the scheduler's engine relies on all three.

It holds no per-request state between batches: every message is forwarded, in order, in the
same loop iteration that received it, so aborts can never overtake their request here. It also
answers the api's `protocol.TokenizeCall`s (/tokenize, /detokenize) itself, and passes the
api's `protocol.LoraCall`s on to the scheduler, which answers them.
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
from tokenline.tokenizer.content_format import ContentFormat, template_content
from tokenline.tokenizer.content_format import resolve as resolve_content_format
from tokenline.tokenizer.pooling import check_pooled, encode_pairs
from tokenline.transport import SyncRing

log = logging.getLogger(__name__)


def _template_arguments(text: str) -> object:
    """A call's arguments as templates read them: an object (Qwen's template writes them with
    ``tojson``), not the JSON text OpenAI carries them as. Text that is no JSON object (an
    earlier turn's broken call) stays text, so the history renders as it was written; no
    arguments at all (the usual form of a call without parameters) are an empty object, as
    vLLM renders them (a template that writes them as they are would otherwise print nothing
    where JSON belongs)."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _template_message(message: protocol.ChatMessage, fmt: ContentFormat = "string") -> dict:
    """A message as chat templates read it, its content in ``fmt``."""
    out: dict = {"role": message.role, "content": template_content(message, fmt)}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _template_arguments(c.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning  # the name Qwen3's and R1's templates read
    return out


def _template_text(hf_tokenizer) -> str | None:
    """The template chats render with (the default one of several), None without one."""
    try:
        return hf_tokenizer.get_chat_template()
    except ValueError:  # no template: chats are refused when they come
        return None


def _invalid(uid: str, param: str, message: str) -> protocol.Failed:
    return protocol.Failed(uid=uid, code="invalid_request_error", param=param, message=message)


class PromptEncoder:
    """The stage's work over the model's own (transformers) tokenizer, ``hf_tokenizer``:
    turns `Generate` messages into `Tokenized` or terminal `Failed` ones (chat templates
    rendered, text encoded, ids checked), and answers `TokenizeCall`s with `TokenizerAnswer`s."""

    def __init__(
        self, hf_tokenizer, max_model_len: int, content_format: ContentFormat = "string"
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.max_model_len = max_model_len
        self.content_format = content_format  # how messages' content reaches the template
        self.vocab_size = len(hf_tokenizer)  # added tokens included: every id decode() knows

    def _render(self, request: protocol.Generate | protocol.TokenizeCall) -> str:
        """The prompt's text; raises when the chat template refuses the messages."""
        if request.messages is None:
            return request.prompt or ""
        messages = [_template_message(m, self.content_format) for m in request.messages]
        extra = request.template_kwargs or {}
        return self.hf_tokenizer.apply_chat_template(
            messages,
            tools=request.tools,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            **extra,
        )

    def _out_of_vocab(self, uid: str, ids: list[int], param: str) -> protocol.Failed | None:
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is None:
            return None
        return _invalid(
            uid,
            param,
            f"token id {bad} is out of vocabulary: this model's ids run from 0 to "
            f"{self.vocab_size - 1} (vocab size {self.vocab_size})",
        )

    def _encode_rendered(
        self,
        requests: list[tuple[int, protocol.Generate | protocol.TokenizeCall, bool]],
        failed: dict[int, protocol.Failed],
    ) -> dict[int, list[int]]:
        """(index, request, add_special_tokens) to {index: ids}: each prompt rendered, then one
        batched tokenizer call per value of ``add_special_tokens``. A request whose chat
        template fails goes into ``failed`` instead."""
        texts: list[tuple[int, str, bool]] = []
        for i, request, special in requests:
            try:
                texts.append((i, self._render(request), special))
            except Exception as exc:  # a template error is the request's fault, not ours
                failed[i] = _invalid(
                    request.uid, "messages", f"the chat template rejected the messages: {exc}"
                )
        encoded: dict[int, list[int]] = {}
        for special in (True, False):
            chosen = [(i, t) for i, t, s in texts if s == special]
            if chosen:
                batch = self.hf_tokenizer([t for _, t in chosen], add_special_tokens=special)
                encoded.update(zip((i for i, _ in chosen), batch["input_ids"], strict=True))
        return encoded

    def process(
        self, requests: list[protocol.Generate]
    ) -> list[protocol.Tokenized | protocol.Failed]:
        to_encode = []
        done: dict[int, protocol.Tokenized | protocol.Failed] = {}
        pairs = [(i, r) for i, r in enumerate(requests) if r.pooling and r.pooling.text_pair]
        for i, (ids, types) in encode_pairs(self.hf_tokenizer, pairs).items():
            done[i] = check_pooled(requests[i], ids, self.max_model_len, types)
        for i, request in enumerate(requests):
            if i in done:
                continue
            if request.prompt_ids is not None:  # tokenized by the client: checked, not encoded
                bad = self._out_of_vocab(request.uid, request.prompt_ids, "prompt")
                done[i] = bad or self._check(request, list(request.prompt_ids))
            else:
                # Chat templates carry their special tokens; raw prompts get the tokenizer's.
                to_encode.append((i, request, request.messages is None))
        encoded = self._encode_rendered(to_encode, done)
        return [
            done[i] if i in done else self._check(request, encoded[i])
            for i, request in enumerate(requests)
        ]

    def answer(
        self, calls: list[protocol.TokenizeCall]
    ) -> list[protocol.TokenizerAnswer | protocol.Failed]:
        """Tokenize (or detokenize) what each call asks; no length limit applies here, so a
        client can measure a prompt that would be too long to serve."""
        to_encode = []
        done: dict[int, protocol.TokenizerAnswer | protocol.Failed] = {}
        for i, call in enumerate(calls):
            if call.decode is not None:
                bad = self._out_of_vocab(call.uid, call.decode, "tokens")
                text = None if bad else self.hf_tokenizer.decode(call.decode)
                done[i] = bad or protocol.TokenizerAnswer(uid=call.uid, text=text)
            else:
                to_encode.append((i, call, call.add_special_tokens))
        encoded = self._encode_rendered(to_encode, done)
        out: list[protocol.TokenizerAnswer | protocol.Failed] = []
        for i, call in enumerate(calls):
            if i in done:
                out.append(done[i])
                continue
            ids = encoded[i]
            strs = self.hf_tokenizer.convert_ids_to_tokens(ids) if call.return_token_strs else None
            out.append(
                protocol.TokenizerAnswer(
                    uid=call.uid, ids=ids, token_strs=strs, max_model_len=self.max_model_len
                )
            )
        return out

    def _check(self, request: protocol.Generate, ids: list[int]):
        if request.pooling is not None:  # nothing is generated: the input may fill the context
            return check_pooled(request, ids, self.max_model_len)
        param = "messages" if request.messages is not None else "prompt"
        if not ids and request.prompt_ids is not None:
            return _invalid(request.uid, param, "the prompt holds no token ids; send at least one")
        if not ids:
            return protocol.Failed(
                uid=request.uid,
                code="invalid_request_error",
                param=param,
                message=f"the {param} is empty after tokenization; send at least one token",
            )
        limit = self.max_model_len
        if len(ids) >= limit:
            return protocol.Failed(
                uid=request.uid,
                code="context_length_exceeded",
                param=param,
                message=(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt contains {len(ids)} tokens, which leaves no room for the "
                    "completion. Please reduce the length of the prompt."
                ),
            )
        sampling = request.sampling
        room = limit - len(ids)
        if sampling.max_tokens is None or sampling.max_tokens > room:
            sampling = msgspec.structs.replace(sampling, max_tokens=room)
        if sampling.min_tokens > sampling.max_tokens:
            return _invalid(
                request.uid,
                "min_tokens",
                f"min_tokens is {sampling.min_tokens}, more than the {sampling.max_tokens} "
                "tokens this request may generate (its max_tokens, the generation config's "
                "max_new_tokens, or the context the prompt leaves); lower min_tokens",
            )
        return protocol.Tokenized(
            uid=request.uid,
            prompt_ids=ids,
            sampling=sampling,
            timeout_s=request.timeout_s,
            lora=request.lora,  # the scheduler picks the adapter's weights by it
            priority=request.priority,
            tenant=request.tenant,
        )


class TokenizerStage(StepFreeHandler):
    """The tokenizer stage's handler, its `PromptEncoder` doing the work: it holds nothing
    between batches, so every message leaves in the batch that brought it, in order, and
    aborts never overtake their request."""

    stage = "tokenizer"
    batch_limit = 256  # a batch is tokenized at once; heartbeats wait behind it

    def __init__(self, encoder: PromptEncoder) -> None:
        self.encoder = encoder
        self._latency = STAGE_LATENCY.labels(stage="tokenizer")

    def handle_batch(self, batch: list[tuple[float, msgspec.Struct]]) -> list[msgspec.Struct]:
        requests = [m for _, m in batch if isinstance(m, protocol.Generate)]
        calls = [m for _, m in batch if isinstance(m, protocol.TokenizeCall)]
        results = iter(self.encoder.process(requests)) if requests else iter(())
        answers = iter(self.encoder.answer(calls)) if calls else iter(())
        out: list[msgspec.Struct] = []
        for arrived, message in batch:
            if isinstance(message, protocol.Generate):
                result = next(results)
                if isinstance(result, protocol.Tokenized):
                    result.tokenizer_s = time.monotonic() - arrived  # inbox wait included
                    self._latency.observe(result.tokenizer_s)
                out.append(result)
            elif isinstance(message, protocol.TokenizeCall):
                out.append(next(answers))
            else:  # Abort, Pause, Resume, LoraCall: nothing held here, pass them on
                out.append(message)
        return out

    def handle(self, message: msgspec.Struct, arrived: float) -> list[msgspec.Struct]:
        return self.handle_batch([(arrived, message)])

    def held(self) -> tuple[str, ...]:
        return ()

    def status(self) -> protocol.StageStatus:
        return protocol.StageStatus(stage=self.stage, instance="")

    def drop(self, uid: str) -> list[msgspec.Struct]:
        return []


def run(settings: Settings) -> int:
    drain = Drain(settings.drain_timeout)
    source = resolve(
        settings.model, settings.model_cache_dir, settings.revision, settings.chat_template
    )
    hf_tokenizer = source.load_tokenizer()
    content_format = resolve_content_format(
        settings.chat_template_content_format, _template_text(hf_tokenizer)
    )
    encoder = PromptEncoder(
        hf_tokenizer, source.max_model_len(settings.max_model_len), content_format
    )
    if settings.metrics_port:
        serve_metrics(settings.metrics_port)
    ring = SyncRing("tokenizer", settings.endpoints, settings.ring_security)
    log.info("tokenizer ready: model %s, max_model_len %d", source.spec, encoder.max_model_len)
    serve_stage(TokenizerStage(encoder), ring, drain)
    return 0
