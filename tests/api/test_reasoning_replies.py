"""Reasoning models through the official client: thinking in ``message.reasoning`` (and
``reasoning_content``), the answer alone in ``content``, streamed and whole, against a stack
serving the thinking variant of the tiny model (``<think>``/``</think>`` tokens, a template with
Qwen3's switches; tests/reasoning_testkit.py), whose parser is read from the template.

Random weights decide nothing here: the template opens or closes the block (chat_template_kwargs)
and logit_bias keeps the markers out of the output, so where the thinking ends is known.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from reasoning_testkit import END, START, write_thinking_model

from tokenline import tiny_model
from tokenline.api.endpoints.chat import ChatAnswer
from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.ring.exchange import Exchange
from tokenline.protocol import Reply

MODEL = "thinking"
USER = [{"role": "user", "content": "Why is the river long?"}]


@pytest.fixture(scope="module")
def thinking_stack(model_cache, launch_stack, tmp_path_factory):
    model = write_thinking_model(
        tiny_model.ensure_cached(model_cache), tmp_path_factory.mktemp("thinking") / "model"
    )
    stack = launch_stack("--model", str(model), "--served-model-name", MODEL)
    yield stack, model
    stack.stop()


@pytest.fixture(scope="module")
def thinking(thinking_stack) -> openai.OpenAI:
    stack, _ = thinking_stack
    return openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key="x", max_retries=0)


def _marker_ids(model: Path) -> dict[str, int]:
    vocab = json.loads((model / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in vocab["added_tokens"]}


@pytest.fixture(scope="module")
def markers(thinking_stack) -> dict[str, float]:
    """logit_bias that keeps both markers out of the output."""
    _, model = thinking_stack
    ids = _marker_ids(model)
    return {str(ids[START]): -100, str(ids[END]): -100}


def _chat(client, markers, max_tokens=6, **kw):
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.chat.completions.create(
        model=MODEL,
        messages=kw.pop("messages", USER),
        max_tokens=max_tokens,
        temperature=0,
        logit_bias=markers,
        extra_body=extra,
        **kw,
    )


THINKING_ONLY = {"chat_template_kwargs": {"thinking_only": True}}


def test_a_reply_cut_inside_its_thinking_has_it_all_as_reasoning(thinking, markers):
    reply = _chat(thinking, markers, extra_body=THINKING_ONLY)
    message = reply.choices[0].message
    assert message.content == ""
    extra = message.model_extra
    assert extra["reasoning"] and extra["reasoning_content"] == extra["reasoning"]
    assert START not in extra["reasoning"] and END not in extra["reasoning"]
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6


def test_streamed_thinking_comes_in_reasoning_deltas_and_matches_the_whole(thinking, markers):
    whole = _chat(thinking, markers, extra_body=THINKING_ONLY).choices[0].message.model_extra
    stream = _chat(
        thinking,
        markers,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=THINKING_ONLY,
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    assert streamed == whole["reasoning"]
    assert all(not d.content for d in deltas)  # the role chunk's "" and nothing else
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 6


def test_thinking_switched_off_in_the_template_answers_plainly(thinking, markers):
    on = _chat(thinking, markers, extra_body=THINKING_ONLY)
    off = _chat(thinking, markers, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = off.choices[0].message
    assert message.content and "reasoning" not in (message.model_extra or {})
    assert off.usage.completion_tokens_details is None
    # the template closed an empty block in the prompt: the kwargs reached it
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_tokenize_counts_a_chat_with_its_template_kwargs_as_the_completion_does(
    thinking, markers, thinking_stack
):
    import httpx

    stack, _ = thinking_stack
    kwargs = {"enable_thinking": False}
    reply = _chat(thinking, markers, max_tokens=1, extra_body={"chat_template_kwargs": kwargs})
    body = {"model": MODEL, "messages": USER}
    counted = httpx.post(
        f"{stack.api_url}/tokenize", json={**body, "chat_template_kwargs": kwargs}
    ).json()
    plain = httpx.post(f"{stack.api_url}/tokenize", json=body).json()
    assert counted["count"] == reply.usage.prompt_tokens > plain["count"]
    refused = httpx.post(
        f"{stack.api_url}/tokenize", json={"prompt": "x", "chat_template_kwargs": kwargs}
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs"


def test_include_reasoning_false_leaves_the_thinking_out_but_counts_it(
    thinking, markers, thinking_stack
):
    stack, _ = thinking_stack
    metric = "tokenline_request_reasoning_tokens_sum"
    before = stack.metric("api", metric, model=MODEL)
    extra = {**THINKING_ONLY, "include_reasoning": False}
    reply = _chat(thinking, markers, extra_body=extra)
    message = reply.choices[0].message
    assert message.content == "" and "reasoning" not in (message.model_extra or {})
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6
    assert stack.metric("api", metric, model=MODEL) == before + 6  # per request, on /metrics


def test_reasoning_effort_reaches_the_chat_template(thinking, markers):
    plain = _chat(thinking, markers, max_tokens=1)
    effort = _chat(thinking, markers, max_tokens=1, reasoning_effort="high")
    # this template shows it in a system turn; one that does not read it is unchanged by it
    assert effort.usage.prompt_tokens > plain.usage.prompt_tokens


def test_reasoning_effort_none_turns_thinking_off_unless_the_kwargs_say_otherwise(
    thinking, markers
):
    """vLLM 0.32: an effort sets enable_thinking (false for none) where chat_template_kwargs
    leave it out; this template then closes an empty block in the prompt."""
    off = _chat(thinking, markers, max_tokens=1, reasoning_effort="none")
    kept_on = {"chat_template_kwargs": {"enable_thinking": True}}
    on = _chat(thinking, markers, max_tokens=1, reasoning_effort="none", extra_body=kept_on)
    closed = {"chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "none"}}
    by_hand = _chat(thinking, markers, max_tokens=1, extra_body=closed)
    assert off.usage.prompt_tokens == by_hand.usage.prompt_tokens > on.usage.prompt_tokens


def test_an_assistant_turn_goes_back_with_its_reasoning_under_either_name(thinking, markers):
    first = _chat(thinking, markers, extra_body=THINKING_ONLY)
    returned = first.choices[0].message.model_dump()  # reasoning and reasoning_content
    follow = [*USER, returned, {"role": "user", "content": "And the mountain?"}]
    again = _chat(thinking, markers, messages=follow, max_tokens=1)
    bare = {"role": "assistant", "content": returned["content"]}
    without = _chat(thinking, markers, messages=[*USER, bare, follow[2]], max_tokens=1)
    # the template shows an earlier turn's thinking in its block
    assert again.usage.prompt_tokens > without.usage.prompt_tokens
    old_name = {"role": "assistant", "content": "", "reasoning_content": returned["reasoning"]}
    renamed = _chat(thinking, markers, messages=[*USER, old_name, follow[2]], max_tokens=1)
    assert renamed.usage.prompt_tokens == again.usage.prompt_tokens


COUNT = {
    "type": "json_schema",
    "json_schema": {
        "name": "count",
        "schema": {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["n", "ok"],
        },
    },
}


def _json_after_thinking(client, bias: dict, seed: int, **extra):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=60,
        seed=seed,
        logit_bias=bias,
        response_format=COUNT,
        extra_body=extra,
    )
    choice = reply.choices[0]
    content = choice.message.content or ""
    assert START not in content and END not in content
    if choice.finish_reason == "stop":  # a reply cut by max_tokens may be cut anywhere
        answer = json.loads(content)
        assert set(answer) == {"n", "ok"} and isinstance(answer["n"], int)
    return reply


def test_a_grammar_holds_the_answer_after_free_thinking_on_every_seed(thinking, thinking_stack):
    _, model = thinking_stack
    ids = _marker_ids(model)
    # the prompt opened the block; </think> made likely, so the thinking ends somewhere
    bias = {str(ids[START]): -100, str(ids[END]): 4}
    replies = [_json_after_thinking(thinking, bias, seed, **THINKING_ONLY) for seed in range(8)]
    finished = [r for r in replies if r.choices[0].finish_reason == "stop"]
    assert finished, "no seed ended its thinking within max_tokens"
    assert any((r.choices[0].message.model_extra or {}).get("reasoning") for r in finished)
    assert all(r.usage.completion_tokens_details.reasoning_tokens for r in replies)


class Count(BaseModel):
    model_config = ConfigDict(extra="forbid")  # strict, as .parse() sends it

    n: int
    ok: bool


def test_the_official_parse_gets_a_strict_model_after_free_thinking(thinking, thinking_stack):
    _, model = thinking_stack
    ids = _marker_ids(model)
    parsed = 0
    for seed in range(8):
        try:
            reply = thinking.chat.completions.parse(
                model=MODEL,
                messages=USER,
                max_tokens=60,
                seed=seed,
                logit_bias={str(ids[START]): -100, str(ids[END]): 4},
                response_format=Count,
                extra_body=THINKING_ONLY,
            )
        except openai.LengthFinishReasonError:  # still thinking at max_tokens: nothing to parse
            continue
        assert isinstance(reply.choices[0].message.parsed, Count)
        parsed += 1
    assert parsed


def test_the_model_may_open_its_block_before_a_grammar_answer(thinking, thinking_stack):
    _, model = thinking_stack
    ids = _marker_ids(model)
    # nothing opened in the prompt: <think> is allowed first beside the grammar's tokens,
    # then the thinking runs free until </think>
    bias = {str(ids[START]): 100, str(ids[END]): 100}
    for seed in range(4):
        reply = _json_after_thinking(thinking, bias, seed)
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens_details.reasoning_tokens >= 2


def test_responses_stream_the_thinking_as_a_reasoning_item_before_the_answer(thinking):
    # reasoning.effort reaches the template, which then opens the block
    request = {
        "model": MODEL,
        "input": "Why is the river long?",
        "max_output_tokens": 6,
        "temperature": 0,
        "reasoning": {"effort": "low"},
    }
    with thinking.responses.stream(**request) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"  # cut by max_output_tokens while thinking
    final = events[-1].response
    whole = thinking.responses.create(**request)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    item = final.output[0]
    assert item.type == "reasoning" and streamed and item.content[0].text == streamed
    assert whole.output[0].content[0].text == streamed
    assert final.usage.output_tokens_details.reasoning_tokens > 0
    assert all(START not in (i.content[0].text or "") for i in final.output if i.content)
    # sent back as input, the thinking reaches the template with the turn it belongs to
    follow = [
        {"role": "user", "content": "Why is the river long?"},
        *[i.model_dump(exclude_none=True) for i in final.output],
        {"role": "user", "content": "And the mountain?"},
    ]
    again = thinking.responses.create(model=MODEL, input=follow, max_output_tokens=1)
    without = [m for m in follow if m.get("type") != "reasoning"]
    bare = thinking.responses.create(model=MODEL, input=without, max_output_tokens=1)
    assert again.usage.input_tokens > bare.usage.input_tokens


def test_litellm_reads_the_thinking_as_reasoning_content(thinking_stack, markers):
    import litellm

    stack, _ = thinking_stack
    reply = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=f"{stack.api_url}/v1",
        api_key="unused",
        messages=USER,
        max_tokens=6,
        temperature=0,
        logit_bias=markers,
        num_retries=0,
        extra_body={**THINKING_ONLY, "ignore_eos": True},
    )
    message = reply.choices[0].message
    assert message.reasoning_content and not message.content
    assert START not in message.reasoning_content


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "not an identifier"])
def test_template_kwargs_that_would_override_the_server_are_refused(thinking, markers, name):
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(thinking, markers, extra_body={"chat_template_kwargs": {name: True}})
    assert caught.value.body["param"] == "chat_template_kwargs"


def test_a_model_without_a_parser_answers_as_before(client_tiny):
    reply = client_tiny.chat.completions.create(
        model="tiny", messages=USER, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert "reasoning" not in (reply.choices[0].message.model_extra or {})
    assert reply.usage.completion_tokens_details is None


@pytest.fixture
def client_tiny(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key="x", max_retries=0)


# ── the answer's shapes, rendered from replies as the ring delivers them ──────────────────────
class _NoFlow:
    def pause(self, exchange) -> None: ...
    def resume(self, exchange) -> None: ...


def _exchange() -> Exchange:
    ex = Exchange(uids=["u0"], deadline=time.monotonic() + 60, flow=_NoFlow())
    pieces = [("the ", "", 2), ("river", "", 2), ("", " Hello", 2), ("", " world", 1)]
    for i, (thought, text, thinking_tokens) in enumerate(pieces):
        ex.deliver(
            Reply(
                uid="u0",
                text=text,
                num_tokens=2,
                reasoning=thought,
                reasoning_tokens=thinking_tokens if thought or i == 2 else 0,
                finish_reason="stop" if i == len(pieces) - 1 else None,
            )
        )
    return ex


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


META = {"id": "chatcmpl-x", "created": 0, "model": "m"}


async def test_whole_and_streamed_answers_carry_the_same_thinking():
    ex = _exchange()
    ex.keep(await ex.next_batch())
    body = ChatAnswer(_body(), None).whole(ex, META)
    message = body["choices"][0]["message"]
    assert message["content"] == " Hello world"
    assert message["reasoning"] == message["reasoning_content"] == "the river"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    hidden = ChatAnswer(_body(include_reasoning=False), None).whole(ex, META)
    assert "reasoning" not in hidden["choices"][0]["message"]

    ex = _exchange()
    first = await ex.next_batch()
    chunks = [
        json.loads(raw.decode().removeprefix("data: "))
        async for raw in ChatAnswer(_body(stream=True), None).stream(ex, first, META)
        if raw != b"data: [DONE]\n\n"
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "the river"
    assert "".join(d.get("content") or "" for d in deltas) == " Hello world"


# ── agent frameworks with a thinking model ────────────────────────────────────────────────────
class Tally(BaseModel):
    n: int = Field(ge=0, le=9)  # bounded, so a random model's answer ends
    ok: bool


def _thinks_a_while(model: Path) -> dict[str, float]:
    """logit_bias for a thinking that ends after a few tokens (the prompt opened it)."""
    ids = _marker_ids(model)
    return {str(ids[START]): -100, str(ids[END]): 5}


def test_an_openai_agents_run_keeps_the_thinking_out_of_its_final_output(thinking_stack):
    """The agent reads the reply's thinking as a reasoning item of its own and parses its
    output type from the answer alone, on every seed."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        set_tracing_disabled,
    )
    from agents.items import ReasoningItem

    stack, model = thinking_stack
    set_tracing_disabled(True)

    async def run(seed: int):
        client = openai.AsyncOpenAI(base_url=f"{stack.api_url}/v1", api_key="x", max_retries=0)
        settings = ModelSettings(
            max_tokens=200,
            extra_body={"seed": seed, "logit_bias": _thinks_a_while(model), **THINKING_ONLY},
        )
        agent = Agent(
            name="counter",
            instructions="Count the rivers.",
            output_type=Tally,
            model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
            model_settings=settings,
        )
        try:
            return await Runner.run(agent, "How many rivers?", max_turns=1)
        finally:
            await client.close()

    thought = 0
    for seed in range(4):
        result = asyncio.run(run(seed))
        assert isinstance(result.final_output, Tally), seed
        thought += any(isinstance(item, ReasoningItem) for item in result.new_items)
    assert thought, "no run thought before answering"


