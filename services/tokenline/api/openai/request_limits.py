"""What one request may ask of the stages, checked in the api before anything is queued.

The limits bound choices, tokens, stop strings, messages, prompt characters and logprobs. Each
has a flag (settings/api.py, cli.py); each refusal is a 400 ``limit_exceeded`` in OpenAI's error
shape naming the ``param`` and the flag.
"""

from __future__ import annotations

from tokenline.api.http.errors import ApiError, invalid
from tokenline.api.openai.chat import ChatCompletionRequest, ChatMessageIn
from tokenline.api.openai.completions import CompletionRequest
from tokenline.settings import Settings


def _exceeded(param: str, message: str) -> ApiError:
    return invalid(param, message, "limit_exceeded")


def check_request(body: ChatCompletionRequest | CompletionRequest, settings: Settings) -> None:
    """Raise a 400 naming the param for the first limit ``body`` exceeds."""
    if body.n > settings.max_n:
        raise _exceeded(
            "n", f"n is {body.n}; this server allows at most {settings.max_n} choices (--max-n)"
        )
    for param in ("max_completion_tokens", "max_tokens"):
        asked = getattr(body, param, None)
        if asked is not None and asked > settings.max_tokens_limit:
            raise _exceeded(
                param,
                f"{param} is {asked}; this server allows at most {settings.max_tokens_limit} "
                "(--max-tokens-limit); ask for fewer tokens",
            )
    stops = body.stop or []
    if len(stops) > settings.max_stop_strings:
        raise _exceeded(
            "stop",
            f"{len(stops)} stop strings; this server allows at most {settings.max_stop_strings} "
            "(--max-stop-strings)",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > settings.max_stop_string_length:
        raise _exceeded(
            "stop",
            f"a stop string is {longest} characters long; this server allows at most "
            f"{settings.max_stop_string_length} (--max-stop-string-length)",
        )
    if len(body.stop_token_ids) > settings.max_stop_token_ids:
        raise _exceeded(
            "stop_token_ids",
            f"{len(body.stop_token_ids)} stop_token_ids; this server allows at most "
            f"{settings.max_stop_token_ids} (--max-stop-token-ids)",
        )
    if isinstance(body, ChatCompletionRequest):
        _check_chat(body, settings)
    else:
        _check_completion(body, settings)


def check_messages(messages: list[ChatMessageIn], settings: Settings) -> None:
    """How many messages, and how much text in them all (tool-call arguments included)."""
    if len(messages) > settings.max_messages:
        raise _exceeded(
            "messages",
            f"{len(messages)} messages; this server allows at most {settings.max_messages} "
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
    if total > settings.max_prompt_chars:
        raise _exceeded(
            "messages",
            f"the messages hold {total} characters; this server allows at most "
            f"{settings.max_prompt_chars} (--max-prompt-chars)",
        )


def _check_chat(body: ChatCompletionRequest, settings: Settings) -> None:
    check_messages(body.messages, settings)
    if body.logprobs and (body.top_logprobs or 0) > settings.max_logprobs:
        raise _exceeded(
            "top_logprobs",
            f"top_logprobs is {body.top_logprobs}; this server allows at most "
            f"{settings.max_logprobs} (--max-logprobs)",
        )


def _check_completion(body: CompletionRequest, settings: Settings) -> None:
    prompts = body.prompts()
    if body.choices > settings.max_n:
        raise _exceeded(
            "prompt",
            f"{len(prompts)} prompts × n={body.n} is {body.choices} choices; this server allows "
            f"at most {settings.max_n} per request (--max-n); send fewer prompts per request",
        )
    # a token id counts as one character: either way it is what the tokenizer must take in
    size = sum(len(p) for p in prompts)
    if size > settings.max_prompt_chars:
        raise _exceeded(
            "prompt",
            f"the prompt is {size} characters (or token ids); this server allows at most "
            f"{settings.max_prompt_chars} (--max-prompt-chars)",
        )
    if body.logprobs is not None and body.logprobs > settings.max_logprobs:
        raise _exceeded(
            "logprobs",
            f"logprobs is {body.logprobs}; this server allows at most {settings.max_logprobs} "
            "(--max-logprobs)",
        )
