"""The official openai client against the real four-process stack."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI


@pytest.fixture
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=60)


CHAT = [{"role": "user", "content": "Tell me about the river and the mountain."}]


def test_models_list_names_the_served_model(client, stack):
    assert [m.id for m in client.models.list().data] == [stack.model]


def test_chat_non_streaming_reports_real_usage(client, stack, tiny_tokenizer):
    reply = client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    text = tiny_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == 7
    assert reply.usage.total_tokens == len(prompt_ids) + 7


def test_chat_streaming_chunks_follow_openai(client, stack):
    stream = client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in choice_chunks]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_completions_streaming_and_not(client, stack, tiny_tokenizer):
    full = client.completions.create(
        model=stack.model,
        prompt="hello world",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.object == "text_completion"
    assert full.usage.prompt_tokens == len(tiny_tokenizer("hello world")["input_ids"])
    chunks = list(
        client.completions.create(
            model=stack.model,
            prompt="hello world",
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert {c.object for c in chunks} == {"text_completion"}
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_2_returns_two_choices(client, stack):
    reply = client.completions.create(
        model=stack.model,
        prompt="a b c",
        max_tokens=4,
        n=2,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert reply.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        max_tokens=3,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    ends = {
        c.choices[0].index: c.choices[0].finish_reason
        for c in stream
        if c.choices and c.choices[0].finish_reason
    }
    assert ends == {0: "length", 1: "length"}


def test_same_seed_same_text_and_other_seed_differs(client, stack):
    def run(seed: int) -> str:
        return (
            client.completions.create(
                model=stack.model,
                prompt="the quick",
                max_tokens=12,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_each_prompt_of_a_seeded_batch_draws_the_same_seeds(client, stack):
    """vLLM gives every prompt the request's sampling, its n choices seed, seed + 1, ...: the
    same prompt twice in one seeded request samples the same choices."""
    reply = client.completions.create(
        model=stack.model,
        prompt=["the quick", "the quick"],
        n=2,
        max_tokens=12,
        temperature=1.0,
        seed=77,
        extra_body={"ignore_eos": True},
    )
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert texts[0] == texts[2] and texts[1] == texts[3] and texts[0] != texts[1]


def test_null_sampling_fields_mean_the_defaults_and_top_logprobs_0_asks_nothing(stack):
    """Clients that write every option out send null for those they leave alone (vLLM's
    optional fields); top_logprobs 0 without logprobs asks for nothing, as vLLM reads it."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "presence_penalty"])
    body = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], **nulls}
    reply = httpx.post(
        f"{stack.api_url}/v1/chat/completions",
        json={**body, "max_tokens": 2, "top_logprobs": 0, "stop_token_ids": None},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 1 and reply.json()["choices"][0]["logprobs"] is None
    wrong = httpx.post(f"{stack.api_url}/v1/chat/completions", json={**body, "model": None})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"


def test_stop_string_cuts_exactly_and_ends_with_stop(client, stack):
    greedy = client.completions.create(
        model=stack.model,
        prompt="north south",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = greedy.choices[0].text
    assert greedy.choices[0].finish_reason == "length"
    stop = _a_stop_string_in(text)
    cut = client.completions.create(
        model=stack.model,
        prompt="north south",
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed, finish = _streamed(client, stack, stop, {"ignore_eos": True})
    assert (streamed, finish) == (text[: text.index(stop)], "stop")


def _a_stop_string_in(text: str) -> str:
    """Two characters of ``text`` past its start, found nowhere before."""
    return next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].strip() and text[i : i + 2] not in text[:i]
    )


def _streamed(client, stack, stop: str, extra: dict) -> tuple[str, str]:
    """The greedy streamed reply to "north south" with ``stop``, and how it ended."""
    chunks = list(
        client.completions.create(
            model=stack.model,
            prompt="north south",
            max_tokens=24,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body=extra,
        )
    )
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[
        0
    ].finish_reason


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_token(
    client, stack, tiny_tokenizer
):
    def run(**fields) -> tuple[str, str]:
        reply = client.completions.create(
            model=stack.model, prompt="north south", max_tokens=24, temperature=0, **fields
        )
        return reply.choices[0].text, reply.choices[0].finish_reason

    text, _ = run(extra_body={"ignore_eos": True})
    stop = _a_stop_string_in(text)
    kept = {"ignore_eos": True, "include_stop_str_in_output": True}
    end = text.index(stop) + len(stop)
    assert run(stop=[stop], extra_body=kept) == (text[:end], "stop")
    assert _streamed(client, stack, stop, kept) == (text[:end], "stop")
    # a stop token that is text: its text ends the reply too (vLLM decodes it then)
    token = tiny_tokenizer("river", add_special_tokens=False)["input_ids"][0]
    forced = {"ignore_eos": True, "stop_token_ids": [token]}
    bias = {str(token): 100}
    assert run(logit_bias=bias, extra_body=forced) == ("", "stop")
    kept_token = run(logit_bias=bias, extra_body={**forced, "include_stop_str_in_output": True})
    assert kept_token == (tiny_tokenizer.decode([token]), "stop") and kept_token[0]
    chat = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "north"}],
        max_tokens=4,
        logit_bias=bias,
        extra_body={**forced, "include_stop_str_in_output": True},
    )
    assert chat.choices[0].message.content == kept_token[0]


