"""Speculative decoding through the whole stack: a stack whose tiny model drafts for itself
(every guess right) answers the official openai client with the plain stack's tokens, whole
and streamed, with several tokens a chunk; vLLM's counters on the scheduler's port count the
guesses; a JSON-schema request stays valid; `tokenline bench` reports the accepted length."""

from __future__ import annotations

import json

import pytest
from conftest import STACK_FLAGS, start_stack
from openai import OpenAI

from tokenline.loadgen.cli import main as bench_main
from tokenline.model_source import resolve

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away", "request queue world"]
MAX_TOKENS = 32
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def speculating(model_cache, tmp_path_factory):
    draft = resolve("tiny", cache_dir=str(model_cache)).path  # the target itself
    config = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 4})
    logs = tmp_path_factory.mktemp("logs")
    running = start_stack(model_cache, logs, *STACK_FLAGS, "--speculative-config", config)
    yield running
    running.stop()


def client_of(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.api_url}/v1", api_key="unused", max_retries=0)


def test_the_output_is_the_plain_stacks_whole_and_streamed(stack, speculating):
    plain, fast = client_of(stack), client_of(speculating)
    accepted_before = speculating.metric("scheduler", "vllm:spec_decode_num_accepted_tokens_total")
    for prompt in PROMPTS:
        want = plain.completions.create(model="tiny", prompt=prompt, **GREEDY)
        got = fast.completions.create(model="tiny", prompt=prompt, **GREEDY)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == MAX_TOKENS
        chunks = fast.completions.create(
            model="tiny",
            prompt=prompt,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        texts, usage = [], None
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                texts.append(chunk.choices[0].text)
            usage = chunk.usage or usage
        assert "".join(texts) == want.choices[0].text
        assert usage.completion_tokens == MAX_TOKENS
        assert len(texts) < MAX_TOKENS / 2  # a step's verified guesses come in one chunk
    accepted = speculating.metric("scheduler", "vllm:spec_decode_num_accepted_tokens_total")
    drafted = speculating.metric("scheduler", "vllm:spec_decode_num_draft_tokens_total")
    assert accepted - accepted_before >= 2 * len(PROMPTS) * MAX_TOKENS * 0.7
    assert accepted <= drafted


def test_a_json_schema_request_stays_valid_beside_speculation(speculating):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client_of(speculating).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Who are you?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
        max_tokens=200,
        temperature=0,
    )
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_bench_reports_several_tokens_a_chunk(speculating, tmp_path):
    out = tmp_path / "result.json"
    code = bench_main(
        ["--url", speculating.api_url, "--no-progress", "--warmup", "0", "--json-out", str(out),
         "--num-requests", "4", "--concurrency", "2", "--output-len", "24", "--seed", "3",
         "--temperature", "0"]
    )  # fmt: skip
    assert code == 0
    summary = json.loads(out.read_text())["summaries"]["ours"]
    assert summary["failed"] == 0
    assert summary["tokens_per_chunk"]["count"] == 4
    assert summary["tokens_per_chunk"]["p50"] > 2  # four guesses a step, nearly all kept
