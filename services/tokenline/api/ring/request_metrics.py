"""Per-request metrics the api owns: tokens, time to first token, inter-token latency, ends."""

from __future__ import annotations

import logging
import time

from tokenline.api.ring.exchange import Exchange
from tokenline.metrics import (
    ABORTS,
    E2E_LATENCY,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    PROMPT_TOKENS,
    REASONING_TOKENS,
    REQUEST_ERRORS,
    REQUESTS,
    STAGE_LATENCY,
    TIME_TO_FIRST_TOKEN,
)
from tokenline.protocol import Reply

log = logging.getLogger(__name__)
COUNTED_ABORTS = ("client_disconnect", "deadline", "slow_client", "stage_failure", "shutdown")


class RequestMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self._generation = GENERATION_TOKENS.labels(model=model)
        self._ttft = TIME_TO_FIRST_TOKEN.labels(model=model)
        self._itl = INTER_TOKEN_LATENCY.labels(model=model)
        self._e2e = E2E_LATENCY.labels(model=model)
        self._prompt = PROMPT_TOKENS.labels(model=model)
        self._reasoning = REASONING_TOKENS.labels(model=model)
        self._latency = STAGE_LATENCY.labels(stage="api")
        for reason in COUNTED_ABORTS:
            ABORTS.labels(reason=reason)  # export zeros so rate() works from the start
        for reason in ("stop", "length", "abort", "error"):
            REQUESTS.labels(model=model, finish_reason=reason)

    def abort(self, reason: str) -> None:
        if reason in COUNTED_ABORTS:
            ABORTS.labels(reason=reason).inc()

    def error(self, code: str) -> None:
        REQUEST_ERRORS.labels(code=code).inc()

    def tokens(self, ex: Exchange, reply: Reply, now: float) -> None:
        if reply.num_tokens == 0:
            return
        self._generation.inc(reply.num_tokens)
        if ex.first_token_at is None:
            ex.first_token_at = now
            self._ttft.observe(now - ex.created)
        elif ex.last_token_at is not None:
            gap = (now - ex.last_token_at) / reply.num_tokens
            for _ in range(reply.num_tokens):
                self._itl.observe(gap)
        ex.last_token_at = now

    def end(self, ex: Exchange) -> None:
        e2e = time.monotonic() - ex.created
        self._e2e.observe(e2e)
        for choice in ex.choices:
            reason = choice.finish_reason or ("abort" if ex.abort_reason else "error")
            REQUESTS.labels(model=self.model, finish_reason=reason).inc()
            if choice.reasoning_tokens:
                self._reasoning.observe(choice.reasoning_tokens)
        if ex.error is not None and ex.abort_reason is not None:
            self.error(ex.error.code)
        # Every choice is its own sequence in the scheduler, which reads its prompt (or finds
        # it in the prefix cache, counted apart): so each prompt of a list counts, and each of
        # its n choices, as vLLM counts its per-choice requests and as the scheduler's
        # prefix-cache queries count, so hits / queries and this counter agree.
        prompt = sum(c.prompt_tokens for c in ex.choices)
        if prompt:
            self._prompt.inc(prompt)
        # The api's own time on the critical path, measured (not e2e minus the others): from
        # arrival until the request left for the tokenizer, and from the last reply until now.
        now = ex.created + e2e
        ex.timings["api_s"] = (ex.sent_at - ex.created) + (now - (ex.finished_at or now))
        ex.timings["e2e_s"] = e2e
        self._latency.observe(ex.timings["api_s"])
        log.debug(
            "request %s timings %s",
            ex.uids[0],
            " ".join(f"{k}={v * 1000:.1f}ms" for k, v in ex.timings.items()),
        )
