"""A stand-in OpenAI-compatible streaming server with known, configured timings.

Not a model server: it exists so that the load generator's own measurements (TTFT, gaps,
token counts, percentiles) can be checked against delays and counts fixed in advance, over
real HTTP. Run as ``python stand_in_sse_server.py PORT``.

Each profile is served under its own path prefix: ``http://127.0.0.1:PORT/<profile>/v1/...``.
A request streams ``max_tokens`` tokens (fewer when ``eos_at`` is set and the request does not
say ``ignore_eos``): the first chunk ``ttft`` seconds after the request arrives, then one chunk
of ``tokens_per_chunk`` tokens every ``itl * tokens_per_chunk`` seconds.

A prompt's tokens are its words (a chat prompt's: the words of all its messages). A profile
with ``cache`` reports ``usage.prompt_tokens_details.cached_tokens`` as a toy prefix cache
would: the longest run of leading words it shares with a prompt the profile saw before.
``GET /<profile>/received`` lists the bodies the profile was sent, in arrival order;
``GET /<profile>/ready`` answers 503 at first for the profiles with ``not_ready``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Profile:
    ttft: float = 0.05
    itl: float = 0.01
    tokens_per_chunk: int = 1
    usage: bool = True  # send the final usage chunk when stream_options.include_usage is set
    done: bool = True  # end with data: [DONE]
    strict: bool = False  # 422 on fields outside the OpenAI schema, as `transformers serve` does
    eos_at: int | None = None  # stop here unless the request says ignore_eos
    fail_every: int = 0  # every Nth request answers HTTP 500
    cache: bool = False  # report cached_tokens from the prompts seen before
    not_ready: int | None = None  # GET /ready: 503 this many times, then 200 (None: 404)
    seen: int = 0
    received: list[dict[str, Any]] = field(default_factory=list)
    prompts: list[list[str]] = field(default_factory=list)


PROFILES: dict[str, Profile] = {
    "fast": Profile(ttft=0.15, itl=0.02),
    "slow": Profile(ttft=0.30, itl=0.02, strict=True, done=False),
    "packed": Profile(ttft=0.05, itl=0.01, tokens_per_chunk=3),
    "nousage": Profile(ttft=0.05, itl=0.01, tokens_per_chunk=2, usage=False),
    "eos": Profile(ttft=0.02, itl=0.005, eos_at=5),
    "flaky": Profile(ttft=0.02, itl=0.005, fail_every=3),
    "quick": Profile(ttft=0.01, itl=0.002),
    "prefix": Profile(ttft=0.01, itl=0.002, cache=True),
    "turns": Profile(ttft=0.01, itl=0.002, cache=True),
    "turns-flaky": Profile(ttft=0.01, itl=0.002, fail_every=2),
    "warming": Profile(not_ready=3),
    "hung": Profile(not_ready=10**9),
}

OPENAI_FIELDS = {
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
}


def _chunk(
    profile_name: str,
    chat: bool,
    text: str | None,
    finish: str | None,
    usage: dict[str, Any] | None = None,
    role: bool = False,
) -> str:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish}]
        obj = "text_completion"
    body: dict[str, Any] = {
        "id": "x",
        "object": obj,
        "created": int(time.time()),
        "model": profile_name,
        "choices": choices,
    }
    if usage is not None:
        body["choices"] = []
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


async def generate(request: Request) -> Response:
    name = request.path_params["profile"]
    chat = request.url.path.endswith("/chat/completions")
    profile = PROFILES[name]
    arrived = time.perf_counter()
    body = await request.json()
    profile.received.append(body)
    profile.seen += 1
    if profile.fail_every and profile.seen % profile.fail_every == 0:
        return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
    unknown = set(body) - OPENAI_FIELDS
    if profile.strict and unknown:
        return JSONResponse({"detail": f"Unexpected fields: {unknown}"}, status_code=422)
    total = int(body["max_tokens"])
    if profile.eos_at is not None and not body.get("ignore_eos"):
        total = min(total, profile.eos_at)
    want_usage = profile.usage and (body.get("stream_options") or {}).get("include_usage")
    if chat:
        words = [w for message in body["messages"] for w in message["content"].split()]
    else:
        words = body["prompt"].split()
    cached = max((_common_prefix(words, seen) for seen in profile.prompts), default=0)
    profile.prompts.append(words)

    async def stream():
        if chat:
            yield _chunk(name, chat, None, None, role=True)  # role first, no text: not a token
        sent, due = 0, arrived + profile.ttft
        while sent < total:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            count = min(profile.tokens_per_chunk, total - sent)
            text = "".join(f"t{sent + i} " for i in range(count))
            sent += count
            yield _chunk(name, chat, text, "length" if sent == total else None)
            due += profile.itl * profile.tokens_per_chunk
        if want_usage:
            prompt_tokens = len(words)
            usage: dict[str, Any] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": total,
                "total_tokens": prompt_tokens + total,
            }
            if profile.cache:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            yield _chunk(name, chat, None, None, usage=usage)
        if profile.done:
            yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


def _common_prefix(a: list[str], b: list[str]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


async def ready(request: Request) -> Response:
    profile = PROFILES[request.path_params["profile"]]
    if profile.not_ready is None:
        return JSONResponse({"detail": "Not Found"}, status_code=404)
    if profile.not_ready <= 0:
        return JSONResponse({"ready": True})
    profile.not_ready -= 1
    return JSONResponse({"ready": False}, status_code=503)


async def received(request: Request) -> Response:
    return JSONResponse(PROFILES[request.path_params["profile"]].received)


async def models(request: Request) -> Response:
    name = request.path_params["profile"]
    return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})


app = Starlette(
    routes=[
        Route("/{profile}/v1/completions", generate, methods=["POST"]),
        Route("/{profile}/v1/chat/completions", generate, methods=["POST"]),
        Route("/{profile}/v1/models", models),
        Route("/{profile}/received", received),
        Route("/{profile}/ready", ready),
    ]
)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
