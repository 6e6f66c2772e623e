"""Request limits and validation, in-process: every refusal is a 4xx in OpenAI's error shape
naming the param, and comes before anything reaches admission (the stand-in ring client)."""

from __future__ import annotations

import asyncio
import json

import pytest
from api_testkit import ADMITTED, BAD_BODIES, OUT_OF_RANGE, SURROGATES, app_with, client_for

from tokenline.api.http.body_size import BodySizeLimit
from tokenline.settings import Settings

DEFAULTS = Settings()
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    app, ring_client = app_with()
    return client_for(app), ring_client


def _error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "pydantic" not in error["message"] and "detail" not in response.json()
    return error


def _post(client, path: str, body: dict):
    return client.post(path, json={"model": "tiny", **body})


# ── the configured limits ──────────────────────────────────────────────────────────────────────
LIMITED = [
    ("completions", {"prompt": "x", "n": DEFAULTS.max_n + 1}, "n", "--max-n"),
    ("completions", {"prompt": "x", "n": 100_000}, "n", "--max-n"),
    (
        "completions",
        {"prompt": "x", "max_tokens": DEFAULTS.max_tokens_limit + 1},
        "max_tokens",
        "--max-tokens-limit",
    ),
    (
        "chat/completions",
        {"messages": CHAT, "max_completion_tokens": DEFAULTS.max_tokens_limit + 1},
        "max_completion_tokens",
        "--max-tokens-limit",
    ),
    (
        "completions",
        {"prompt": "x", "stop": [f"s{i}" for i in range(DEFAULTS.max_stop_strings + 1)]},
        "stop",
        "--max-stop-strings",
    ),
    (
        "completions",
        {"prompt": "x", "stop": [f"s{i}" for i in range(10_000)]},
        "stop",
        "--max-stop-strings",
    ),
    (
        "completions",
        {"prompt": "x", "stop": "s" * (DEFAULTS.max_stop_string_length + 1)},
        "stop",
        "--max-stop-string-length",
    ),
    (
        "completions",
        {"prompt": "x", "stop_token_ids": [1] * (DEFAULTS.max_stop_token_ids + 1)},
        "stop_token_ids",
        "--max-stop-token-ids",
    ),
    (
        "chat/completions",
        {"messages": CHAT * (DEFAULTS.max_messages + 1)},
        "messages",
        "--max-messages",
    ),
    (
        "chat/completions",
        {"messages": CHAT * 100_000},
        "messages",
        "--max-messages",
    ),
    (
        "chat/completions",
        {
            "messages": [
                {"role": "user", "content": "a" * (DEFAULTS.max_prompt_chars // 2)},
                {"role": "user", "content": [{"type": "text", "text": "b" * 1000}]},
                {"role": "assistant", "content": "c" * (DEFAULTS.max_prompt_chars // 2)},
            ]
        },
        "messages",
        "--max-prompt-chars",
    ),
    (
        "completions",
        {"prompt": "p" * (DEFAULTS.max_prompt_chars + 1)},
        "prompt",
        "--max-prompt-chars",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "flag"), LIMITED)
def test_each_limit_is_a_400_naming_the_param_and_the_flag(served, path, body, param, flag):
    client, ring_client = served
    before = len(ring_client.opened)
    error = _error(_post(client, f"/v1/{path}", body))
    assert error["param"] == param
    assert error["code"] == "limit_exceeded"
    assert flag in error["message"]
    assert len(ring_client.opened) == before, "a refused request reached admission"


WITHIN = [
    ("completions", {"prompt": "x", "n": DEFAULTS.max_n}),
    ("completions", {"prompt": "x", "max_tokens": DEFAULTS.max_tokens_limit}),
    ("completions", {"prompt": "x", "stop": ["s"] * DEFAULTS.max_stop_strings}),
    ("completions", {"prompt": "x", "stop": "s" * DEFAULTS.max_stop_string_length}),
    ("completions", {"prompt": "x", "stop_token_ids": [1] * DEFAULTS.max_stop_token_ids}),
    ("completions", {"prompt": "p" * DEFAULTS.max_prompt_chars}),
    ("completions", {"prompt": "x", "logprobs": 5}),
    ("chat/completions", {"messages": CHAT * DEFAULTS.max_messages}),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "a" * DEFAULTS.max_prompt_chars}]},
    ),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 20}),
]


@pytest.mark.parametrize(("path", "body"), WITHIN)
def test_just_within_each_limit_is_admitted(served, path, body):
    client, _ = served
    assert _post(client, f"/v1/{path}", body).status_code == ADMITTED


def test_limits_follow_the_flags():
    app, _ = app_with(max_n=2, max_stop_strings=1, max_prompt_chars=10, max_logprobs=1)
    client = client_for(app)
    assert _error(_post(client, "/v1/completions", {"prompt": "x", "n": 3}))["param"] == "n"
    assert _post(client, "/v1/completions", {"prompt": "x", "n": 2}).status_code == ADMITTED
    stops = {"prompt": "x", "stop": ["a", "b"]}
    assert _error(_post(client, "/v1/completions", stops))["param"] == "stop"
    long = {"prompt": "x" * 11}
    assert _error(_post(client, "/v1/completions", long))["param"] == "prompt"
    logprobs = {"prompt": "x", "logprobs": 2}
    assert _error(_post(client, "/v1/completions", logprobs))["param"] == "logprobs"
    top = {"messages": CHAT, "logprobs": True, "top_logprobs": 2}
    assert _error(_post(client, "/v1/chat/completions", top))["param"] == "top_logprobs"


