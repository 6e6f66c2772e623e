"""What every endpoint shares, the way vLLM's ``OpenAIServing`` is shared by its endpoints.

An endpoint is made per HTTP request. A generating one has `admit` check the request, builds
the ring messages of its choices and an `Answer` (how the ring's replies read as its answer,
streamed or whole), and hands both to `generate`, which owns the rest: the disconnect watcher,
the early-error status code, and closing the exchange on every path. Nothing here calls an
endpoint back; `generate` calls only the answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

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
from tokenline.api.http.sse import EventStream
from tokenline.api.openai.request_limits import check_request
from tokenline.api.ring.client import RingClient
from tokenline.api.ring.exchange import NORMAL_ENDS, Exchange

MAX_TENANT_CHARS = 128  # a tenant names a team or a flow; the label of its metrics too


class Answer(Protocol):
    """How one request's replies read as its answer: an SSE stream, or a whole JSON body once
    every choice has ended normally; ``meta`` is the answer's id, created and model."""

    def stream(self, ex: Exchange, first: list, meta: dict) -> AsyncIterator[bytes]: ...

    def whole(self, ex: Exchange, meta: dict) -> dict: ...


class Endpoint:
    id_prefix = ""  # of the answer's id, before the request's first uid

    def __init__(self, request: Request) -> None:
        self.request = request
        self.ring_client: RingClient = request.app.state.ring_client
        self.settings = request.app.state.settings
        self.lora = ""  # the LoRA adapter the request names ("" the base model), once checked
        self.alias = ""  # the base model's name the request gave, once checked
        self.admitted = False

    def named(self, error: ApiError) -> ApiError:
        """``error`` in the names of this endpoint's request (the stages name chat's fields)."""
        return error

    # ── what every endpoint checks ─────────────────────────────────────────────────────────────
    def check_model(self, model: str | None) -> str:
        """The adapter serving ``model`` ("" for the base model under any of its names, also
        when None is sent); a request for a model that is neither a served name nor an adapter
        the scheduler serves now is a 404 in OpenAI's shape."""
        names = self.request.app.state.lora_names
        if model is None:
            return self.lora
        if model in names.bases:
            self.alias = model
        elif model in names:
            self.lora = model
        else:
            raise model_not_found(model, names.base)
        return self.lora

    def tenant(self) -> str:
        """Whose request this is: its API key's name, else the tenant header's value (the
        gateway's fairness id), else "" (nobody in particular)."""
        named = getattr(self.request.state, "tenant", "")
        header = self.settings.tenant_header
        tenant = named or (self.request.headers.get(header, "") if header else "")
        if len(tenant) > MAX_TENANT_CHARS:
            raise invalid(None, f"the {header} header is longer than {MAX_TENANT_CHARS} characters")
        return tenant

    @property
    def model_name(self) -> str:
        """What answers give as ``model``: the adapter or the alias asked for, else the primary
        served name (as vLLM does)."""
        return self.lora or self.alias or self.request.app.state.lora_names.base

    async def call(self, build: Callable[[str], protocol.TokenizeCall]) -> protocol.TokenizerAnswer:
        """A call the tokenizer answers alone (`RingClient.call`)."""
        try:
            return await self.ring_client.call(build)
        except (OverflowError, UnicodeError) as exc:  # a gap in the schemas, as in `generate`
            raise unencodable(exc) from exc

    # ── the flow every generation takes ────────────────────────────────────────────────────────
    def admit(self, body, grammar_param: str | None = None) -> None:
        """Refuse what ``body`` may not ask before anything of it is built: a model not served
        (404), a limit exceeded, a grammar this scheduler cannot follow (400); ``grammar_param``
        names the field whose answer follows a grammar (None: free text)."""
        self.check_model(body.model)
        check_request(body, self.settings)
        kv_transfer = body.kv_transfer
        if kv_transfer is not None and (
            body.n > 1 or (kv_transfer.do_remote_decode and body.stream)
        ):
            raise invalid(
                "kv_transfer_params",
                "kv_transfer_params serve one choice, and a prefill (do_remote_decode) answers "
                "whole: send n 1, and stream false with do_remote_decode",
            )
        if body.priority and self.settings.scheduling_policy != "priority":
            raise invalid(
                "priority",
                f"priority {body.priority} asks for priority scheduling, which this server "
                "does not run (--scheduling-policy fcfs); leave priority out or 0",
            )
        refusal = self.ring_client.health.grammar_refusal if grammar_param is not None else ""
        if refusal:
            raise invalid(grammar_param, refusal, "unsupported_parameter")
        self.admitted = True

    async def generate(self, body, messages: list[protocol.Generate], answer: Answer) -> Response:
        """Send ``messages`` (one a choice of ``body``, which `admit` let in) into the ring and
        answer, streamed if ``body`` asks."""
        if not self.admitted:
            raise RuntimeError("generate() before admit(): the request's limits went unchecked")
        ring_client = self.ring_client
        tenant = self.tenant()
        for message in messages:
            message.lora = self.lora
            message.priority = body.priority
            message.tenant = tenant
        try:
            ex = ring_client.open(messages, tenant)
        except (OverflowError, UnicodeError) as exc:
            # The schemas bound every field, so this is a gap in them; open() has already let
            # go of the request's uids.
            raise unencodable(exc) from exc
        # One watcher for the request's whole life; a stream takes it over with the exchange.
        watcher = asyncio.create_task(self._watch_disconnect(ex))
        handed_over = False  # once a stream owns the exchange, it closes it

        def close(failure: Exception | None = None) -> None:
            watcher.cancel()
            # An exception here is the api's own failure, not the client's going away.
            ring_client.close(ex, "client_disconnect" if failure is None else "stage_failure")

        try:
            # Wait for the first reply before answering, so an early error (prompt too long,
            # stage down) gets its own status code instead of a broken 200 stream.
            first = await ex.next_batch()
            if ex.error is not None and not first:
                return self.named(ex.error).response()
            meta = {
                "id": self.id_prefix + ex.uids[0],
                "created": int(time.time()),
                "model": self.model_name,
            }
            if body.stream:
                handed_over = True
                stream = EventStream(answer.stream(ex, first, meta), close)
                ex.cut_off = stream.cut_off  # a slow client's abort ends the stuck response
                return stream
            ex.keep(first)
            await ex.collect()
            ring_client.close(ex)
            if ex.error is not None:
                return self.named(ex.error).response()
            failed = [c for c in ex.choices if c.finish_reason not in NORMAL_ENDS]
            if failed:
                return self.named(failed[0].error or ended_with(failed[0].finish_reason)).response()
            headers = {"X-Tokenline-Timings": _timings_header(ex)}
            whole = answer.whole(ex, meta)
            if ex.kv_transfer is not None:  # vLLM's top-level field, for llm-d's sidecar
                whole["kv_transfer_params"] = msgspec.to_builtins(ex.kv_transfer)
            return JSONResponse(whole, headers=headers)
        except Exception as exc:
            if not handed_over:
                close(exc)
            raise
        finally:
            if not handed_over:
                close()

    async def _watch_disconnect(self, ex: Exchange) -> None:
        """Turn a client disconnect into an abort the moment it happens, even mid-wait."""
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.ring_client.abort(ex, "client_disconnect")
                return


def _timings_header(ex: Exchange) -> str:
    return ", ".join(f"{k.removesuffix('_s')}={v * 1000:.3f}ms" for k, v in ex.timings.items())
