"""The deepseek_v3 tool-call format end to end: a stack serving a tiny variant whose chat template
follows it (tests/tool_format_testkit.py), driven through the official client. Random weights
decide nothing: tool_choice required or named makes the grammar write the call. The markers are
added tokens of the variant's vocabulary that decode to text, as in DeepSeek-V3's tokenizer."""

from __future__ import annotations

import openai
import pytest
from tool_format_testkit import (
    TOOLS,
    check_forced_calls,
    check_history_renders,
    check_responses_call,
    stack_for,
)

from tokenline.api.function_calling.marked_streams import (
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_SEP,
)

MODEL = "deepseek_v3"


@pytest.fixture(scope="module")
def client(model_cache, launch_stack, tmp_path_factory):
    stack = stack_for(MODEL, model_cache, launch_stack, tmp_path_factory)
    yield openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key="x", max_retries=0)
    stack.stop()


def test_forced_calls_parse_into_valid_calls_on_every_seed(client):
    check_forced_calls(client, MODEL)


def test_a_call_sent_back_in_the_history_renders_and_the_turn_goes_on(client):
    check_history_renders(client, MODEL)


def test_the_responses_api_reads_the_same_format(client):
    check_responses_call(client, MODEL)


def test_the_grammar_writes_each_marker_as_the_vocabulary_s_own_token(client):
    """The scheduler's grammar reads the added markers as text, and the text it forces is
    tokenized as the model's tokenizer does: each marker one token, as DeepSeek-V3 writes it."""
    for seed in range(2):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Time?"}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            logprobs=True,
            seed=seed,
            max_tokens=400,
        )
        tokens = [t.token for t in reply.choices[0].logprobs.content]
        markers = [DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END]
        assert [t for t in tokens if t in [*markers, DEEPSEEK_CALLS_END]] == [
            *markers,
            DEEPSEEK_CALLS_END,
        ], tokens
        assert len(reply.choices[0].message.tool_calls) == 1
