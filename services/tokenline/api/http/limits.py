"""Request limits, checked in the api before anything is queued.

The body size is enforced by pure ASGI middleware: a declared ``Content-Length`` over the limit
is refused before a byte of the body is read, and a chunked body is counted as it arrives and
refused the moment it passes the limit, so an oversized body is never held in memory. The other
limits (`check_request`) bound what one request may ask of the stages: choices, tokens, stop
strings, messages, prompt characters, logprobs. Each has a flag (settings.py, cli.py); each
refusal is a 4xx in OpenAI's error shape naming the ``param`` and the flag.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenline.api.http.errors import ApiError
from tokenline.api.openai.chat import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from tokenline.settings import Settings


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` while a body is read. An HTTPException, because FastAPI turns any
    other exception met while reading a body into a 400 "error parsing the body"."""

    def __init__(self, limit: int) -> None:
        # close: the rest of an oversized body is not worth reading to keep the connection
        super().__init__(413, _too_large_message(limit), headers={"connection": "close"})


def _too_large_message(limit: int) -> str:
    return (
        f"the request body is larger than this server accepts ({limit} bytes, "
        "--max-body-size); send a smaller request"
    )


def _error_bytes(status: int, message: str, code: str) -> tuple[dict, bytes]:
    body = json.dumps(ApiError(status, message, code).body()).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),  # the unread rest of the body is not waited for
        ],
    }
    return start, body


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                declared = value
                break
        if declared is not None:
            refusal = None
            if not declared.strip().isdigit():
                message = "the Content-Length header is not a number"
                refusal = (400, message, "invalid_request_error")
            elif int(declared) > self.max_bytes:
                refusal = (413, _too_large_message(self.max_bytes), "request_too_large")
            if refusal is not None:
                start, body = _error_bytes(*refusal)
                await send(start)
                await send({"type": "http.response.body", "body": body})
                return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            # Read outside FastAPI's body parsing (its handlers answer it there): answer here.
            if started:
                raise
            start, body = _error_bytes(413, _too_large_message(self.max_bytes), "request_too_large")
            await send(start)
            await send({"type": "http.response.body", "body": body})


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(400, message, "limit_exceeded", param=param)


def check_request(body: ChatCompletionRequest | CompletionRequest, limits: Settings) -> None:
    """Raise a 400 naming the param for the first limit ``body`` exceeds."""
    if body.n > limits.max_n:
        raise _refuse(
            "n", f"n is {body.n}; this server allows at most {limits.max_n} choices (--max-n)"
        )
    for param in ("max_completion_tokens", "max_tokens"):
        asked = getattr(body, param, None)
        if asked is not None and asked > limits.max_tokens_limit:
            raise _refuse(
                param,
                f"{param} is {asked}; this server allows at most {limits.max_tokens_limit} "
                "(--max-tokens-limit); ask for fewer tokens",
            )
    stops = body.stop or []
    if len(stops) > limits.max_stop_strings:
        raise _refuse(
            "stop",
            f"{len(stops)} stop strings; this server allows at most {limits.max_stop_strings} "
            "(--max-stop-strings)",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_length:
        raise _refuse(
            "stop",
            f"a stop string is {longest} characters long; this server allows at most "
            f"{limits.max_stop_string_length} (--max-stop-string-length)",
        )
    if len(body.stop_token_ids) > limits.max_stop_token_ids:
        raise _refuse(
            "stop_token_ids",
            f"{len(body.stop_token_ids)} stop_token_ids; this server allows at most "
            f"{limits.max_stop_token_ids} (--max-stop-token-ids)",
        )
    if isinstance(body, ChatCompletionRequest):
        _check_chat(body, limits)
    else:
        _check_completion(body, limits)


def check_messages(messages: list[ChatMessageIn], limits: Settings) -> None:
    """How many messages, and how much text in them all (tool-call arguments included)."""
    if len(messages) > limits.max_messages:
        raise _refuse(
            "messages",
            f"{len(messages)} messages; this server allows at most {limits.max_messages} "
            "(--max-messages)",
        )
    total = 0
    for message in messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif content:
            total += sum(len(part.text) for part in content)
        total += sum(len(call.function.arguments) for call in message.tool_calls or [])
    if total > limits.max_prompt_chars:
        raise _refuse(
            "messages",
            f"the messages hold {total} characters; this server allows at most "
            f"{limits.max_prompt_chars} (--max-prompt-chars)",
        )


def _check_chat(body: ChatCompletionRequest, limits: Settings) -> None:
    check_messages(body.messages, limits)
    if body.logprobs and (body.top_logprobs or 0) > limits.max_logprobs:
        raise _refuse(
            "top_logprobs",
            f"top_logprobs is {body.top_logprobs}; this server allows at most "
            f"{limits.max_logprobs} (--max-logprobs)",
        )


def _check_completion(body: CompletionRequest, limits: Settings) -> None:
    prompts = body.prompts()
    if body.choices > limits.max_n:
        raise _refuse(
            "prompt",
            f"{len(prompts)} prompts × n={body.n} is {body.choices} choices; this server allows "
            f"at most {limits.max_n} per request (--max-n); send fewer prompts per request",
        )
    # a token id counts as one character: either way it is what the tokenizer must take in
    size = sum(len(p) for p in prompts)
    if size > limits.max_prompt_chars:
        raise _refuse(
            "prompt",
            f"the prompt is {size} characters (or token ids); this server allows at most "
            f"{limits.max_prompt_chars} (--max-prompt-chars)",
        )
    if body.logprobs is not None and body.logprobs > limits.max_logprobs:
        raise _refuse(
            "logprobs",
            f"logprobs is {body.logprobs}; this server allows at most {limits.max_logprobs} "
            "(--max-logprobs)",
        )