def test_langchain_chat_openai_gets_a_clean_answer_and_the_thinking_via_responses(
    thinking_stack, markers
):
    """LangChain's ChatOpenAI reads only OpenAI's own fields: over chat completions it drops
    ``reasoning``/``reasoning_content`` by design (its docs send such providers to their own
    packages), so what it gets is the answer, clean of thinking. Over the Responses API
    (``use_responses_api``) the thinking is a reasoning output item, which it keeps as a
    ``reasoning`` content block."""
    from langchain_openai import ChatOpenAI

    stack, _ = thinking_stack
    common = {
        "base_url": f"{stack.api_url}/v1",
        "api_key": "unused",
        "model": MODEL,
        "max_retries": 0,
        "temperature": 0,
    }
    chat = ChatOpenAI(
        **common,
        max_tokens=12,
        logit_bias={int(k): v for k, v in markers.items()},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    answer = chat.invoke("Why is the river long?")
    assert answer.content and START not in answer.content and END not in answer.content
    assert "reasoning_content" not in answer.additional_kwargs  # dropped, as its docs say
    thinker = ChatOpenAI(
        **common,
        max_tokens=6,
        use_responses_api=True,
        reasoning={"effort": "low"},  # the template then opens the block
    )
    message = thinker.invoke("Why is the river long?")
    blocks = [b for b in message.content if isinstance(b, dict) and b.get("type") == "reasoning"]
    texts = [c.get("text", "") for b in blocks for c in b.get("content", [])]
    assert blocks and any(texts), message.content
    assert all(START not in t for t in texts)
