"""Every error the api answers has OpenAI's body, ``{"error": {"message", "type", "param",
"code"}}``, including those the framework makes (no route, wrong method, oversized or
unparsable bodies, failed validation), refused CORS preflights and WebSocket handshakes: on a
real `tokenline api` process (no stage is needed to refuse a request), read off the socket."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from api_testkit import api_process

ORIGIN = "https://app.example.com"
LIMIT = 4096
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("error-shapes")
    with api_process(workdir, "--allowed-origin", ORIGIN, "--max-body-size", str(LIMIT)) as running:
        yield running


def _assert_openai_error(status: int, headers, body: bytes, expected: int) -> dict:
    assert status == expected, body[:300]
    assert headers["content-type"] == "application/json", headers
    error = json.loads(body)["error"]
    assert set(json.loads(body)) == {"error"}
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and error["type"] and error["code"]
    return error


def _oversized_chunks():
    for _ in range(8):
        yield b"x" * 1024


CASES = [
    # unknown routes
    ("GET", "/nope", {}, 404),
    ("POST", "/v1/nope", {"json": {}}, 404),
    ("GET", "/v1/models/other-model", {}, 404),  # an invalid path parameter
    ("GET", "/v1/models/%ff%fe", {}, 404),
    # wrong methods
    ("POST", "/v1/models", {}, 405),
    ("PUT", "/health", {}, 405),
    ("DELETE", "/v1/chat/completions", {}, 405),
    ("GET", "/v1/completions", {}, 405),
    ("PATCH", "/tokenize", {}, 405),
    ("OPTIONS", "/v1/responses", {}, 405),  # not a preflight: no Origin
    # bodies
    ("POST", "/v1/completions", {"content": b"x" * (LIMIT + 1), "headers": JSON}, 413),
    ("POST", "/v1/completions", {"content": _oversized_chunks, "headers": JSON}, 413),
    ("POST", "/v1/completions", {"content": b'{"model": ', "headers": JSON}, 400),
    ("POST", "/v1/chat/completions", {"content": b"[1, 2]", "headers": JSON}, 400),
    ("POST", "/v1/completions", {"content": b"\xff\xfe{}", "headers": JSON}, 400),
    ("POST", "/v1/completions", {"content": b"[" * 3000, "headers": JSON}, 400),
    ("POST", "/v1/completions", {"content": b"", "headers": JSON}, 400),
    ("POST", "/v1/completions", {"content": b"{}", "headers": {"content-type": "text/x"}}, 415),
    ("POST", "/tokenize", {"content": b"a=b", "headers": {"content-type": "multipart/x"}}, 415),
    # what FastAPI answers 422 to
    ("POST", "/v1/completions", {"json": {"model": "tiny", "prompt": {"a": 1}}}, 400),
    ("POST", "/v1/chat/completions", {"json": {"model": "tiny", "messages": "hi"}}, 400),
    ("POST", "/v1/responses", {"json": {"model": "tiny", "input": 3}}, 400),
    ("POST", "/detokenize", {"json": {"tokens": "abc"}}, 400),
    ("POST", "/v1/completions", {"json": {"model": "tiny", "prompt": "x", "unknown": 1}}, 400),
]


@pytest.mark.parametrize(("method", "path", "kw", "status"), CASES)
def test_framework_errors_have_openai_bodies(api, method, path, kw, status):
    kw = {k: v() if callable(v) else v for k, v in kw.items()}
    response = httpx.request(method, f"{api.url}{path}", timeout=30, **kw)
    _assert_openai_error(response.status_code, response.headers, response.content, status)


@pytest.mark.parametrize(
    ("preflight", "refused"),
    [
        (
            {"origin": "https://elsewhere.example", "access-control-request-method": "POST"},
            "origin",
        ),
        ({"origin": ORIGIN, "access-control-request-method": "PUT"}, "method"),
        (
            {
                "origin": ORIGIN,
                "access-control-request-method": "POST",
                "access-control-request-private-network": "true",
            },
            "private-network",
        ),
    ],
    ids=["origin", "method", "private-network"],
)
def test_a_refused_cors_preflight_has_an_openai_body_and_its_cors_headers(api, preflight, refused):
    response = httpx.options(f"{api.url}/v1/chat/completions", headers=preflight, timeout=30)
    error = _assert_openai_error(response.status_code, response.headers, response.content, 400)
    assert error["code"] == "cors_refused"
    assert f"preflight's {refused}" in error["message"]
    assert "Origin" in response.headers["vary"]  # caches must not reuse it for other origins
    allowed = httpx.options(
        f"{api.url}/v1/chat/completions",
        headers={"origin": ORIGIN, "access-control-request-method": "POST"},
        timeout=30,
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN


def test_a_websocket_handshake_is_refused_with_an_openai_body(api):
    port = int(api.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n"
        )
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    _assert_openai_error(status, headers, body, 404)
