"""``--served-model-name a b c``, as vLLM takes it: every name routes to the model, /v1/models
lists one entry per name, and the first (the primary) is what metrics, events and LoRA checks
carry. The api alone, in-process (a stand-in ring client admits nothing)."""

from __future__ import annotations

import pytest
from api_testkit import ADMITTED, app_with, client_for

from tokenline import protocol
from tokenline.cli import build_parser, settings_from
from tokenline.serve import stage_argv

NAMES = ["qwen", "gpt-4o", "my-org/chat"]
LORA_ON = {"enable_lora": True, "allow_runtime_lora_updates": True}


def _settings(argv: list[str]):
    return settings_from(build_parser().parse_args(argv))


def test_several_names_after_one_flag_the_first_primary():
    settings = _settings(["serve", "/models/q", "--served-model-name", *NAMES])
    assert settings.model_names == NAMES and settings.model_name == "qwen"
    # serve hands every name to every stage, which reads them back the same
    for stage in ("api", "scheduler"):
        argv = stage_argv(stage, settings)
        assert _settings(argv[argv.index(stage) :]).model_names == NAMES
    # without the flag, the model's own name; the mirror is comma-separated
    assert _settings(["api", "--model", "/models/q"]).model_names == ["/models/q"]


def test_the_mirror_takes_several_names(monkeypatch):
    monkeypatch.setenv("TOKENLINE_SERVED_MODEL_NAME", "a,b")
    assert _settings(["scheduler"]).model_name == "a"
    assert _settings(["scheduler"]).model_names == ["a", "b"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/responses", {"input": "x"}),
    ],
)
def test_every_alias_routes_to_the_base_model(path, body):
    app, ring_client = app_with(model="/models/q", served_model_name=NAMES, enable_lora=True)
    client = client_for(app)
    for name in NAMES:
        response = client.post(path, json={"model": name, **body})
        assert response.status_code == ADMITTED, response.text
        assert [m.lora for m in ring_client.opened[-1]] == [""]
    response = client.post(path, json={"model": "/models/q", **body})  # the path is no name
    assert response.status_code == 404
    assert "serves `qwen`" in response.json()["error"]["message"]


def test_models_lists_one_entry_per_name_as_vllm_does():
    app, _ = app_with(model="/models/q", served_model_name=NAMES, enable_lora=True)
    # an adapter the scheduler reports under an alias is no adapter
    app.state.lora_names.on_status(
        protocol.StageStatus(stage="scheduler", instance="s", lora_adapters=["sql", "gpt-4o"])
    )
    client = client_for(app)
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("qwen", "/models/q", None),
        ("gpt-4o", "/models/q", None),
        ("my-org/chat", "/models/q", None),
        ("sql", "sql", "qwen"),  # an adapter's parent is the primary name
    ]
    card = client.get("/v1/models/gpt-4o").json()
    assert (card["id"], card["root"]) == ("gpt-4o", "/models/q")


def test_an_adapter_may_not_take_an_alias():
    app, _ = app_with(model="/models/q", served_model_name=NAMES, **LORA_ON)
    response = client_for(app).post(
        "/v1/load_lora_adapter", json={"lora_name": "gpt-4o", "lora_path": "/adapters/a"}
    )
    assert response.status_code == 400
    assert "base model's name" in response.json()["error"]["message"]


def test_answers_name_the_alias_asked_for():
    from tokenline.api.endpoints.base import Endpoint

    app, _ = app_with(model="/models/q", served_model_name=NAMES)

    class Request:
        pass

    request = Request()
    request.app = app
    for asked, named in (("gpt-4o", "gpt-4o"), (None, "qwen"), ("qwen", "qwen")):
        endpoint = Endpoint(request)
        endpoint.check_model(asked)
        assert endpoint.model_name == named
