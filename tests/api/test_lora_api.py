"""LoRA on the api's side, in-process: which adapter a request's ``model`` names, /v1/models,
vLLM's load and unload endpoints over a ring whose scheduler is a stand-in, and the tokenizer
and detokenizer carrying the LoRA messages on.

The scheduler's side (loading weights, answering for real) is tested where it is built; here the
stand-in answers `protocol.LoraCall` the way the contract (protocol.py) says it will.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from api_testkit import ADMITTED, app_with, client_for
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from test_lora_e2e import COLON_LINT, promtool_problems

from tokenline import protocol
from tokenline.api.app import create_app
from tokenline.api.http.lora_metrics import LoraInfo
from tokenline.api.ring.client import RingClient
from tokenline.detokenizer.stage import DetokenizerStage
from tokenline.metrics import LATE_REPLIES
from tokenline.settings import Settings
from tokenline.tokenizer.stage import PromptEncoder, TokenizerStage

LORA_ON = {"enable_lora": True, "allow_runtime_lora_updates": True}
TO_API = protocol.Codec(protocol.ToApi)
TO_TOKENIZER = protocol.Codec(protocol.ToTokenizer)


def scheduler_status(*adapters: str, **fields) -> protocol.StageStatus:
    return protocol.StageStatus(
        stage="scheduler", instance="s1", lora_adapters=list(adapters), **fields
    )


# ── which adapter a request names (the api alone: a stand-in ring client admits nothing) ─────────
def stand_in(**settings):
    app, ring_client = app_with(**settings)
    return app, ring_client, client_for(app)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/responses", {"input": "x"}),
    ],
)
def test_model_names_the_base_or_a_reported_adapter_and_nothing_else(path, body):
    app, ring_client, client = stand_in(enable_lora=True)
    app.state.lora_names.on_status(scheduler_status("sql-lora", "chat-lora"))
    for model, lora in (("tiny", ""), ("sql-lora", "sql-lora"), ("chat-lora", "chat-lora")):
        response = client.post(path, json={"model": model, **body})
        assert response.status_code == ADMITTED, response.text
        assert [m.lora for m in ring_client.opened[-1]] == [lora]
    for unknown in ("other", "SQL-LORA", ""):
        response = client.post(path, json={"model": unknown, **body})
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert len(ring_client.opened) == 3


def test_every_choice_of_an_adapter_request_names_the_adapter():
    app, ring_client, client = stand_in(enable_lora=True)
    app.state.lora_names.on_status(scheduler_status("a"))
    response = client.post("/v1/completions", json={"model": "a", "prompt": ["x", "y"], "n": 2})
    assert response.status_code == ADMITTED
    assert [m.lora for m in ring_client.opened[-1]] == ["a"] * 4


def test_without_enable_lora_an_adapter_name_is_an_unknown_model():
    app, _pipeline, client = stand_in()  # the scheduler reports one anyway
    app.state.lora_names.on_status(scheduler_status("a"))
    response = client.post("/v1/completions", json={"model": "a", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["tiny"]


def test_an_adapter_unloaded_is_unknown_again_at_the_next_status():
    app, _pipeline, client = stand_in(enable_lora=True)
    app.state.lora_names.on_status(scheduler_status("a"))
    assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 299
    app.state.lora_names.on_status(scheduler_status())
    assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 404
    app.state.lora_names.on_status(None)  # a heartbeat without the scheduler: nothing changes
    assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 404


def test_models_lists_the_base_then_each_adapter_as_vllm_does():
    app, _pipeline, client = stand_in(enable_lora=True, model="tiny", served_model_name=["base"])
    app.state.lora_names.on_status(scheduler_status("a", "b", "base"))  # the base is not an adapter
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("base", "tiny", None),
        ("a", "a", "base"),  # started with the scheduler: no path known here
        ("b", "b", "base"),
    ]
    assert all(c["object"] == "model" and c["owned_by"] == "tokenline" for c in cards)
    card = client.get("/v1/models/b").json()
    assert (card["id"], card["parent"]) == ("b", "base")
    assert client.get("/v1/models/c").status_code == 404


# ── the load and unload routes: served only when allowed ───────────────────────────────────────
LOAD = {"lora_name": "a", "lora_path": "/adapters/a"}


@pytest.mark.parametrize(
    ("settings", "env", "served"),
    [
        ({"enable_lora": True}, None, False),
        ({"enable_lora": True}, "0", False),
        ({"enable_lora": True}, "true", True),
        ({"enable_lora": True}, "1", True),
        ({"enable_lora": True}, " True ", True),
        (LORA_ON, None, True),
    ],
)
def test_the_routes_exist_only_when_runtime_updates_are_allowed(monkeypatch, settings, env, served):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    if env is not None:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)
    _app, _pipeline, client = stand_in(**settings)
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = client.post(path, json=LOAD)
        if served:
            assert response.status_code != 404, response.text
        else:  # as any route this server does not have
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "not_found"
    paths = set(client.get("/openapi.json").json()["paths"])
    assert ("/v1/load_lora_adapter" in paths) == served


def test_allowed_without_enable_lora_says_which_flag_is_missing(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    _app, _pipeline, client = stand_in(allow_runtime_lora_updates=True)
    response = client.post("/v1/load_lora_adapter", json=LOAD)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "lora_disabled"
    assert "--enable-lora" in response.json()["error"]["message"]


def test_the_routes_are_behind_the_api_key():
    _app, _pipeline, client = stand_in(**LORA_ON, api_keys=["sk-lora"])
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert client.post(path, json=LOAD).status_code == 401
    ok = client.post(
        "/v1/unload_lora_adapter",
        json={"lora_name": "a"},
        headers={"Authorization": "Bearer sk-lora"},
    )
    assert ok.status_code == 404  # past the key: the adapter is not there


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("load", {"lora_name": "", "lora_path": "/p"}, 400, None, "Both 'lora_name'"),
        ("load", {"lora_name": "a", "lora_path": ""}, 400, None, "Both 'lora_name'"),
        ("load", {"lora_name": "a"}, 400, "lora_path", "lora_path"),
        ("load", {"lora_name": "a,b", "lora_path": "/p"}, 400, "lora_name", "commas"),
        ("load", {"lora_name": "tiny", "lora_path": "/p"}, 400, "lora_name", "base model"),
        ("load", {**LOAD, "load_inplace": True}, 400, "load_inplace", "not supported"),
        ("unload", {"lora_name": ""}, 400, None, "either 'lora_name'"),
        ("unload", {"lora_name": "nope"}, 404, "lora_name", "'nope' cannot be found"),
        ("unload", {"lora_name": "", "lora_int_id": 3}, 404, "lora_name", "cannot be found"),
    ],
)
def test_refusals_the_api_gives_alone_in_vllms_words(path, body, status, param, message):
    _app, _pipeline, client = stand_in(**LORA_ON)
    response = client.post(f"/v1/{path}_lora_adapter", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]


# ── load and unload around a ring whose scheduler is a stand-in ────────────────────────────────
class StandInScheduler:
    """The api's outbox, answered as the scheduler will answer: a load adds the adapter, an
    unload removes it, a path under /missing fails as vLLM's "No adapter found" does, and a
    path under /slow is never answered (a scheduler that hangs)."""

    def __init__(self) -> None:
        self.ring_client: RingClient | None = None
        self.lora_names: list[str] = []
        self.calls: list[protocol.LoraCall] = []
        self.unanswered: list[protocol.LoraCall] = []

    def encode(self, message: msgspec.Struct) -> bytes:
        return msgspec.msgpack.encode(message)

    def send_nowait(self, message: msgspec.Struct) -> None:
        self.send_frame(self.encode(message))

    def send_frame(self, frame: bytes) -> None:
        message = TO_TOKENIZER.decode(frame)  # what the tokenizer would read off the wire
        loop = asyncio.get_running_loop()
        if isinstance(message, protocol.TokenizeCall):  # the tokenizer's part, for /tokenize
            answer = protocol.TokenizerAnswer(uid=message.uid, ids=[7, 8], max_model_len=64)
            loop.call_soon(self.ring_client.route, answer)
        if not isinstance(message, protocol.LoraCall):
            return
        self.calls.append(message)
        if message.uri.startswith("/slow"):
            self.unanswered.append(message)
            return
        answer = self.answer(message)
        # later, as a reply from the ring comes: never inside the send
        loop.call_soon(self.ring_client.route, TO_API.decode(self.encode(answer)))

    def answer(self, call: protocol.LoraCall) -> msgspec.Struct:
        if call.uri.startswith("/missing"):
            return protocol.Failed(
                uid=call.uid,
                code="lora_not_found",
                message=f"No adapter found for {call.uri}",
                http_status=404,
                stage="scheduler",
            )
        if call.action == "load":
            self.lora_names.append(call.name)
        else:
            self.lora_names.remove(call.name)
        return protocol.LoraAnswer(uid=call.uid, adapters=list(self.lora_names))

    def close(self) -> None:
        pass


def ring_app(monkeypatch, **settings) -> tuple[FastAPI, RingClient, StandInScheduler]:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    app = create_app(Settings(**LORA_ON, **settings))
    scheduler = StandInScheduler()
    ring_client = RingClient(app.state.settings, scheduler, lora_names=app.state.lora_names)
    monkeypatch.setattr(ring_client.health, "problem", lambda now: None)  # the ring answers
    scheduler.ring_client = ring_client
    app.state.ring_client = ring_client  # the lifespan, which would start a real ring, never runs
    return app, ring_client, scheduler


def nothing_held(ring_client: RingClient) -> bool:
    return (
        len(ring_client.calls) == 0 and len(ring_client.ledger) == 0 and not ring_client.exchanges
    )


def model_ids(client: TestClient) -> list[str]:
    return [c["id"] for c in client.get("/v1/models").json()["data"]]


def test_load_then_unload_through_the_ring(monkeypatch):
    app, ring_client, scheduler = ring_app(monkeypatch)
    client = client_for(app)
    response = client.post("/v1/load_lora_adapter", json=LOAD)
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'a' added successfully."
    assert response.headers["content-type"].startswith("text/plain")
    call = scheduler.calls[-1]
    assert (call.action, call.name, call.uri) == ("load", "a", "/adapters/a")
    # requestable at once, before any heartbeat, and listed with where it came from
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("tiny", "tiny", None),
        ("a", "/adapters/a", "tiny"),
    ]
    assert "a" in app.state.lora_names
    again = client.post("/v1/load_lora_adapter", json=LOAD)
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'a' has already been loaded."
    assert len(scheduler.calls) == 1  # refused without a trip around the ring

    response = client.post("/v1/unload_lora_adapter", json={"lora_name": "a", "lora_int_id": 1})
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'a' removed successfully."
    assert (scheduler.calls[-1].action, scheduler.calls[-1].name) == ("unload", "a")
    assert model_ids(client) == ["tiny"]
    assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 404
    assert nothing_held(ring_client)


def test_a_load_the_scheduler_fails_is_its_error_and_changes_nothing(monkeypatch):
    app, ring_client, _scheduler = ring_app(monkeypatch)
    client = client_for(app)
    response = client.post(
        "/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": "/missing/m"}
    )
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "lora_not_found"
    assert "No adapter found" in error["message"]
    assert model_ids(client) == ["tiny"]
    assert nothing_held(ring_client)


def test_a_load_never_answered_times_out_and_leaves_nothing(monkeypatch):
    app, ring_client, scheduler = ring_app(monkeypatch, request_timeout=0.3)
    client = client_for(app)
    late = LATE_REPLIES.labels(stage="api")
    before = late._value.get()
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "s", "lora_path": "/slow/s"})
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "request_timeout"
    assert "the load of the lora adapter 's' was not answered" in error["message"]
    assert nothing_held(ring_client)
    # The answer that comes after all is no late reply, and its adapters count from then on.
    (call,) = scheduler.unanswered
    ring_client.route(protocol.LoraAnswer(uid=call.uid, adapters=["s"]))
    assert late._value.get() == before
    assert "s" in app.state.lora_names
    assert nothing_held(ring_client)


def test_a_load_refused_while_the_ring_is_down_sends_nothing(monkeypatch):
    app, ring_client, scheduler = ring_app(monkeypatch)
    monkeypatch.setattr(ring_client.health, "problem", lambda now: "scheduler disconnected")
    response = client_for(app).post("/v1/load_lora_adapter", json=LOAD)
    assert response.status_code == 503
    assert scheduler.calls == [] and nothing_held(ring_client)


def test_heartbeats_keep_the_adapters_current(monkeypatch):
    app, ring_client, _scheduler = ring_app(monkeypatch)
    client = client_for(app)

    def heartbeat(status: protocol.StageStatus) -> None:
        ring_client.route(protocol.Heartbeat(seq=0, origin=ring_client._origin, statuses=[status]))

    heartbeat(scheduler_status("x", "y"))
    assert model_ids(client) == ["tiny", "x", "y"]
    ring_client.route(protocol.Heartbeat(seq=1, origin="another-replica", statuses=[]))
    heartbeat(scheduler_status("y"))
    assert model_ids(client) == ["tiny", "y"]


def test_a_second_change_of_an_adapter_on_its_way_is_refused(monkeypatch):
    app, ring_client, scheduler = ring_app(monkeypatch)
    client = client_for(app)
    with app.state.lora_names.changing("a"):  # a load of "a" still travelling
        response = client.post("/v1/load_lora_adapter", json=LOAD)
        assert response.status_code == 400
        assert "in progress" in response.json()["error"]["message"]
    assert scheduler.calls == [] and nothing_held(ring_client)
    assert client.post("/v1/load_lora_adapter", json=LOAD).status_code == 200
    with app.state.lora_names.changing("a"):
        response = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert response.status_code == 400
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200


def test_models_shows_no_secret_of_the_uri_an_adapter_came_from(monkeypatch):
    app, _, scheduler = ring_app(monkeypatch)
    client = client_for(app)
    uri = "https://user:hunter2@bucket.example/adapters/a?X-Amz-Signature=abc&X-Amz-Credential=k"
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": uri})
    assert response.status_code == 200
    assert scheduler.calls[-1].uri == uri  # the scheduler needs all of it
    (card,) = [c for c in client.get("/v1/models").json()["data"] if c["id"] == "a"]
    assert card["root"] == "https://bucket.example/adapters/a"


def test_tokenize_takes_an_adapter_name_as_model(monkeypatch):
    app, ring_client, _ = ring_app(monkeypatch)
    client = client_for(app)
    assert client.post("/tokenize", json={"model": "a", "prompt": "x"}).status_code == 404
    assert client.post("/v1/load_lora_adapter", json=LOAD).status_code == 200
    response = client.post("/tokenize", json={"model": "a", "prompt": "x"})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == [7, 8]
    assert nothing_held(ring_client)


# ── the tokenizer and the detokenizer carry LoRA on ────────────────────────────────────────────
def test_the_tokenizer_carries_the_adapter_and_passes_lora_calls_on(tiny_tokenizer):
    stage = TokenizerStage(PromptEncoder(tiny_tokenizer, 1024))
    sampling = protocol.SamplingParams(max_tokens=4)
    call = protocol.LoraCall(uid="c", action="load", name="a", uri="s3://bucket/a")
    out = stage.handle_batch(
        [
            (
                time.monotonic(),
                protocol.Generate(uid="g", sampling=sampling, timeout_s=9, prompt="x"),
            ),
            (time.monotonic(), call),
            (
                time.monotonic(),
                protocol.Generate(uid="h", sampling=sampling, timeout_s=9, prompt="y", lora="a"),
            ),
        ]
    )
    assert [type(m).__name__ for m in out] == ["Tokenized", "LoraCall", "Tokenized"]
    assert (out[0].lora, out[2].lora) == ("", "a")
    assert out[1] == call
    # and the message the scheduler reads carries it
    wire = protocol.Codec(protocol.ToScheduler).decode(msgspec.msgpack.encode(out[2]))
    assert wire.lora == "a"


def test_the_detokenizer_passes_lora_answers_on(tiny_tokenizer):
    stage = DetokenizerStage(tiny_tokenizer.backend_tokenizer)
    answer = protocol.LoraAnswer(uid="c", adapters=["a", "b"])
    assert stage.handle(answer, time.monotonic()) == [answer]
    assert stage.held() == []


# ── vllm:lora_requests_info ────────────────────────────────────────────────────────────────────
def lora_info_samples() -> list[tuple[dict, float]]:
    return [
        (s.labels, s.value)
        for family in REGISTRY.collect()
        if family.name == "vllm:lora_requests_info"
        for s in family.samples
    ]


def test_lora_requests_info_is_vllms_gauge_with_only_the_current_labels():
    now = [1_700_000_000.0]
    info = LoraInfo(clock=lambda: now[0])
    info.update(scheduler_status("a", "b", max_loras=4, lora_running=["a", "b"], lora_waiting=[]))
    assert lora_info_samples() == [
        (
            {"max_lora": "4", "running_lora_adapters": "a,b", "waiting_lora_adapters": ""},
            1_700_000_000.0,
        )
    ]
    now[0] += 0.5
    info.update(scheduler_status(max_loras=4, lora_running=["a", "b"]))  # same labels: newer time
    assert [v for _, v in lora_info_samples()] == [1_700_000_000.5]
    info.update(scheduler_status(max_loras=4, lora_running=["b"], lora_waiting=["c", "a"]))
    assert [labels for labels, _ in lora_info_samples()] == [
        {"max_lora": "4", "running_lora_adapters": "b", "waiting_lora_adapters": "c,a"}
    ]
    info.update(None)  # a heartbeat without the scheduler: the last state stays
    assert len(lora_info_samples()) == 1
    info.update(scheduler_status())  # a scheduler without LoRA: no series at all
    assert lora_info_samples() == []


def test_the_api_port_shows_the_schedulers_lora_state_from_heartbeats(monkeypatch):
    app, ring_client, _ = ring_app(monkeypatch)
    status = scheduler_status("a", max_loras=2, lora_running=["a"], lora_waiting=["b"])
    before = time.time()
    ring_client.route(protocol.Heartbeat(seq=0, origin=ring_client._origin, statuses=[status]))
    text = client_for(app).get("/metrics").text
    (line,) = [x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{")]
    labels = 'max_lora="2",running_lora_adapters="a",waiting_lora_adapters="b"'
    assert line.startswith("vllm:lora_requests_info{" + labels + "} ")
    assert before <= float(line.rsplit(" ", 1)[1]) <= time.time()
    assert promtool_problems(text) == [COLON_LINT]  # vLLM's name: the one lint it must break
    ring_client.route(
        protocol.Heartbeat(seq=1, origin=ring_client._origin, statuses=[scheduler_status()])
    )
    assert "vllm:lora_requests_info{" not in client_for(app).get("/metrics").text


def test_a_load_naming_its_own_s3_endpoint_is_refused_before_the_ring(monkeypatch):
    """The scheduler signs S3 requests with the server's credentials: an endpoint a caller
    names would receive them. A public bucket (anonymous) sends none."""
    app, ring_client, scheduler = ring_app(monkeypatch)
    client = client_for(app)
    elsewhere = "s3://adapters/a?endpoint=http://attacker.example:9000"
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": elsewhere})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and "AWS_ENDPOINT_URL" in error["message"]
    assert not scheduler.calls and nothing_held(ring_client)
    public = "s3://adapters/a?endpoint=http://minio.example:9000&anonymous=true"
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": public})
    assert response.status_code == 200, response.text
    assert scheduler.calls[-1].uri == public
