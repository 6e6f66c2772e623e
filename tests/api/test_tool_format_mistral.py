"""The mistral tool-call format end to end: a stack serving a tiny variant whose chat template
follows it (tests/tool_format_testkit.py), driven through the official client. Random weights
decide nothing: tool_choice required or named makes the grammar write the call."""

from __future__ import annotations

import openai
import pytest
from tool_format_testkit import (
    check_forced_calls,
    check_history_renders,
    check_responses_call,
    stack_for,
)

MODEL = "mistral"


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


def test_call_ids_are_nine_letters_and_digits_as_mistral_templates_require(client):
    call = check_history_renders(client, MODEL)
    assert len(call["id"]) == 9 and call["id"].isalnum()