def test_skip_special_tokens_false_shows_them(client, stack, tiny_tokenizer):
    user = tiny_tokenizer.convert_tokens_to_ids("<|user|>")  # special, not a control token

    def run(**fields) -> str:
        reply = client.completions.create(
            model=stack.model,
            prompt="north",
            max_tokens=2,
            logit_bias={str(user): 100},
            extra_body={"ignore_eos": True, **fields},
        )
        return reply.choices[0].text

    assert (run(), run(skip_special_tokens=False)) == ("", "<|user|><|user|>")
    chat = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "north"}],
        max_tokens=2,
        logit_bias={str(user): 100},
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert chat.choices[0].message.content == "<|user|><|user|>"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"


def test_invalid_body_is_400_with_the_field_named(client, stack):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=stack.model, prompt="x", max_tokens=1, temperature=9)
    assert err.value.body["param"] == "temperature"
    response = httpx.post(
        f"{stack.api_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_max_tokens_past_the_context_is_cut_to_what_the_prompt_leaves(client, stack):
    """vLLM 0.32 clamps max_tokens to the context (get_max_tokens) instead of refusing."""
    context = httpx.post(f"{stack.api_url}/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    reply = client.completions.create(
        model=stack.model,
        prompt=[7] * (context - 3),
        max_tokens=10 * context,
        extra_body={"ignore_eos": True},
    )
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (3, "length")


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_context_fails_at_once(client, stack, stream):
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=stack.model,
            stream=stream,
            messages=[{"role": "user", "content": "river mountain " * 3000}],
        )
    assert err.value.body["code"] == "context_length_exceeded"
    assert time.monotonic() - started < 5


def test_sse_headers_and_done_marker(stack):
    body = {"model": stack.model, "messages": CHAT, "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", f"{stack.api_url}/v1/chat/completions", json=body, timeout=30
    ) as response:
        lines = [line for line in response.iter_lines() if line]
        assert response.headers["x-accel-buffering"] == "no"
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"


async def test_twenty_concurrent_streams_complete(stack):
    client = AsyncOpenAI(
        base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0, timeout=120
    )

    async def one(i: int) -> tuple[str | None, int]:
        stream = await client.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, usage = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return finish, usage

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(20))), 120)
    assert results == [("length", 16)] * 20
    await client.close()


def test_penalties_and_min_tokens_are_served(client, stack):
    reply = client.completions.create(
        model=stack.model,
        prompt="the the the",
        max_tokens=8,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.3, "min_tokens": 4},
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens >= 4


def test_stop_token_id_outside_the_vocabulary_is_400(client, stack):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=stack.model, prompt="x", max_tokens=2, extra_body={"stop_token_ids": [10**9]}
        )
    assert err.value.body["param"] == "stop_token_ids"
