"""What every endpoint shares, the way vLLM's ``OpenAIServing`` is shared by its endpoints.

An endpoint is made per HTTP request. A generating one says what each choice sends into the
ring (`build`) and how the ring's replies read as its answer, streamed or whole
(`render_stream`, `render_full`); `generate` owns the rest: the model check, the limits, the
disconnect watcher, the early-error status code, and closing the exchange on every path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenline import protocol
from tokenline.api.http.errors import (
    ApiError,
    ended_with,
    invalid,
    model_not_found,
    unencodable,
)
from tokenline.api.http.sse import DONE, EventStream, event
from tokenline.api.openai.limits import check_request
from tokenline.api.openai.usage import Usage
from tokenline.api.ring.exchange import Exchange
from tokenline.api.ring.pipeline import Pipeline

NORMAL_ENDS = ("stop", "length")


class Endpoint:
    id_prefix = ""  # of the answer's id, before the request's first uid

    def __init__(self, request: Request) -> None:
        self.request = request
        self.pipeline: Pipeline = request.app.state.pipeline
        self.settings = request.app.state.settings
        self.lora = ""  # the LoRA adapter the request names ("" the base model), once checked

    # ── what every endpoint checks ─────────────────────────────────────────────────────────────
    def check_model(self, model: str | None) -> str:
        """The adapter serving ``model`` ("" for the base model, also when None is sent); a
        request for a model that is neither the served one nor an adapter the scheduler
        serves now is a 404 in OpenAI's shape."""
        if model is not None and model != self.pipeline.model:
            if model not in self.request.app.state.adapters:
                raise model_not_found(model, self.pipeline.model)
            self.lora = model
        return self.lora

    @property
    def model_name(self) -> str:
        """What answers give as ``model``: the adapter asked for, else the served model (as
        vLLM does)."""
        return self.lora or self.pipeline.model

    async def call(self, build: Callable[[str], protocol.TokenizeCall]) -> protocol.TokenizerAnswer:
        """A call the tokenizer answers alone (`Pipeline.call`)."""
        try:
            return await self.pipeline.call(build)
        except (OverflowError, UnicodeError) as exc:  # a gap in the schemas, as in `generate`
            raise unencodable(exc) from exc

    # ── what a generating endpoint says ────────────────────────────────────────────────────────
    def build(self, uid: str, index: int) -> protocol.Generate:
        """What choice ``index`` sends into the ring as ``uid``."""
        raise NotImplementedError

    def render_stream(self, ex: Exchange, first: list, meta: dict) -> AsyncIterator[bytes]:
        """The SSE stream of the answer; ``meta`` is id, created and model."""
        raise NotImplementedError

    def render_full(self, ex: Exchange, meta: dict) -> dict:
        """The whole answer's JSON body, once every choice has ended normally."""
        raise NotImplementedError

    def grammar_param(self) -> str | None:
        """The request field whose answer follows a grammar, or None: free text."""
        return None

    # ── the flow every generation takes ────────────────────────────────────────────────────────
    async def generate(self, body, n: int) -> Response:
        """Admit ``n`` choices of ``body`` and answer, streamed if it asks."""
        pipeline = self.pipeline
        self.check_model(body.model)
        check_request(body, self.settings)
        param = self.grammar_param()
        refusal = pipeline.grammar_refusal if param is not None else ""
        if refusal:
            raise invalid(param, refusal, "unsupported_parameter")
        try:
            ex = pipeline.open(n, self._build_for_adapter)
        except (OverflowError, UnicodeError) as exc:
            # The schemas bound every field, so this is a gap in them; open() has already let
            # go of the request's uids.
            raise unencodable(exc) from exc
        # One watcher for the request's whole life; a stream takes it over with the exchange.
        watcher = asyncio.create_task(self._watch_disconnect(ex))
        handed_over = False  # once a stream owns the exchange, it closes it

        def close() -> None:
            watcher.cancel()
            pipeline.close(ex)

        try:
            # Wait for the first reply before answering, so an early error (prompt too long,
            # stage down) gets its own status code instead of a broken 200 stream.
            first = await ex.next_batch()
            if ex.error is not None and not first:
                return ex.error.response()
            meta = {
                "id": self.id_prefix + ex.uids[0],
                "created": int(time.time()),
                "model": self.model_name,
            }
            if body.stream:
                handed_over = True
                return EventStream(self.render_stream(ex, first, meta), close)
            ex.keep(first)
            await ex.collect()
            pipeline.close(ex)
            if ex.error is not None:
                return ex.error.response()
            failed = [c for c in ex.choices if c.finish_reason not in NORMAL_ENDS]
            if failed:
                return ended_with(failed[0].finish_reason).response()
            headers = {"X-Tokenline-Timings": timings_header(ex)}
            return JSONResponse(self.render_full(ex, meta), headers=headers)
        finally:
            if not handed_over:
                close()

    def _build_for_adapter(self, uid: str, index: int) -> protocol.Generate:
        """`build`, served by the adapter the request named (one place, for every endpoint)."""
        message = self.build(uid, index)
        message.lora = self.lora
        return message

    async def _watch_disconnect(self, ex: Exchange) -> None:
        """Turn a client disconnect into an abort the moment it happens, even mid-wait."""
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.pipeline.abort(ex, "client_disconnect")
                return


