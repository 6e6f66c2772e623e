"""OpenAI's response shapes: whole completions, SSE chunks, usage and logprobs.

Everything here turns an `Exchange`'s replies into what OpenAI clients expect; the routes
decide when, this module decides how it looks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from tokenline import protocol
from tokenline.api.http.errors import ApiError
from tokenline.api.http.sse import DONE, event
from tokenline.api.openai.chat import ChatCompletionRequest, CompletionRequest
from tokenline.api.ring.exchange import Exchange
from tokenline.api.tools import chat_calls as tool_render
from tokenline.api.tools.parsers import ToolCallFormat

NORMAL_ENDS = ("stop", "length")


def _tool_parser(body) -> ToolCallFormat | None:
    plan = getattr(body, "_tool_plan", None)
    return plan.parser if plan is not None else None


def timings_header(ex: Exchange) -> str:
    return ", ".join(f"{k.removesuffix('_s')}={v * 1000:.3f}ms" for k, v in ex.timings.items())


def _usage(ex: Exchange, per_prompt: int) -> dict:
    """Usage of the whole request; choices go prompt by prompt, ``per_prompt`` (n) each, and
    a prompt counts once however many choices it has."""
    completion = sum(c.completion_tokens for c in ex.choices)
    prompt = sum(c.prompt_tokens for c in ex.choices[::per_prompt])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": ex.cached_tokens},
    }


# ── logprobs ───────────────────────────────────────────────────────────────────────────────────
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM report this instead


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _chat_logprobs(entries: list[protocol.LogprobEntry]) -> dict:
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


def _completion_logprobs(entries: list[protocol.LogprobEntry], offset: int = 0) -> dict:
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


def _prompt_logprobs(ex: Exchange, index: int, per_prompt: int):
    """A choice's prompt logprobs. They are the same for the ``n`` choices of a prompt, so only
    the first asks the scheduler for them (`CompletionRequest.sampling`); the others borrow."""
    return ex.choices[index - index % per_prompt].prompt_logprobs


def _echoed(choice, prompt_logprobs, text: str, logprobs: dict | None) -> tuple[str, dict | None]:
    """``text`` and ``logprobs`` with the prompt's in front, for a completion with echo."""
    prompt = choice.prompt_text or ""
    if logprobs is None:
        return prompt + text, None
    if prompt_logprobs is None:
        return prompt + text, logprobs
    echo = _echo_logprobs(prompt, prompt_logprobs)
    shifted = {**logprobs, "text_offset": [o + len(prompt) for o in logprobs["text_offset"]]}
    return prompt + text, _joined_logprobs(echo, shifted)


class RunningUsage:
    """Usage as a stream has sent it so far (vLLM's ``continuous_usage_stats``)."""

    def __init__(self, ex: Exchange, per_prompt: int) -> None:
        self._ex, self._per_prompt = ex, per_prompt
        self._sent = [0] * len(ex.choices)

    def sent(self, index: int, reply: protocol.Reply) -> None:
        self._sent[index] += reply.num_tokens

    def now(self) -> dict:
        usage = _usage(self._ex, self._per_prompt)
        completion = sum(self._sent)
        usage["completion_tokens"] = completion
        usage["total_tokens"] = usage["prompt_tokens"] + completion
        return usage


def full_response(ex: Exchange, body, meta: dict, chat: bool) -> dict:
    choices = []
    wanted = body.wanted_logprobs() is not None
    for choice in ex.choices:
        text = "".join(ex.texts[choice.index])
        entries = ex.logprobs[choice.index]
        if chat:
            message, has_calls = tool_render.message(text, _tool_parser(body))
            choices.append(
                {
                    "index": choice.index,
                    "message": message,
                    "finish_reason": tool_render.finish_reason(choice.finish_reason, has_calls),
                    "logprobs": _chat_logprobs(entries) if wanted else None,
                }
            )
        else:
            logprobs = _completion_logprobs(entries) if wanted else None
            if body.echo:
                borrowed = _prompt_logprobs(ex, choice.index, body.n)
                text, logprobs = _echoed(choice, borrowed, text, logprobs)
            choices.append(
                {
                    "index": choice.index,
                    "text": text,
                    "finish_reason": choice.finish_reason,
                    "logprobs": logprobs,
                }
            )
    return {
        **meta,
        "object": "chat.completion" if chat else "text_completion",
        "choices": choices,
        "usage": _usage(ex, body.n),
    }


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


async def _replies(ex: Exchange, first: list) -> AsyncIterator[tuple[int, protocol.Reply]]:
    batch = first
    while batch:
        for item in coalesce(batch):
            yield item
        batch = await ex.next_batch()


def _error_event(ex: Exchange, reply: protocol.Reply | None) -> bytes:
    if ex.error is not None:
        return event(ex.error.body())
    reason = reply.finish_reason if reply else "error"
    return event(
        ApiError(
            500,
            f"generation ended with {reason}",
            reply.error_code if reply and reply.error_code else "engine_error",
        ).body()
    )


def _chunk_usage(body, running: RunningUsage) -> dict:
    """What a chunk before the last says of usage: nothing unless asked, then null (OpenAI),
    or the usage so far with ``continuous_usage_stats`` (vLLM)."""
    if not body.include_usage:
        return {}
    return {"usage": running.now() if body.continuous_usage else None}


