"""One HTTP request's view of the ring: its uids (one per choice) and a bounded reply buffer.

The listener task pushes replies in; the HTTP handler drains them out. The buffer is bounded by
backpressure rather than by dropping: above ``high_water`` items the ring client asks the
scheduler to pause the uids, below ``low_water`` to resume them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from tokenline.api.http.errors import ApiError, ended_with
from tokenline.protocol import KVTransferParams, LogprobEntry, Reply

HIGH_WATER = 64
LOW_WATER = 16
NORMAL_ENDS = ("stop", "length")  # every other finish reason ends an answer in an error


class FlowControl(Protocol):
    def pause(self, exchange: Exchange) -> None: ...
    def resume(self, exchange: Exchange) -> None: ...


@dataclass
class Choice:
    index: int
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    prompt_text: str | None = None  # echo: the prompt as the detokenizer decoded it
    prompt_logprobs: list[LogprobEntry | None] | None = None  # echo with logprobs
    reasoning_tokens: int = 0  # of completion_tokens, those that were thinking
    error: ApiError | None = None  # why it ended, when neither stop nor length


@dataclass(eq=False)
class Exchange:
    uids: list[str]
    deadline: float
    flow: FlowControl
    created: float = field(default_factory=time.monotonic)
    tenant: str = ""  # whose request (--max-waiting-per-tenant)
    choices: list[Choice] = field(default_factory=list)
    # Prompt tokens served from the prefix cache: the fewest any choice found, since choices
    # admitted together share one prompt but cannot share what none has computed yet.
    cached_tokens: int = 0
    # a prefill pod's answer (do_remote_decode): where the decode pod reads the prompt's KV
    kv_transfer: KVTransferParams | None = None
    error: ApiError | None = None  # set when the request ends in an error or an abort
    abort_reason: str | None = None
    paused: bool = False
    # False when each uid sends one reply, its result (pooling): the buffer is bounded by the
    # uid count, and pausing uids that have nothing more to send only floods the ring
    pausable: bool = True
    closed: bool = False
    # ends the response still writing this request out (a stream's), once it cannot finish
    cut_off: Callable[[], None] | None = None
    last_read: float = field(default_factory=time.monotonic)
    sent_at: float = 0.0  # when the request left for the tokenizer
    finished_at: float | None = None  # when the last choice's terminal reply arrived
    first_token_at: float | None = None
    last_token_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    texts: list[list[str]] = field(default_factory=list)  # filled by collect()
    logprobs: list[list[LogprobEntry]] = field(default_factory=list)  # filled by collect()
    reasoning: list[list[str]] = field(default_factory=list)  # filled by collect()
    _buffer: deque[tuple[int, Reply]] = field(default_factory=deque)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.index = {uid: i for i, uid in enumerate(self.uids)}
        self.choices = [Choice(i) for i in range(len(self.uids))]
        self.texts = [[] for _ in self.uids]
        self.logprobs = [[] for _ in self.uids]
        self.reasoning = [[] for _ in self.uids]

    # ── listener side ──────────────────────────────────────────────────────────────────────────
    @property
    def done(self) -> bool:
        return self.error is not None or all(c.finish_reason for c in self.choices)

    @property
    def depth(self) -> int:
        return len(self._buffer)

    def live_uids(self) -> list[str]:
        return [uid for uid, c in zip(self.uids, self.choices, strict=True) if not c.finish_reason]

    def deliver(self, reply: Reply) -> None:
        choice = self.choices[self.index[reply.uid]]
        if choice.finish_reason or self.error is not None:
            return
        choice.completion_tokens += reply.num_tokens
        choice.reasoning_tokens += reply.reasoning_tokens
        choice.prompt_tokens = max(choice.prompt_tokens, reply.prompt_tokens)
        if reply.prompt_text is not None:
            choice.prompt_text = reply.prompt_text
        if reply.prompt_logprobs is not None:
            choice.prompt_logprobs = reply.prompt_logprobs
        if reply.finish_reason:
            choice.finish_reason = reply.finish_reason
            if reply.finish_reason not in NORMAL_ENDS:
                choice.error = ended_as(reply)
            ended = [c for c in self.choices if c.finish_reason]
            self.cached_tokens = (
                reply.cached_tokens
                if len(ended) == 1
                else min(self.cached_tokens, reply.cached_tokens)
            )
            if reply.kv_transfer is not None:
                self.kv_transfer = reply.kv_transfer
            for key in ("tokenizer_s", "queue_s", "scheduler_s", "detokenizer_s"):
                self.timings[key] = max(self.timings.get(key, 0.0), getattr(reply, key))
        self._buffer.append((choice.index, reply))
        self._wake.set()
        full = len(self._buffer) > HIGH_WATER
        if full and self.pausable and not self.paused and self.live_uids():
            self.paused = True
            self.flow.pause(self)

    def fail(self, error: ApiError, abort_reason: str | None = None) -> None:
        """End the whole request with ``error``; wakes a waiting reader at once."""
        if self.error is None and not all(c.finish_reason for c in self.choices):
            self.error = error
            self.abort_reason = abort_reason
        self._wake.set()

    def drop_replies(self) -> None:
        """Let go of the buffered replies of a request nobody will read (and wake its reader)."""
        self._buffer.clear()
        self._wake.set()

    # ── handler side ───────────────────────────────────────────────────────────────────────────
    async def next_batch(self) -> list[tuple[int, Reply]]:
        """Every buffered reply; waits for one. Empty once the request is over."""
        while not self._buffer and not self.done:
            self._wake.clear()
            await self._wake.wait()
        items = list(self._buffer)
        self._buffer.clear()
        self.last_read = time.monotonic()
        if self.paused and len(self._buffer) < LOW_WATER:
            self.paused = False
            self.flow.resume(self)
        return items

    async def replies(self, first: list[tuple[int, Reply]]) -> AsyncIterator[tuple[int, Reply]]:
        """Every reply from ``first`` on, coalesced, until the request is over (a stream)."""
        batch = first
        while batch:
            for item in coalesce(batch):
                yield item
            batch = await self.next_batch()

    def error_for(self, reply: Reply | None) -> ApiError:
        """Why a stream ends early: the request's error, or the reply's own end."""
        if self.error is not None:
            return self.error
        return ended_as(reply) if reply is not None else ended_with(None)

    def keep(self, batch: list[tuple[int, Reply]]) -> None:
        """Accumulate replies' text and logprobs per choice (non-streaming)."""
        for index, reply in batch:
            self.texts[index].append(reply.text)
            if reply.reasoning:
                self.reasoning[index].append(reply.reasoning)
            if reply.logprobs:
                self.logprobs[index].extend(reply.logprobs)

    async def collect(self) -> None:
        """Wait for the whole request (non-streaming); text accumulates in ``texts``."""
        while True:
            batch = await self.next_batch()
            self.keep(batch)
            if not batch and self.done:
                return


