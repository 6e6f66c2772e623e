"""The detokenizer stage: token ids to text for every live uid; one reply batch per step.

Per-uid state is created on `Begin` and freed on every terminal event: the scheduler's final
output, a stop string, a `Failed`, or an `Abort` for a uid still held. A uid this stage ended
early (a stop string, a failure) is remembered until the scheduler's own end for it arrives,
so the tokens decoded meanwhile are dropped quietly: they are expected, not anomalies. That
memory expires at the uid's deadline plus the leak grace, by when the scheduler has ended it
too (or died), so nothing is kept per request for longer than its deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

import msgspec

from tokenline import protocol
from tokenline.bounded import ExpiringSet
from tokenline.detokenizer.incremental import IncrementalDecoder
from tokenline.detokenizer.text_split import TextSplit
from tokenline.detokenizer.token_text import TokenTexts
from tokenline.ledger import LEAK_GRACE_S
from tokenline.lifecycle import Drain
from tokenline.metrics import LATE_REPLIES, STAGE_LATENCY, serve_metrics, track_cache
from tokenline.model_source import resolve
from tokenline.reasoning import ReasoningFormat, ReasoningSplit, parser_for
from tokenline.settings import Settings
from tokenline.stage_runtime import StepFreeHandler, internal_error, serve_stage
from tokenline.transport import SyncRing

log = logging.getLogger(__name__)
MAX_ENDED_EARLY = 65_536


@dataclass
class _Live:
    decoder: IncrementalDecoder
    prompt_tokens: int
    tokenizer_s: float = 0.0
    queue_s: float = 0.0
    cached_tokens: int = 0
    echo_ids: list[int] | None = None  # the prompt to echo, until the first reply takes it
    deadline: float = float("inf")  # monotonic; past it the scheduler ends the uid itself
    split: ReasoningSplit | TextSplit | None = None  # chat with a reasoning parser
    thinking: bool = False  # which channel the decoder's held-back text belongs to
    skip_special_tokens: bool = True  # False: special tokens (but control ones) are text
    stop_token_ids: frozenset[int] = frozenset()  # the request's: never text when they end it
    stop_is_text: bool = False  # include_stop_str_in_output: the stop token's text is kept


class DetokenizerStage(StepFreeHandler):
    """The detokenizer stage's handler: an `IncrementalDecoder` per live uid."""

    stage = "detokenizer"

    def __init__(
        self,
        tokenizer,
        reasoning: ReasoningFormat | None = None,
        control_ids: Collection[int] = (),
    ) -> None:
        """``control_ids``: tokens never shown as text, even to a request that keeps special
        tokens (the model's end-of-sequence ids, BOS, padding)."""
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.reasoning = reasoning  # --reasoning-parser, for chat requests
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self.control_ids = frozenset(control_ids)
        self.token_texts = TokenTexts(
            tokenizer, shown=self.special_ids - self.control_ids, special=self.special_ids
        )
        self.live: dict[str, _Live] = {}
        # Ended here before the scheduler ended them; the scheduler's end is still to come.
        self.ended_early = ExpiringSet(MAX_ENDED_EARLY, LEAK_GRACE_S)
        track_cache(self.stage, "ended_early", self.ended_early)
        track_cache(self.stage, "token_texts", self.token_texts)
        self._late = LATE_REPLIES.labels(stage="detokenizer")
        self._latency = STAGE_LATENCY.labels(stage="detokenizer")

    def handle(self, message: msgspec.Struct, arrived: float) -> list[msgspec.Struct]:
        """``arrived``: when the message reached this stage's inbox (monotonic)."""
        if isinstance(message, protocol.TokenBatch):
            out: list[msgspec.Struct] = []
            replies = []
            for output in message.outputs:
                try:
                    reply = self._decode(output, arrived)
                except Exception as exc:  # one uid's failure is that uid's alone
                    log.exception("detokenizer: decoding %s raised", output.uid)
                    self.drop(output.uid)
                    out.append(internal_error(output.uid, self.stage, exc))
                    continue
                if reply is not None:
                    replies.append(reply)
            if replies:
                out.insert(0, protocol.ReplyBatch(replies=replies))
            return out
        if isinstance(message, protocol.Begin):
            decoder = IncrementalDecoder(
                self.tokenizer,
                message.stop,
                message.prompt_tail,
                message.skip_special_tokens,
                self.control_ids,
                message.min_tokens,
                message.include_stop_str_in_output,
            )
            self.live[message.uid] = _Live(
                decoder,
                message.prompt_tokens,
                message.tokenizer_s,
                echo_ids=message.echo_ids or None,
                deadline=arrived + message.timeout_s,
                skip_special_tokens=message.skip_special_tokens,
                stop_token_ids=frozenset(message.stop_token_ids),
                stop_is_text=message.include_stop_str_in_output,
            )
            if message.reasoning and self.reasoning is not None:
                split = TextSplit if self.reasoning.by_text else ReasoningSplit
                self.live[message.uid].split = split(self.reasoning, message.prompt_tail)
            return []
        if isinstance(message, protocol.TokenizerAnswer | protocol.LoraAnswer):
            # the tokenizer's or the scheduler's answer to an api call: no uid held here
            return [message]
        if isinstance(message, protocol.ReplyBatch):
            # pooled results (embeddings, scores): no text to render, no uid held here
            return [message]
        # Failed, Abort: the end of a uid; free it if held, pass the message on
        self.live.pop(message.uid, None)
        return [message]

    def _decode(self, out: protocol.TokenOutput, started: float) -> protocol.Reply | None:
        live = self.live.get(out.uid)
        if live is None:
            if out.uid in self.ended_early:
                if out.finish_reason is None:
                    return None
                # The scheduler's own end: passed on so the api settles the abort it sent.
                self.ended_early.discard(out.uid)
                return protocol.Reply(
                    uid=out.uid, text="", num_tokens=0, finish_reason=out.finish_reason
                )
            if out.finish_reason is None:
                self._late.inc()  # tokens for a uid this stage never began or already ended
                return None
            return protocol.Reply(
                uid=out.uid, text="", num_tokens=len(out.token_ids), finish_reason=out.finish_reason
            )
        if out.queue_s:
            live.queue_s = out.queue_s
        if out.cached_tokens:
            live.cached_tokens = out.cached_tokens
        token_ids = out.token_ids
        if (
            out.finish_reason == "stop"
            and token_ids
            and not live.stop_is_text
            and self._stopped_on(live, token_ids[-1])
        ):
            token_ids = token_ids[:-1]
        texts, reasoning_tokens = self._texts(live, token_ids)
        finish = out.finish_reason
        if finish is not None and not live.decoder.stopped:
            # held text let out at the end may still complete a stop string
            if isinstance(live.split, TextSplit):
                self._channel_texts(live, texts, live.split.finish())
            texts[live.thinking] += live.decoder.flush()
        stop_string = live.decoder.stopped
        if stop_string:
            finish = "stop"
        # prompt_tokens on every reply: a stream with continuous usage reports it from the start
        reply = protocol.Reply(
            uid=out.uid,
            text=texts[False],
            num_tokens=len(out.token_ids),
            finish_reason=finish,
            prompt_tokens=live.prompt_tokens,
            reasoning=texts[True],
            reasoning_tokens=reasoning_tokens,
        )
        if out.logprobs is not None:
            # After a stop string, the tokens up to the one that completed the match keep theirs.
            skip = live.skip_special_tokens
            reply.logprobs = [self.token_texts.entry(lp, skip) for lp in out.logprobs]
        self._prompt_fields(reply, live, out)
        if finish is not None:
            reply.stop_string = stop_string and out.finish_reason is None
            reply.cached_tokens = live.cached_tokens
            reply.kv_transfer = out.kv_transfer  # a prefill pod's answer to the decode pod
            reply.tokenizer_s = live.tokenizer_s
            reply.queue_s = live.queue_s
            reply.scheduler_s = out.scheduler_s
            # the terminal message's own time: what this stage adds to the request's end
            reply.detokenizer_s = time.monotonic() - started
            if out.error_code:
                reply.error_code = out.error_code
            self._latency.observe(reply.detokenizer_s)
            del self.live[out.uid]
            if reply.stop_string:
                self._ended_early(out.uid, live)
        return reply

    def _stopped_on(self, live: _Live, token_id: int) -> bool:
        """Whether a reply ended with ``stop`` ended on a stop token, which is never text (as
        in vLLM): one of the request's stop_token_ids, or a special token that a request
        keeping special tokens would otherwise see. A grammar's last token ends a reply with
        ``stop`` too, and is text: no tool format ends its calls with a special token."""
        if token_id in live.stop_token_ids:
            return True
        return not live.skip_special_tokens and token_id in self.special_ids

    def _texts(self, live: _Live, token_ids: list[int]) -> tuple[dict[bool, str], int]:
        """The answer's text (False) and the thinking's (True) these ids decode to, and how
        many of them were thinking. Text the decoder holds back (a possible stop string) is
        let out into its own channel when the channel changes."""
        texts = {False: "", True: ""}
        if live.split is None:
            texts[False] = live.decoder.feed(token_ids)
            return texts, 0
        if isinstance(live.split, TextSplit):
            before = live.split.reasoning_tokens
            for token_id in token_ids:
                self._channel_texts(live, texts, live.split.feed(live.decoder.decode([token_id])))
                if live.decoder.stopped:
                    break
            return texts, live.split.reasoning_tokens - before
        reasoning_tokens = 0
        for segment in live.split.segments(token_ids):
            if segment.reasoning != live.thinking:
                texts[live.thinking] += live.decoder.feed([]) + live.decoder.flush()
                live.decoder.restart()
                live.thinking = segment.reasoning
            texts[segment.reasoning] += live.decoder.feed(segment.token_ids)
            if segment.reasoning:
                reasoning_tokens += segment.tokens
            if live.decoder.stopped:  # what follows a stop string is never text
                break
        return texts, reasoning_tokens

    @staticmethod
    def _channel_texts(live: _Live, texts: dict[bool, str], pieces: list[tuple[bool, str]]) -> None:
        """Decoded text, split on text markers, through the stop strings into its channels;
        what is held back as a possible stop string goes out when the channel changes."""
        for reasoning, text in pieces:
            if live.decoder.stopped:
                return
            if reasoning != live.thinking:
                texts[live.thinking] += live.decoder.emit("") + live.decoder.flush()
                live.thinking = reasoning
            texts[reasoning] += live.decoder.emit(text)

    def _prompt_fields(self, reply: protocol.Reply, live: _Live, out: protocol.TokenOutput) -> None:
        """The prompt as echo and prompt logprobs report it; both come with the first reply
        (the scheduler sends prompt logprobs on the first output only)."""
        if live.echo_ids is not None:
            # echo's text for a prompt sent as token ids, special tokens and all, as vLLM
            # decodes it (the api echoes a text prompt as it was sent)
            reply.prompt_text = self.tokenizer.decode(live.echo_ids, skip_special_tokens=False)
            live.echo_ids = None
        if out.prompt_logprobs is not None:
            entries = self.token_texts.entry
            reply.prompt_logprobs = [
                None if e is None else entries(e, prompt=True) for e in out.prompt_logprobs
            ]

    # ── the rest of the handler interface ──────────────────────────────────────────────────────
    def held(self) -> list[str]:
        return list(self.live)

    def status(self) -> protocol.StageStatus:
        return protocol.StageStatus(stage=self.stage, instance="", running=len(self.live))

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        self.ended_early.prune(now)
        return []

    def drop(self, uid: str) -> list[msgspec.Struct]:
        live = self.live.pop(uid, None)
        if live is not None:
            self._ended_early(uid, live)
        return []

    def _ended_early(self, uid: str, live: _Live) -> None:
        remaining = live.deadline - time.monotonic()
        self.ended_early.add(uid, ttl_s=max(0.0, remaining) + LEAK_GRACE_S)


def run(settings: Settings) -> int:
    drain = Drain(settings.drain_timeout)
    source = resolve(
        settings.model, settings.model_cache_dir, settings.revision, settings.chat_template
    )
    hf_tokenizer = source.load_tokenizer()
    tokenizer = hf_tokenizer.backend_tokenizer
    try:
        parser, reasoning = parser_for(settings.reasoning_parser, hf_tokenizer)
    except ValueError as exc:
        raise SystemExit(f"detokenizer: {exc}") from None
    if settings.metrics_port:
        serve_metrics(settings.metrics_port)
    ring = SyncRing("detokenizer", settings.endpoints, settings.ring_security)
    log.info("detokenizer ready: %s (reasoning parser: %s)", source.spec, parser)
    control = {
        hf_tokenizer.bos_token_id,
        hf_tokenizer.eos_token_id,
        hf_tokenizer.pad_token_id,
        hf_tokenizer.unk_token_id,
        *source.eos_token_ids(),
    }
    control.discard(None)
    serve_stage(DetokenizerStage(tokenizer, reasoning, control), ring, drain)
    return 0