async def chat_events(
    ex: Exchange, body: ChatCompletionRequest, first: list, meta: dict
) -> AsyncIterator[bytes]:
    head = {**meta, "object": "chat.completion.chunk"}
    wanted = body.wanted_logprobs() is not None
    running = RunningUsage(ex, body.n)

    def chunk(
        index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None
    ) -> bytes:
        return event(
            {
                **head,
                "choices": [
                    {
                        "index": index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                ],
                **_chunk_usage(body, running),
            }
        )

    parser = _tool_parser(body)
    calls = {c.index: tool_render.DeltaStream(parser) for c in ex.choices} if parser else {}
    for choice in ex.choices:
        yield chunk(choice.index, {"role": "assistant", "content": ""})
    async for index, reply in _replies(ex, first):
        running.sent(index, reply)
        if index in calls:  # tool calls are parsed out of the text before it is sent
            deltas = calls[index].feed(reply.text)
            if reply.finish_reason is not None:
                deltas += calls[index].finish()
            if wanted and reply.logprobs:
                yield chunk(index, {"content": ""}, logprobs=_chat_logprobs(reply.logprobs))
            for delta in deltas:
                yield chunk(index, delta)
        elif wanted and reply.logprobs:
            # tokens whose text is still held back get their chunk now, with empty content
            yield chunk(index, {"content": reply.text}, logprobs=_chat_logprobs(reply.logprobs))
        elif reply.text:
            yield chunk(index, {"content": reply.text})
        if reply.finish_reason in NORMAL_ENDS:
            has_calls = index in calls and calls[index].has_calls
            yield chunk(index, {}, tool_render.finish_reason(reply.finish_reason, has_calls))
        elif reply.finish_reason:
            yield _error_event(ex, reply)
            yield DONE
            return
    if ex.error is not None:
        yield _error_event(ex, None)
    elif body.include_usage:
        yield event({**head, "choices": [], "usage": _usage(ex, body.n)})
    yield DONE


async def completion_events(
    ex: Exchange, body: CompletionRequest, first: list, meta: dict
) -> AsyncIterator[bytes]:
    head = {**meta, "object": "text_completion"}
    wanted = body.wanted_logprobs() is not None
    offsets = [0] * len(ex.choices)  # per choice: where the next token's text starts
    echo_pending = [body.echo] * len(ex.choices)  # the prompt goes in front of the first piece
    running = RunningUsage(ex, body.n)

    def chunk(index: int, reply: protocol.Reply, finish: str | None = None) -> bytes:
        text, logprobs = reply.text, None
        if wanted:
            entries = reply.logprobs or []
            logprobs = _completion_logprobs(entries, offsets[index])
            offsets[index] += sum(len(e.token) for e in entries)
        if echo_pending[index]:
            echo_pending[index] = False
            borrowed = _prompt_logprobs(ex, index, body.n)
            text, logprobs = _echoed(ex.choices[index], borrowed, text, logprobs)
            offsets[index] += len(ex.choices[index].prompt_text or "")
        return event(
            {
                **head,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                ],
                **_chunk_usage(body, running),
            }
        )

    # A choice that borrows its prompt's logprobs waits, before its first chunk, for the
    # prompt's first choice to bring them (or to end without them).
    waiting: dict[int, list[protocol.Reply]] = {}
    borrows = body.echo and wanted and body.n > 1

    def must_wait(index: int) -> bool:
        lender = ex.choices[index - index % body.n]
        return (
            borrows
            and echo_pending[index]
            and lender.index != index
            and lender.prompt_logprobs is None
            and not lender.finish_reason
        )

    def ready() -> list[tuple[int, protocol.Reply]]:
        out = []
        for index in [i for i in waiting if not must_wait(i)]:
            out += [(index, reply) for reply in waiting.pop(index)]
        return out

    def chunks(index: int, reply: protocol.Reply) -> list[bytes] | None:
        """The chunks a reply makes; None when it ended the stream with an error."""
        running.sent(index, reply)
        if reply.finish_reason in NORMAL_ENDS:
            return [chunk(index, reply, reply.finish_reason)]
        if reply.finish_reason:
            return None
        if reply.text or (wanted and reply.logprobs) or echo_pending[index]:
            return [chunk(index, reply)]
        return []

    async for index, reply in _replies(ex, first):
        if index in waiting or must_wait(index):
            waiting.setdefault(index, []).append(reply)
            continue
        for ready_index, ready_reply in [(index, reply), *ready()]:
            out = chunks(ready_index, ready_reply)
            if out is None:
                yield _error_event(ex, ready_reply)
                yield DONE
                return
            for piece in out:
                yield piece
    for ready_index, ready_reply in ready():  # lenders that ended: nothing left to wait for
        out = chunks(ready_index, ready_reply)
        if out is None:
            yield _error_event(ex, ready_reply)
            yield DONE
            return
        for piece in out:
            yield piece
    if ex.error is not None:
        yield _error_event(ex, None)
    elif body.include_usage:
        yield event({**head, "choices": [], "usage": _usage(ex, body.n)})
    yield DONE
