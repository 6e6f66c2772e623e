"""Fuzzing the running stack: schemathesis from the api's own /openapi.json, then hand-written
bad inputs. No answer is a 5xx, no stage restarts, no uid is left live, and the stack still
serves. Bounded: a few dozen examples per operation, loopback only."""

from __future__ import annotations

import json
import random
import socket
import time
from collections import Counter

import httpx
import schemathesis
from api_testkit import BAD_BODIES, OUT_OF_RANGE, SURROGATES
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

STAGES = ("tokenizer", "scheduler", "detokenizer")
EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 40}


def _stage_pids(stack) -> dict[str, int]:
    return {stage: stack.pid_of(stage) for stage in STAGES}


def _assert_nothing_held(stack, timeout: float = 30) -> None:
    """The api holds no uid once every answer is in (aborted streams settle within moments)."""
    deadline = time.monotonic() + timeout
    while (live := stack.metric("api", "tokenline_live_uids", stage="api")) != 0:
        assert time.monotonic() < deadline, f"{live} uid(s) still live in the api"
        time.sleep(0.2)
    assert stack.metric("api", "tokenline_leaked_uids", stage="api") == 0


def _assert_still_serving(stack, pids: dict[str, int]) -> None:
    assert _stage_pids(stack) == pids, "a stage restarted"
    assert stack.ready()
    body = {"model": stack.model, "prompt": "still serving", "max_tokens": 3, "ignore_eos": True}
    reply = httpx.post(f"{stack.api_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3


def _assert_answer(response: httpx.Response | object, path: str) -> None:
    status = response.status_code
    assert status < 500, f"{path}: {status} {response.text[:500]}"
    if status >= 400:  # the probes' too: a 405 on /health is an error like any other
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text[:500]


def _cheap(case, model: str, rng: random.Random) -> None:
    """Keep a valid-looking body fast on a CPU: name the served model (or nothing reaches the
    ring), a few tokens and choices at most."""
    body = case.body
    if not isinstance(body, dict):
        return
    if rng.random() < 0.8:
        body["model"] = model
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if (value is None and key == "max_tokens") or (
            isinstance(value, int) and 4 < value < 10**6
        ):
            body[key] = rng.randint(1, 4)
    if isinstance(body.get("n"), int) and 4 < body["n"] <= 16:
        body["n"] = 4
    # Checks across fields, which a schema cannot say: without these most bodies stop at 400.
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    if "best_of" in body and rng.random() < 0.8:
        body["best_of"] = body.get("n", 1)
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict) or rng.random() < 0.2:
            continue
        if message.get("role") == "tool":
            message.setdefault("tool_call_id", "call_0")
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                call["function"]["arguments"] = "{}"
    if isinstance(body.get("prompt"), list) and rng.random() < 0.8:
        body["prompt"] = "".join(p for p in body["prompt"] if isinstance(p, str)) or "x"


def test_schemathesis_finds_no_server_error(stack):
    pids = _stage_pids(stack)
    schema = schemathesis.openapi.from_url(f"{stack.api_url}/openapi.json", timeout=10)
    rng = random.Random(19)
    calls = 0
    generated = Counter()  # (path, status) of what the generate routes answered
    reasons = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode, examples in EXAMPLES.items():

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                phases=[Phase.generate],  # no shrinking: a failure prints its case as is
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case) -> None:
                nonlocal calls
                _cheap(case, stack.model, rng)
                calls += 1
                response = case.call(base_url=stack.api_url, timeout=60)
                _assert_answer(response, case.path)
                if case.path.endswith("completions"):
                    generated[case.path, response.status_code] += 1
                    if response.status_code == 400:
                        reasons[response.json()["error"]["message"][:90]] += 1

            try:
                fuzz()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # a route that takes no input at all
    assert calls > 100
    for path in ("/v1/completions", "/v1/chat/completions"):  # the ring itself was fuzzed
        assert generated[path, 200] >= 3, "\n".join(f"{n} {m}" for m, n in reasons.most_common(15))
    _assert_nothing_held(stack)
    _assert_still_serving(stack, pids)


def _post(http: httpx.Client, path: str, content: bytes, content_type: str | None = None):
    headers = {"content-type": content_type} if content_type else {}
    response = http.post(path, content=content, headers=headers)
    _assert_answer(response, path)
    return response


def test_hand_written_bad_inputs_find_no_server_error(stack):
    pids = _stage_pids(stack)
    model = stack.model
    with httpx.Client(base_url=stack.api_url, timeout=60) as http:
        for raw, content_type, _ in BAD_BODIES:
            path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
            assert _post(http, path, raw.replace(b'"tiny"', model.encode()), content_type)
        for field, value in OUT_OF_RANGE:
            raw = json.dumps({"model": model, "prompt": "x", field: value}).encode()
            assert _post(http, "/v1/completions", raw, "application/json").status_code == 400
        for path, body, _ in SURROGATES:
            raw = json.dumps({"model": model, **body}).encode()
            assert _post(http, f"/v1/{path}", raw, "application/json").status_code == 400
        # the reported attack: 300 requests with an integer the encoder cannot carry, once
        # enough to fill --max-waiting with leaked uids and answer 429 to everyone
        for i in range(300):
            field = ("max_tokens", "top_k", "seed", "min_tokens")[i % 4]
            raw = json.dumps({"model": model, "prompt": "x", field: 2**64}).encode()
            assert _post(http, "/v1/completions", raw, "application/json").status_code == 400
        ids = {"model": model, "prompt": "x", "stop_token_ids": [2**64]}
        assert _post(http, "/v1/completions", json.dumps(ids).encode(), "application/json")
        # other shapes of trouble
        assert _post(http, "/v1/models", b"", None).status_code == 405
        assert http.get("/v1/no-such-route").status_code == 404
        junk = bytes(range(256)) * 16
        assert _post(http, "/v1/completions", junk, "application/json").status_code == 400
        chat = {"model": model, "messages": [{"role": "user", "content": ""}], "max_tokens": 2}
        assert _post(http, "/v1/chat/completions", json.dumps(chat).encode(), "application/json")
        for prompt in ("", [""], " "):  # zero tokens, and one
            body = {"model": model, "prompt": prompt, "max_tokens": 2}
            assert _post(http, "/v1/completions", json.dumps(body).encode(), "application/json")
    _assert_nothing_held(stack)
    _assert_still_serving(stack, pids)


def test_a_truncated_body_from_a_client_that_goes_away_leaves_nothing(stack):
    pids = _stage_pids(stack)
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", stack.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model": "tiny", "prom'
            )
    _assert_nothing_held(stack)
    _assert_still_serving(stack, pids)
