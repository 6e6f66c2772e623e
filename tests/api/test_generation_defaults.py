"""The model's generation config as request defaults (``--generation-config``,
``--override-generation-config``), read alone, then through a stack with the official client."""

from __future__ import annotations

import json

import openai
import pytest

from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.openai.generation_defaults import GenerationDefaults, request_defaults
from tokenline.settings import Settings

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2}


def _model(tmp_path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_reads_the_model_s_sampling_values_and_nothing_else(tmp_path):
    defaults = request_defaults(Settings(model=_model(tmp_path, QWEN3)))
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert request_defaults(Settings(model="tiny")).values == {}  # it names no sampling values


def test_vllm_ignores_the_file_a_directory_replaces_it_and_overrides_win(tmp_path):
    (tmp_path / "m").mkdir()
    model = _model(tmp_path / "m", QWEN3)
    assert request_defaults(Settings(model=model, generation_config="vllm")).values == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"min_p": 0.1}))
    from_other = request_defaults(Settings(model=model, generation_config=str(other)))
    assert from_other.values == {"min_p": 0.1}
    overridden = Settings(model=model, override_generation_config='{"temperature": 0.2}')
    assert request_defaults(overridden).values["temperature"] == 0.2
    unset = Settings(model=model, override_generation_config='{"top_k": null}')
    assert "top_k" not in request_defaults(unset).values


def test_max_new_tokens_is_a_default_and_a_cap_where_vllm_makes_it_one(tmp_path):
    """vLLM 0.32: the model's own max_new_tokens (auto) is the max_tokens of a request that
    sends none; a directory's, or the override's, also caps every request."""
    (tmp_path / "m").mkdir()
    model = _model(tmp_path / "m", {**QWEN3, "max_new_tokens": 64, "presence_penalty": 1.5})
    auto = request_defaults(Settings(model=model))
    assert auto.values["max_tokens"] == 64 and auto.values["presence_penalty"] == 1.5
    assert (auto.max_tokens(None), auto.max_tokens(100), auto.max_tokens_cap) == (64, 100, None)
    directory = request_defaults(Settings(model="tiny", generation_config=str(tmp_path / "m")))
    assert (directory.max_tokens(None), directory.max_tokens(100), directory.max_tokens(8)) == (
        64,
        64,
        8,
    )
    capped = request_defaults(
        Settings(model=model, override_generation_config='{"max_new_tokens": 32}')
    )
    assert (capped.max_tokens(None), capped.max_tokens(100), capped.max_tokens_cap) == (32, 32, 32)
    lifted = request_defaults(
        Settings(model=model, override_generation_config='{"max_new_tokens": null}')
    )
    assert lifted.max_tokens(None) is None and lifted.max_tokens_cap is None
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    )
    sampling = request.sampling(0, capped)
    assert (sampling.max_tokens, sampling.presence_penalty) == (32, 1.5)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("{not json", "is not JSON"),
        ('{"seed": 5}', "sets \\['seed'\\]"),
        ('{"max_new_tokens": 0}', "must be in 1..2147483647"),
        ('{"max_new_tokens": 2.5}', "max_new_tokens is 2.5"),
        ("[1]", "takes a JSON object"),
        ('{"temperature": 9}', "must be in 0.0..2.0"),
    ],
)
def test_a_bad_override_stops_the_api_naming_the_flag(tmp_path, override, says):
    with pytest.raises(SystemExit, match=says):
        request_defaults(Settings(model="tiny", override_generation_config=override))


def test_a_field_the_request_sends_wins_over_the_default():
    defaults = GenerationDefaults({"temperature": 0.6, "top_k": 20})
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
    null = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": None}
    )
    assert null.sampling(0, defaults).temperature == 0.6  # null: as if left out (vLLM)


@pytest.fixture(scope="module")
def greedy_by_default(launch_stack):
    stack = launch_stack("--override-generation-config", '{"top_k": 1, "max_new_tokens": 12}')
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


def test_the_override_s_max_new_tokens_caps_every_reply(greedy_by_default):
    def length(**fields) -> tuple[int, str]:
        stream = greedy_by_default.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me about the river."}],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **fields,
        )
        chunks = list(stream)
        ends = [c.choices[0].finish_reason for c in chunks if c.choices]
        return chunks[-1].usage.completion_tokens, ends[-1]

    assert length() == (12, "length")  # sent none: the config's
    assert length(max_tokens=100) == (12, "length")  # capped
    assert length(max_completion_tokens=5) == (5, "length")  # below the cap: the request's


def test_the_defaults_in_force_are_shown_on_each_model_card():
    from api_testkit import app_with, client_for

    app, _ = app_with(
        generation_config="vllm",
        override_generation_config='{"temperature": 0.5, "top_p": 0.9}',
        served_model_name=["a", "b"],
    )
    cards = client_for(app).get("/v1/models").json()["data"]
    assert [c["sampling_defaults"] for c in cards] == [{"temperature": 0.5, "top_p": 0.9}] * 2
    app, _ = app_with(generation_config="vllm", override_generation_config='{"max_new_tokens": 9}')
    assert client_for(app).get("/v1/models").json()["data"][0]["sampling_defaults"] == {
        "max_tokens": 9
    }
    app, _ = app_with(generation_config="vllm")
    assert client_for(app).get("/v1/models").json()["data"][0]["sampling_defaults"] == {}
