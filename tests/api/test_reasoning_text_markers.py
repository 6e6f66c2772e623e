"""A thinking model whose ``<think>`` and ``</think>`` are not tokens of its vocabulary
(tests/reasoning_testkit.py with ``markers_as_tokens=False``: the model spells them in pieces)
is served: auto reads ``qwen3`` from its template, and the detokenizer splits the text.

What cannot be exact is refused per request: a grammar (response_format, tools) must hold from
the answer's first token, which the scheduler cannot tell by token here, so it is a 400 unless
the prompt closed the block (``enable_thinking: false``), when it is served as usual. The
oracle for the split is the raw completion of the same prompt and seed.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from reasoning_testkit import END, START, write_thinking_model

from tokenline import tiny_model

MODEL = "spelled"
USER = [{"role": "user", "content": "Why is the river long?"}]
THINKING_ONLY = {"chat_template_kwargs": {"thinking_only": True}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
COUNT = {
    "type": "json_schema",
    "json_schema": {
        "name": "count",
        "schema": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
        },
    },
}
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def stack(model_cache, launch_stack, tmp_path_factory):
    model = write_thinking_model(
        tiny_model.ensure_cached(model_cache),
        tmp_path_factory.mktemp("spelled") / "model",
        markers_as_tokens=False,
    )
    assert START not in (model / "tokenizer.json").read_text()
    stack = launch_stack("--model", str(model), "--served-model-name", MODEL)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key="x", max_retries=0)


def _raw(stack, client, seed: int, kwargs: dict) -> str:
    """The raw completion of the chat's prompt (rendered with ``kwargs``) for ``seed``."""
    body = {"model": MODEL, "messages": USER, **kwargs}
    prompt = httpx.post(f"{stack.api_url}/tokenize", json=body).json()["tokens"]
    reply = client.completions.create(
        model=MODEL, prompt=prompt, seed=seed, max_tokens=12, extra_body={"ignore_eos": True}
    )
    return reply.choices[0].text


def _chat(client, seed: int, extra: dict, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=USER,
        seed=seed,
        max_tokens=12,
        extra_body={"ignore_eos": True, **extra},
        **kw,
    )


def test_a_block_the_prompt_opened_is_all_thinking_whole_and_streamed(stack, client):
    for seed in range(3):
        raw = _raw(stack, client, seed, THINKING_ONLY)
        assert END not in raw  # random weights do not spell it; the reply is cut thinking
        reply = _chat(client, seed, THINKING_ONLY)
        message = reply.choices[0].message
        assert message.content == "" and message.model_extra["reasoning"] == raw
        assert message.model_extra["reasoning_content"] == raw
        assert reply.usage.completion_tokens_details.reasoning_tokens == 12
        chunks = list(_chat(client, seed, THINKING_ONLY, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == raw
        assert not any(d.content for d in deltas)


def test_without_a_block_the_answer_is_the_raw_output(stack, client):
    raw = _raw(stack, client, 5, {})
    message = _chat(client, 5, {}).choices[0].message
    assert message.content == raw and "reasoning" not in (message.model_extra or {})


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": COUNT},
        {"tools": [TOOL], "tool_choice": "required"},
        {"tools": [TOOL]},  # auto: free text, but a call in it is still held to a grammar
    ],
)
@pytest.mark.parametrize("kwargs", [{}, THINKING_ONLY])
def test_a_grammar_where_thinking_may_come_is_refused_with_a_400(client, fields, kwargs):
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, 0, kwargs, **fields)
    error = refused.value.body
    assert error["param"] == "response_format"
    assert "not single tokens" in error["message"] and "enable_thinking" in error["message"]


def test_a_grammar_after_a_block_the_prompt_closed_is_served(client):
    finished = 0
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            seed=seed,
            max_tokens=40,
            response_format=COUNT,
            extra_body=NO_THINKING,
        )
        message = reply.choices[0].message
        assert "reasoning" not in (message.model_extra or {})
        if reply.choices[0].finish_reason == "stop":  # max_tokens may cut it anywhere
            assert set(json.loads(message.content)) == {"n"}
            finished += 1
    assert finished