# ── reading an exchange's replies, for every stream ────────────────────────────────────────────
def timings_header(ex: Exchange) -> str:
    return ", ".join(f"{k.removesuffix('_s')}={v * 1000:.3f}ms" for k, v in ex.timings.items())


def coalesce(batch: list[tuple[int, protocol.Reply]]) -> list[tuple[int, protocol.Reply]]:
    """Merge consecutive pieces of one choice, so a client that fell behind gets fewer,
    larger events instead of one per token."""
    merged: list[tuple[int, protocol.Reply]] = []
    for index, reply in batch:
        if merged and merged[-1][0] == index and merged[-1][1].finish_reason is None:
            last = merged[-1][1]
            merged[-1] = (
                index,
                msgspec.structs.replace(
                    last,
                    text=last.text + reply.text,
                    num_tokens=last.num_tokens + reply.num_tokens,
                    finish_reason=reply.finish_reason,
                    logprobs=_merge_logprobs(last.logprobs, reply.logprobs),
                ),
            )
        else:
            merged.append((index, reply))
    return merged


def _merge_logprobs(
    first: list[protocol.LogprobEntry] | None, second: list[protocol.LogprobEntry] | None
) -> list[protocol.LogprobEntry] | None:
    if first is None or second is None:
        return first if second is None else second
    return first + second


async def replies(ex: Exchange, first: list) -> AsyncIterator[tuple[int, protocol.Reply]]:
    """Every reply of the exchange from ``first`` on, coalesced, until the request is over."""
    batch = first
    while batch:
        for item in coalesce(batch):
            yield item
        batch = await ex.next_batch()


def error_of(ex: Exchange, reply: protocol.Reply | None) -> ApiError:
    """Why a stream ends early: the exchange's error, or the reply's own end."""
    if ex.error is not None:
        return ex.error
    return ended_with(reply.finish_reason if reply else None, reply.error_code if reply else None)


class RunningUsage:
    """Usage as a stream has sent it so far (vLLM's ``continuous_usage_stats``)."""

    def __init__(self, ex: Exchange, per_prompt: int) -> None:
        self._ex, self._per_prompt = ex, per_prompt
        self._sent = [0] * len(ex.choices)

    def sent(self, index: int, reply: protocol.Reply) -> None:
        self._sent[index] += reply.num_tokens

    def chunk_usage(self, body) -> dict:
        """What a chunk before the last says of usage: nothing unless asked, then null
        (OpenAI), or the usage so far with ``continuous_usage_stats`` (vLLM)."""
        if not body.include_usage:
            return {}
        if not body.continuous_usage:
            return {"usage": None}
        ex = self._ex
        usage = Usage.of(ex.choices, ex.cached_tokens, self._per_prompt, sum(self._sent))
        return {"usage": usage.completions_shape()}


def final_events(ex: Exchange, body, head: dict) -> list[bytes]:
    """The end of a chat or completions stream: the error, or the usage if asked; [DONE]."""
    if ex.error is not None:
        return [event(ex.error.body()), DONE]
    if body.include_usage:
        usage = Usage.of(ex.choices, ex.cached_tokens, body.n).completions_shape()
        return [event({**head, "choices": [], "usage": usage}), DONE]
    return [DONE]
