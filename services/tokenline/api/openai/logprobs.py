"""Logprobs in OpenAI's two shapes: chat's ``content`` list, and the legacy completions shape
(with an echoed prompt's part in front)."""

from __future__ import annotations

from tokenline import protocol

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM report this instead


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(entries: list[protocol.LogprobEntry]) -> dict:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _logprob(e.logprob),
                "bytes": e.bytes,
                "top_logprobs": [
                    {"token": t.token, "logprob": _logprob(t.logprob), "bytes": t.bytes}
                    for t in e.top
                ],
            }
            for e in entries
        ]
    }


def _top_with_chosen(entry: protocol.LogprobEntry) -> dict[str, float]:
    """The legacy shape's alternatives: the top N, and the chosen token always, as OpenAI
    ("up to logprobs+1 elements") and vLLM give them, so ``logprobs: 0`` still names it."""
    top = {t.token: _logprob(t.logprob) for t in entry.top}
    top.setdefault(entry.token, _logprob(entry.logprob))
    return top


def completion_logprobs(entries: list[protocol.LogprobEntry], offset: int = 0) -> dict:
    """The legacy completions shape; ``offset``: where the first token's text starts."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": [_top_with_chosen(e) for e in entries],
        "text_offset": offsets,
    }


def _echo_logprobs(prompt_text: str, entries: list[protocol.LogprobEntry | None]) -> dict:
    """The prompt's part of an echoed completion's logprobs: its first token has none."""
    known = [e for e in entries[1:] if e is not None]
    first_text = prompt_text[: max(len(prompt_text) - sum(len(e.token) for e in known), 0)]
    tokens, values, tops, offsets = [first_text], [None], [None], [0]
    offset = len(first_text)
    for e in known:
        tokens.append(e.token)
        values.append(_logprob(e.logprob))
        tops.append(_top_with_chosen(e))
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _joined_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def echoed(
    prompt: str, prompt_logprobs, text: str, logprobs: dict | None
) -> tuple[str, dict | None]:
    """``text`` and ``logprobs`` with the prompt's in front, for a completion with echo."""
    if logprobs is None:
        return prompt + text, None
    if prompt_logprobs is None:
        return prompt + text, logprobs
    echo = _echo_logprobs(prompt, prompt_logprobs)
    shifted = {**logprobs, "text_offset": [o + len(prompt) for o in logprobs["text_offset"]]}
    return prompt + text, _joined_logprobs(echo, shifted)
