"""Prefix caching as clients and dashboards see it: `cached_tokens` and the cache counters."""

from __future__ import annotations

import time
import uuid

import pytest
from openai import OpenAI


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _system_prompt() -> str:
    # unique per test run, so an earlier test cannot have cached it already
    return f"{uuid.uuid4().hex} " + "the river runs past the old mountain road " * 12


def test_a_resent_chat_prefix_is_reported_cached_streamed_and_not(client, stack):
    system = {"role": "system", "content": _system_prompt()}
    first = client.chat.completions.create(
        model=stack.model,
        messages=[system, {"role": "user", "content": "one"}],
        max_tokens=3,
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(
        model=stack.model,
        messages=[system, {"role": "user", "content": "two"}],
        max_tokens=3,
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens  # whole blocks of the shared system prompt
    stream = client.chat.completions.create(
        model=stack.model,
        messages=[system, {"role": "user", "content": "three"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1
    assert usage[0].prompt_tokens_details.cached_tokens == cached


def test_completions_report_cached_tokens_and_the_counters_count_them(client, stack):
    prompt = _system_prompt()
    queries = stack.metric("scheduler", "tokenline_prefix_cache_queries_total")
    hits = stack.metric("scheduler", "tokenline_prefix_cache_hits_total")
    first = client.completions.create(model=stack.model, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=stack.model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= second.usage.prompt_tokens - 16  # all but the last block's worth
    deadline = time.monotonic() + 5  # the scheduler exports its counters every half second
    while time.monotonic() < deadline:
        new_hits = stack.metric("scheduler", "tokenline_prefix_cache_hits_total") - hits
        if new_hits >= cached:
            break
        time.sleep(0.1)
    assert new_hits >= cached
    new_queries = stack.metric("scheduler", "tokenline_prefix_cache_queries_total") - queries
    assert new_queries >= first.usage.prompt_tokens + second.usage.prompt_tokens