def ended_as(reply: Reply) -> ApiError:
    """The error a reply that ended its choice neither ``stop`` nor ``length`` stands for,
    with the code (and message and status, where the stage gave them) of its stage."""
    return ended_with(reply.finish_reason, reply.error_code, reply.error_message, reply.http_status)


def coalesce(batch: list[tuple[int, Reply]]) -> list[tuple[int, Reply]]:
    """Merge consecutive pieces of one choice, so a client that fell behind gets fewer,
    larger events instead of one per token."""
    merged: list[tuple[int, Reply]] = []
    for index, reply in batch:
        if merged and merged[-1][0] == index and merged[-1][1].finish_reason is None:
            merged[-1] = (index, _merged(merged[-1][1], reply))
        else:
            merged.append((index, reply))
    return merged


def _merged(first: Reply, then: Reply) -> Reply:
    """``then`` with ``first``'s pieces in front: the later reply's own fields (its end, error
    code, timings, KV transfer) are kept, and what only a first reply carries comes from it."""
    return msgspec.structs.replace(
        then,
        text=first.text + then.text,
        num_tokens=first.num_tokens + then.num_tokens,
        reasoning=first.reasoning + then.reasoning,
        reasoning_tokens=first.reasoning_tokens + then.reasoning_tokens,
        logprobs=_merge_logprobs(first.logprobs, then.logprobs),
        prompt_tokens=max(first.prompt_tokens, then.prompt_tokens),
        prompt_text=first.prompt_text if first.prompt_text is not None else then.prompt_text,
        prompt_logprobs=(
            first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs
        ),
    )


def _merge_logprobs(
    first: list[LogprobEntry] | None, second: list[LogprobEntry] | None
) -> list[LogprobEntry] | None:
    if first is None or second is None:
        return first if second is None else second
    return first + second
