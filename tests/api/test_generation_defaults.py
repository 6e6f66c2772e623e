"""The model's generation config as request defaults (``--generation-config``,
``--override-generation-config``), read alone, then through a stack with the official client."""

from __future__ import annotations

import json

import openai
import pytest

from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.openai.generation_defaults import request_defaults
from tokenline.settings import Settings

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2}


def _model(tmp_path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_reads_the_model_s_sampling_values_and_nothing_else(tmp_path):
    defaults = request_defaults(Settings(model=_model(tmp_path, QWEN3)))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert request_defaults(Settings(model="tiny")) == {}  # it names no sampling values


def test_vllm_ignores_the_file_a_directory_replaces_it_and_overrides_win(tmp_path):
    (tmp_path / "m").mkdir()
    model = _model(tmp_path / "m", QWEN3)
    assert request_defaults(Settings(model=model, generation_config="vllm")) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"min_p": 0.1}))
    assert request_defaults(Settings(model=model, generation_config=str(other))) == {"min_p": 0.1}
    overridden = Settings(model=model, override_generation_config='{"temperature": 0.2}')
    assert request_defaults(overridden)["temperature"] == 0.2


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("{not json", "is not JSON"),
        ('{"max_new_tokens": 5}', "max_new_tokens"),
        ('{"temperature": 9}', "must be in 0.0..2.0"),
    ],
)
def test_a_bad_override_stops_the_api_naming_the_flag(tmp_path, override, says):
    with pytest.raises(SystemExit, match=says):
        request_defaults(Settings(model="tiny", override_generation_config=override))


def test_a_field_the_request_sends_wins_over_the_default():
    defaults = {"temperature": 0.6, "top_k": 20}
    left_out = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    sent = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}
    )
    assert (left_out.sampling(0, defaults).temperature, left_out.sampling(0).temperature) == (
        0.6,
        1.0,
    )
    assert sent.sampling(0, defaults).temperature == 1.0  # sent, even at the API's default
    assert sent.sampling(0, defaults).top_k == 20


@pytest.fixture(scope="module")
def greedy_by_default(launch_stack):
    stack = launch_stack("--override-generation-config", '{"top_k": 1}')
    yield openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key="x", max_retries=0)
    stack.stop()


def test_a_served_default_applies_to_requests_that_leave_the_field_out(greedy_by_default):
    def text(seed: int, **fields) -> str:
        reply = greedy_by_default.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me about the river."}],
            max_tokens=16,
            seed=seed,
            extra_body={"ignore_eos": True, **fields},
        )
        return reply.choices[0].message.content

    # top_k 1 from the config: the seed changes nothing
    assert text(1) == text(2)
    # the request's own top_k (0: off) wins, and the seeds draw differently
    assert text(1, top_k=0) != text(2, top_k=0)


def test_the_defaults_in_force_are_shown_on_each_model_card():
    from api_testkit import app_with, client_for

    app, _ = app_with(
        generation_config="vllm",
        override_generation_config='{"temperature": 0.5, "top_p": 0.9}',
        served_model_name=["a", "b"],
    )
    cards = client_for(app).get("/v1/models").json()["data"]
    assert [c["sampling_defaults"] for c in cards] == [{"temperature": 0.5, "top_p": 0.9}] * 2
    app, _ = app_with(generation_config="vllm")
    assert client_for(app).get("/v1/models").json()["data"][0]["sampling_defaults"] == {}
