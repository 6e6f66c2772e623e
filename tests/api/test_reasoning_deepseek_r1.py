"""A DeepSeek-R1-style model through the official client: its chat template opens ``<think>``
at the generation prompt (tests/reasoning_testkit.py, ``R1_TEMPLATE``), its markers are added
tokens as in R1's tokenizer, and auto reads ``deepseek_r1`` from the template.

The oracle is the raw output: the same prompt (the chat's own ids, from /tokenize) and seed
sent to /v1/completions give the text the model wrote, markers and all; the chat reply must
be that text split at the first ``</think>``, whole and streamed. logit_bias makes ``</think>``
likely, so random weights end their thinking after a few tokens.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from reasoning_testkit import END, R1_TEMPLATE, START, write_thinking_model

from tokenline import tiny_model

MODEL = "r1"
USER = [{"role": "user", "content": "Why is the river long?"}]
SEEDS = range(6)


@pytest.fixture(scope="module")
def r1_stack(model_cache, launch_stack, tmp_path_factory):
    model = write_thinking_model(
        tiny_model.ensure_cached(model_cache),
        tmp_path_factory.mktemp("r1") / "model",
        template=R1_TEMPLATE,
    )
    stack = launch_stack("--model", str(model), "--served-model-name", MODEL)
    vocab = json.loads((model / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    # a <think> in the output would be dropped as a repeat; kept out, the oracle stays simple
    stack.bias = {str(ids[START]): -100, str(ids[END]): 3}
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(r1_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{r1_stack.api_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def raw(r1_stack, client) -> dict[int, tuple[str, list[str]]]:
    """Each seed's raw completion of the chat's prompt: its text and its tokens."""
    prompt = httpx.post(
        f"{r1_stack.api_url}/tokenize", json={"model": MODEL, "messages": USER}
    ).json()["tokens"]
    assert prompt and r1_stack.bias
    out = {}
    for seed in SEEDS:
        choice = client.completions.create(
            model=MODEL, prompt=prompt, seed=seed, logprobs=0, **_sampling(r1_stack)
        ).choices[0]
        out[seed] = (choice.text, choice.logprobs.tokens)
    return out


def _sampling(stack) -> dict:
    return {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "logit_bias": stack.bias}


def _thinking(tokens: list[str]) -> int:
    """Tokens of thinking: up to and with the first </think> (R1's prompt opened the block)."""
    return tokens.index(END) + 1 if END in tokens else len(tokens)


def _chat(client, stack, seed, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=USER, seed=seed, **_sampling(stack), **kw
    )


def test_the_reply_is_the_raw_output_split_at_the_first_end_marker(client, r1_stack, raw):
    both = 0
    for seed in SEEDS:
        text, tokens = raw[seed]
        thought, _, answer = text.partition(END)
        reply = _chat(client, r1_stack, seed)
        message = reply.choices[0].message
        extra = message.model_extra or {}
        assert (extra.get("reasoning") or "") == thought
        assert extra.get("reasoning_content") == extra.get("reasoning")
        assert (message.content or "") == answer  # later </think>s are the answer's text
        assert reply.usage.completion_tokens_details.reasoning_tokens == _thinking(tokens)
        both += bool(thought and answer)
    assert both, "no seed both thought and answered; raise the bias on </think>"


def test_streamed_deltas_add_up_to_the_same_split(client, r1_stack, raw):
    for seed in SEEDS:
        text, tokens = raw[seed]
        thought, _, answer = text.partition(END)
        stream = _chat(client, r1_stack, seed, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        extras = [d.model_extra or {} for d in deltas]
        assert "".join(e.get("reasoning") or "" for e in extras) == thought
        assert "".join(e.get("reasoning_content") or "" for e in extras) == thought
        assert "".join(d.content or "" for d in deltas) == answer
        assert all(START not in (e.get("reasoning") or "") for e in extras)
        # no content delta before the thinking is over
        first_content = next((i for i, d in enumerate(deltas) if d.content), len(deltas))
        assert not any(e.get("reasoning") for e in extras[first_content:])
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == _thinking(tokens)
