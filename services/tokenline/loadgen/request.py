"""One streamed request against an OpenAI-compatible server, timed on the client."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from tokenline.loadgen.config import ENDPOINT_PATHS, BenchConfig, TargetConfig
from tokenline.loadgen.records import RequestRecord
from tokenline.loadgen.sse import DONE, iter_sse_data, read_chunk
from tokenline.loadgen.workload import RequestSpec

Message = dict[str, str]


def build_body(
    config: BenchConfig,
    target: TargetConfig,
    model: str,
    spec: RequestSpec,
    history: list[Message] | None = None,
) -> dict[str, Any]:
    """The JSON body for ``spec``: streaming, ``max_tokens`` fixed, usage asked for.

    ``history`` is the conversation before this turn (chat messages, replies included)."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "stream": True}
    if config.endpoint == "chat":
        body["messages"] = [*(history or []), {"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if config.include_usage:
        body["stream_options"] = {"include_usage": True}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if config.temperature is not None:
        body["temperature"] = config.temperature
    body.update(target.extra_body)
    return body


def new_record(target: TargetConfig, spec: RequestSpec, round_: int) -> RequestRecord:
    """The record of ``spec`` before anything is sent."""
    return RequestRecord(
        target=target.label,
        round=round_,
        index=spec.index,
        prompt_words=spec.prompt_words,
        max_tokens=spec.max_tokens,
        conversation=spec.conversation,
        turn=spec.turn,
    )


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[str]:
    async for line in stream:
        yield line.decode("utf-8")


async def discover_model(client: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id the server lists at ``/v1/models``."""
    async with client.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        models = (await response.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def send_request(
    client: aiohttp.ClientSession,
    config: BenchConfig,
    target: TargetConfig,
    model: str,
    spec: RequestSpec,
    *,
    round_: int = 0,
    run_start: float = 0.0,
    history: list[Message] | None = None,
    reply: list[str] | None = None,
) -> RequestRecord:
    """Send ``spec`` and time its stream. Never raises for server or network errors: a
    failed request comes back as a record with ``error`` set. The streamed text is appended
    to ``reply`` when one is given (a conversation's next turn resends it)."""
    record = new_record(target, spec, round_)
    url = f"{target.base_url}{ENDPOINT_PATHS[config.endpoint]}"
    body = build_body(config, target, model, spec, history)
    usage_tokens: int | None = None
    last_chunk_at: float | None = None
    sent = time.perf_counter()
    record.start = sent - run_start
    try:
        async with client.post(url, json=body) as response:
            record.status_code = response.status
            if response.status != 200:
                detail = (await response.read()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status}: {detail[:300]}"
                return record
            async for data in iter_sse_data(_lines(response.content)):
                now = time.perf_counter()
                if data.strip() == DONE:
                    break
                chunk = read_chunk(data, config.endpoint)
                if chunk.error is not None:
                    record.error = f"stream error: {chunk.error}"
                    break
                if chunk.text:
                    if reply is not None:
                        reply.append(chunk.text)
                    if last_chunk_at is None:
                        record.ttft = now - sent
                    else:
                        record.itl.append(now - last_chunk_at)
                    last_chunk_at = now
                    record.chunks += 1
                    record.chunk_times.append(now - sent)
                if chunk.completion_tokens is not None:
                    usage_tokens = chunk.completion_tokens
                if chunk.prompt_tokens is not None:
                    record.prompt_tokens = chunk.prompt_tokens
                if chunk.cached_tokens is not None:
                    record.cached_tokens = chunk.cached_tokens
                if chunk.finish_reason is not None:
                    record.finish_reason = chunk.finish_reason
        record.e2e = time.perf_counter() - sent
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: not JSON
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    if usage_tokens is not None:
        record.output_tokens, record.tokens_source = usage_tokens, "usage"
    else:
        record.output_tokens, record.tokens_source = record.chunks, "chunks"
    if record.error is None and record.output_tokens == 0:
        record.error = "empty stream: no text and no usage"
    return record
