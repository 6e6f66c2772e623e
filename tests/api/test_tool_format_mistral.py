"""The mistral tool-call format end to end: a stack serving a tiny variant whose chat template
follows it and whose tokenizer holds ``[TOOL_CALLS]`` as a special added token, as Mistral's
Hugging Face tokenizers do (tests/tool_format_testkit.py), driven through the official client.
Random weights decide nothing: tool_choice required or named makes the grammar write the call,
starting with the marker token; in auto a logit bias makes the model start one."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tool_format_testkit import (
    TOOLS,
    check_forced_calls,
    check_history_renders,
    check_responses_call,
    stack_for,
)

from tokenline.api.function_calling.list_streams import MISTRAL_TRIGGER
from tokenline.model_source import special_tokens

MODEL = "mistral"


@pytest.fixture(scope="module")
def stack(model_cache, launch_stack, tmp_path_factory):
    running = stack_for(MODEL, model_cache, launch_stack, tmp_path_factory)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key="x", max_retries=0)


def test_forced_calls_parse_into_valid_calls_on_every_seed(client):
    check_forced_calls(client, MODEL)


def test_a_call_sent_back_in_the_history_renders_and_the_turn_goes_on(client):
    check_history_renders(client, MODEL)


def test_the_responses_api_reads_the_same_format(client):
    check_responses_call(client, MODEL)


def test_call_ids_are_nine_letters_and_digits_as_mistral_templates_require(client):
    call = check_history_renders(client, MODEL)
    assert len(call["id"]) == 9 and call["id"].isalnum()


def test_auto_parses_a_call_the_model_starts_with_its_special_marker_token(stack, client):
    """The marker is one special token of the vocabulary; once the model emits it (a logit
    bias here, training in a real model), the grammar holds the call to a declared function
    and the reply, decoded with special tokens kept, parses into it, whole and streamed."""
    marker = special_tokens(str(stack.model_dir))[MISTRAL_TRIGGER]
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "logit_bias": {str(marker): 100},
        "max_tokens": 400,
        "seed": 5,
    }
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", reply
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    with client.chat.completions.stream(**request) as events:
        final = events.get_final_completion()
    assert [c.function.name for c in final.choices[0].message.tool_calls] == [call.function.name]
    assert not final.choices[0].message.content


def test_without_tools_the_marker_token_stays_out_of_the_text(stack, client):
    """A request without tools decodes as before: special tokens are skipped."""
    marker = special_tokens(str(stack.model_dir))[MISTRAL_TRIGGER]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        logit_bias={str(marker): 100},
        max_tokens=3,
    )
    assert MISTRAL_TRIGGER not in (reply.choices[0].message.content or "")
