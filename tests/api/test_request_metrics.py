"""The api's per-request counters against what the same requests report in ``usage``, on the
real four-process stack, read off the api's /metrics."""

from __future__ import annotations

import time

import pytest
from openai import OpenAI


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _prompt_tokens(stack) -> float:
    return stack.metric("api", "tokenline_prompt_tokens_total", model=stack.model)


def _grew_by(stack, before: float, expected: float) -> float:
    """The counter's growth once it reaches ``expected`` (a stream is counted when its
    exchange closes, just after the last byte is sent), or what it was after 5 s."""
    deadline = time.monotonic() + 5
    while (grown := _prompt_tokens(stack) - before) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return grown


@pytest.mark.parametrize(
    "prompt",
    [
        ["the river", "and the mountain, far away", "x"],
        [[72, 105, 33], [1, 2, 3, 4, 5, 6, 7], [9]],
    ],
    ids=["texts", "token-ids"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_each_prompt_of_a_list_is_counted(client, stack, prompt, stream):
    before = _prompt_tokens(stack)
    kw = dict(model=stack.model, prompt=prompt, max_tokens=2, temperature=0)
    if stream:
        chunks = list(
            client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
        usage = chunks[-1].usage
    else:
        usage = client.completions.create(**kw).usage
    per_prompt = usage.prompt_tokens
    assert per_prompt > len(prompt)  # more than one token from the longest alone
    assert _grew_by(stack, before, per_prompt) == per_prompt


def test_each_choice_reads_its_prompt(client, stack):
    """``n`` choices are n sequences in the scheduler: the counter counts each, as vLLM's
    per-choice requests do, while usage counts the prompt once."""
    before = _prompt_tokens(stack)
    reply = client.completions.create(
        model=stack.model, prompt=["the river", "a mountain far away"], n=3, max_tokens=2
    )
    assert len(reply.choices) == 6
    expected = 3 * reply.usage.prompt_tokens
    assert _grew_by(stack, before, expected) == expected