# ── hard bounds in the schemas: values the ring cannot carry ───────────────────────────────────
@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_integers_beyond_their_range_are_400_naming_the_param(served, field, value):
    client, ring_client = served
    before = len(ring_client.opened)
    body = json.dumps({"model": "tiny", "prompt": "x", field: value})  # 1e309 is Infinity
    response = client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert _error(response)["param"].split(".")[0] == field
    assert len(ring_client.opened) == before


def test_the_extremes_of_each_range_are_carried(served):
    client, ring_client = served
    body = {
        "prompt": "x",
        "seed": 2**63 - 1,
        "n": 2,
        "top_k": 2**31 - 1,
        "min_tokens": 2**31 - 1,
        "stop_token_ids": [0, 2**31 - 1],
    }
    assert _post(client, "/v1/completions", body).status_code == ADMITTED
    assert _post(client, "/v1/completions", {**body, "seed": -(2**63)}).status_code == ADMITTED
    sampling = [m.sampling for m in ring_client.opened[-2]]
    assert [s.seed for s in sampling] == [2**63 - 1, 2**63]  # seed + index, still uint64


@pytest.mark.parametrize(("path", "body", "param"), SURROGATES)
def test_a_lone_surrogate_in_any_string_is_400_naming_the_param(served, path, body, param):
    client, ring_client = served
    before = len(ring_client.opened)
    raw = json.dumps({"model": "tiny", **body})  # ensure_ascii: "\ud800" travels as an escape
    response = client.post(f"/v1/{path}", content=raw, headers={"content-type": "application/json"})
    error = _error(response)
    if param is None:
        assert error["param"].startswith("messages.0.")
    else:
        assert error["param"] == param
    assert len(ring_client.opened) == before


def test_a_lone_surrogate_in_the_model_name_is_refused_not_echoed_into_a_500(served):
    client, _ = served
    raw = json.dumps({"model": "\ud800", "prompt": "x"})
    response = client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert _error(response)["param"] == "model"


def test_a_surrogate_pair_is_one_valid_character(served):
    client, ring_client = served
    raw = json.dumps({"model": "tiny", "prompt": "smile \U0001f600"})
    response = client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == ADMITTED
    assert ring_client.opened[-1][0].prompt == "smile \U0001f600"


# ── bodies that are not what they claim ────────────────────────────────────────────────────────
@pytest.mark.parametrize(("raw", "content_type", "param"), BAD_BODIES)
def test_malformed_bodies_are_400_in_openai_shape(served, raw, content_type, param):
    client, ring_client = served
    before = len(ring_client.opened)
    headers = {"content-type": content_type} if content_type else {}
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    # a body declared as something else than JSON is 415, anything else malformed 400
    status = 415 if content_type and "json" not in content_type else 400
    error = _error(client.post(path, content=raw, headers=headers), status)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert "[" not in (error["param"] or ""), "a pydantic union tag leaked into param"
    assert len(ring_client.opened) == before


def test_duplicated_keys_take_the_last_value(served):
    client, ring_client = served
    raw = b'{"model": "tiny", "prompt": "first", "prompt": "second", "n": 1, "n": 99}'
    response = client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert _error(response)["param"] == "n"  # the n that counts is the last, 99
    raw = b'{"model": "tiny", "prompt": "first", "prompt": "second"}'
    response = client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == ADMITTED and ring_client.opened[-1][0].prompt == "second"


def test_unknown_routes_and_methods_answer_in_openai_shape(served):
    client, _ = served
    assert _error(client.get("/v1/nope"), 404)["code"] == "not_found"
    response = client.get("/v1/completions")
    assert _error(response, 405)["code"] == "method_not_allowed"
    assert "POST" in response.headers["allow"]


# ── the body size, at the ASGI level ───────────────────────────────────────────────────────────
async def _ok_app(scope, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _run(middleware, headers: list, chunks) -> tuple[int, int, dict]:
    """Drive ``middleware`` with a body of ``chunks``; (status, chunks pulled, error body)."""
    pulled = 0
    sent: list[dict] = []

    async def receive():
        nonlocal pulled
        pulled += 1
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(middleware(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], pulled, json.loads(body) if sent[0]["status"] != 200 else {}


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    limit = BodySizeLimit(_ok_app, max_bytes=1024)
    status, pulled, body = _run(limit, [(b"content-length", b"67108864")], iter([b"x" * 1024]))
    assert (status, pulled) == (413, 0)
    assert body["error"]["code"] == "request_too_large" and "--max-body-size" in str(body)


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit():
    limit = BodySizeLimit(_ok_app, max_bytes=64 * 1024)
    endless = iter(lambda: b"x" * 4096, None)  # a 64 MiB body, or more: it never ends
    status, pulled, _ = _run(limit, [(b"transfer-encoding", b"chunked")], endless)
    assert status == 413
    assert pulled == 64 * 1024 // 4096 + 1  # not one chunk more than needed to know


def test_a_body_within_the_limit_passes():
    limit = BodySizeLimit(_ok_app, max_bytes=8192)
    assert _run(limit, [(b"content-length", b"8192")], iter([b"x" * 8192]))[0] == 200
    assert _run(limit, [], iter([b"x" * 4096, b"y" * 4096]))[0] == 200


def test_a_bad_content_length_is_400():
    limit = BodySizeLimit(_ok_app, max_bytes=8192)
    assert _run(limit, [(b"content-length", b"-5")], iter([]))[0] == 400


def test_the_app_refuses_oversized_bodies_in_openai_shape():
    app, ring_client = app_with(max_body_size=4096)
    client = client_for(app)
    big = {"model": "tiny", "prompt": "x" * 5000}
    error = _error(client.post("/v1/completions", json=big), 413)
    assert error["code"] == "request_too_large"

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    response = client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert _error(response, 413)["code"] == "request_too_large"
    assert ring_client.opened == []
