"""Prefill and decode on two stacks, in llm-d's contract, driven as its routing sidecar drives
them: the client's body goes to the prefill stack with ``kv_transfer_params: {do_remote_decode:
true}``, ``stream: false`` and one token; the prefill stack's ``kv_transfer_params`` go with the
original body to the decode stack, which reads the prompt's KV over NIXL and answers. Greedy
output is the shared single stack's, token for token, on chat, completions and Responses,
streamed and not; a prefill stack that dies makes the decode request fail within seconds.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from unittest import mock

import httpx
import pytest
from conftest import free_port_block

pytest.importorskip("nixl_cu12._api", reason="NIXL is installed by `make .venv/.test`")

PRODUCER = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
CONSUMER = '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'
STORY = (
    "Once upon a time a small robot lived in a lighthouse by the sea. Every night it climbed "
    "the stairs, polished the great lamp and watched the ships pass. One stormy evening"
)


ADAPTER = "story-lora"
# the tiny model's KV of one block: 16 slots, K and V, 2 heads of 64, float32, 4 layers
TINY_BYTES_PER_BLOCK = 16 * 2 * 2 * 64 * 4 * 4


@pytest.fixture(scope="module")
def launch_stack(launch_stack):
    """Stacks that drain for 5 s at the most: a prefill stack holds its unread loans through a
    drain, for the default 30 s, at every stop in this module."""
    return lambda *flags, **kwargs: launch_stack(*flags, "--drain-timeout", "5", **kwargs)


@pytest.fixture(scope="module")
def lora_flags(model_cache, tmp_path_factory) -> tuple[str, ...]:
    """Both stacks serve one adapter: its blocks are named with it on either side."""
    from test_lora_e2e import write_adapter

    from tokenline.model_source import resolve

    base = resolve("tiny", cache_dir=str(model_cache)).path
    adapter = write_adapter(base, tmp_path_factory.mktemp("adapters") / ADAPTER)
    return ("--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}")


@pytest.fixture(scope="module")
def prefill(launch_stack, lora_flags):
    port = free_port_block(1)
    with mock.patch.dict(os.environ, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}):
        stack = launch_stack(
            "tiny", "--kv-transfer-config", PRODUCER, "--request-timeout", "60", *lora_flags
        )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def decode(launch_stack, lora_flags):
    stack = launch_stack(
        "tiny", "--kv-transfer-config", CONSUMER, "--request-timeout", "60", *lora_flags
    )
    yield stack
    stack.stop()


# llm-d's routing sidecar (connector_nixlv2.go) sends the prefill pod exactly these
SIDECAR_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(path: str, body: dict) -> dict:
    """What the sidecar sends the prefill pod."""
    sent = {**body, "stream": False, "kv_transfer_params": SIDECAR_PARAMS}
    sent.pop("stream_options", None)
    if path == "/v1/responses":
        sent["max_output_tokens"] = 1
    else:
        sent["max_tokens"] = 1
        sent.pop("max_completion_tokens", None)
    return sent


def disaggregated(prefill, decode, path: str, body: dict) -> httpx.Response:
    """The routing sidecar's two calls; returns the decode stack's answer."""
    request_id = str(uuid.uuid4())
    headers = {"x-request-id": request_id}
    first = httpx.post(
        prefill.api_url + path, json=prefill_body(path, body), headers=headers, timeout=60
    )
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return httpx.post(
        decode.api_url + path,
        json={**body, "kv_transfer_params": params},
        headers=headers,
        timeout=60,
    )


def text_of(path: str, response: httpx.Response, stream: bool) -> str:
    if not stream:
        data = response.json()
        if path == "/v1/chat/completions":
            return data["choices"][0]["message"]["content"]
        if path == "/v1/completions":
            return data["choices"][0]["text"]
        return data["output"][-1]["content"][0]["text"]
    pieces = []
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if path == "/v1/chat/completions":
            pieces += [c["delta"].get("content") or "" for c in event["choices"]]
        elif path == "/v1/completions":
            pieces += [c["text"] for c in event["choices"]]
        elif event.get("type") == "response.output_text.delta":
            pieces.append(event["delta"])
    return "".join(pieces)


def body_for(path: str, stream: bool) -> dict:
    body: dict = {"model": "tiny", "temperature": 0, "stream": stream}
    if path == "/v1/chat/completions":
        body |= {"messages": [{"role": "user", "content": STORY}], "max_tokens": 16}
    elif path == "/v1/completions":
        body |= {"prompt": STORY, "max_tokens": 16}
    else:
        body |= {"input": STORY, "max_output_tokens": 16}
    return body


def metric(stack, stage: str, name: str) -> float:
    text = urllib.request.urlopen(stack.metrics_urls[stage], timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_disaggregated_output_is_one_stacks(stack, prefill, decode, path, stream) -> None:
    body = body_for(path, stream)
    alone = httpx.post(stack.api_url + path, json=body, timeout=60)
    assert alone.status_code == 200, alone.text
    answer = disaggregated(prefill, decode, path, body)
    assert answer.status_code == 200, answer.text
    assert text_of(path, answer, stream) == text_of(path, alone, stream)
    if not stream:
        assert "kv_transfer_params" not in answer.json()  # only a prefill pod answers them


def test_an_adapters_request_reads_the_adapters_kv(prefill, decode) -> None:
    """Under a LoRA adapter the prompt's K/V is the adapter's: read across and decoded, the
    answer is the one the adapter gives on one stack, and not the base model's."""
    path = "/v1/completions"
    body = body_for(path, False) | {"prompt": STORY + " the adapter spoke.", "model": ADAPTER}
    on_one = httpx.post(prefill.api_url + path, json=body, timeout=60)
    assert on_one.status_code == 200, on_one.text
    base = httpx.post(prefill.api_url + path, json=body | {"model": "tiny"}, timeout=60)
    answer = disaggregated(prefill, decode, path, body)
    assert answer.status_code == 200, answer.text
    assert text_of(path, answer, False) == text_of(path, on_one, False)
    assert text_of(path, on_one, False) != text_of(path, base, False)


def test_the_kv_was_read_and_every_loan_released(prefill, decode) -> None:
    received = 'tokenline_kv_transfer_bytes_total{direction="received"}'
    before = metric(decode, "scheduler", received)
    body = body_for("/v1/completions", False) | {"prompt": STORY + " the keeper woke up."}
    assert disaggregated(prefill, decode, "/v1/completions", body).status_code == 200
    assert metric(decode, "scheduler", received) > before
    deadline = time.monotonic() + 10
    while metric(prefill, "scheduler", "tokenline_kv_blocks_held_for_transfer") > 0:
        assert time.monotonic() < deadline, "the prefill stack still holds lent blocks"
        time.sleep(0.2)


def test_kv_transfer_params_on_a_plain_stack_are_refused(stack) -> None:
    body = body_for("/v1/completions", False) | {"kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(stack.api_url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400
    assert "--kv-transfer-config" in answer.json()["error"]["message"]


@pytest.fixture(scope="module")
def side_channel_keys(tmp_path_factory) -> str:
    from tokenline.ring_security import create_keys

    directory = tmp_path_factory.mktemp("side-channel-keys")
    create_keys(str(directory))
    return str(directory)


def keyed(role: str, keys: str) -> str:
    extra = {"side_channel_keys": keys}
    return json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}
    )


@pytest.fixture(scope="module")
def keyed_prefill(launch_stack, side_channel_keys):
    port = free_port_block(1)
    with mock.patch.dict(os.environ, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}):
        stack = launch_stack(
            "tiny", "--kv-transfer-config", keyed("kv_producer", side_channel_keys)
        )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def keyed_decode(launch_stack, side_channel_keys):
    stack = launch_stack("tiny", "--kv-transfer-config", keyed("kv_consumer", side_channel_keys))
    yield stack
    stack.stop()


def test_stacks_with_side_channel_keys_read_only_from_each_other(
    stack, prefill, decode, keyed_prefill, keyed_decode
) -> None:
    """After test_the_kv_was_read_and_every_loan_released: the refused reads below leave their
    loans to the lease."""
    path = "/v1/completions"
    body = body_for(path, False) | {"prompt": STORY + " the keys turned."}
    alone = httpx.post(stack.api_url + path, json=body, timeout=60)
    answer = disaggregated(keyed_prefill, keyed_decode, path, body)
    assert answer.status_code == 200, answer.text
    assert text_of(path, answer, False) == text_of(path, alone, False)
    # a decode stack with the keys reads nothing of a prefill stack without them (a side
    # channel a forged remote_host names), and one without them gets nothing of one with them
    failed = 'tokenline_kv_transfer_failures_total{reason="unauthenticated"}'
    for i, (lender, reader) in enumerate(((prefill, keyed_decode), (keyed_prefill, decode))):
        body = body_for(path, False) | {"prompt": STORY + f" the lock {i} held."}  # uncached
        first = httpx.post(lender.api_url + path, json=prefill_body(path, body), timeout=60)
        params = first.json()["kv_transfer_params"]
        before = metric(reader, "scheduler", failed)
        started = time.monotonic()
        answer = httpx.post(
            reader.api_url + path, json={**body, "kv_transfer_params": params}, timeout=60
        )
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "kv_load_failed"
        assert time.monotonic() - started < 4  # the handshake failed: no 5 s hello timeout
        assert metric(reader, "scheduler", failed) == before + 1


@pytest.fixture(scope="module")
def tp_prefill(launch_stack):
    """A prefill stack at --tensor-parallel-size 2: each rank lends its own KV head."""
    port = free_port_block(1)
    with mock.patch.dict(os.environ, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}):
        stack = launch_stack(
            "tiny", "--kv-transfer-config", PRODUCER, "--tensor-parallel-size", "2"
        )
    yield stack
    stack.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_tensor_parallel_prefill_stack_lends_to_a_tp1_decode_stack(
    stack, tp_prefill, decode, path
) -> None:
    received = 'tokenline_kv_transfer_bytes_total{direction="received"}'
    before = metric(decode, "scheduler", received)
    body = body_for(path, True)
    if path == "/v1/completions":
        body["prompt"] = STORY + " two ranks kept the lamp."  # not cached on the decode stack
    else:
        body["messages"] = [{"role": "user", "content": STORY + " two ranks kept watch."}]
    params = httpx.post(
        tp_prefill.api_url + path, json=prefill_body(path, body), timeout=60
    ).json()["kv_transfer_params"]
    assert params["tp_size"] == 2 and params["remote_block_ids"]
    answer = httpx.post(
        decode.api_url + path, json={**body, "kv_transfer_params": params}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    alone = httpx.post(stack.api_url + path, json=body, timeout=60)
    assert text_of(path, answer, True) == text_of(path, alone, True)
    assert metric(decode, "scheduler", received) > before


@pytest.fixture(scope="module")
def tp_decode(launch_stack):
    """A decode stack at --tensor-parallel-size 2: each rank reads its own KV head."""
    stack = launch_stack("tiny", "--kv-transfer-config", CONSUMER, "--tensor-parallel-size", "2")
    yield stack
    stack.stop()


@pytest.mark.parametrize("source", ["tp1", "tp2"])
def test_a_tensor_parallel_decode_stack_reads_its_heads_from_either_prefill_stack(
    stack, prefill, tp_prefill, tp_decode, source
) -> None:
    """TP=1 -> TP=2: each decode rank reads its head out of the prefill pod's whole rows;
    TP=2 -> TP=2: each reads its peer rank's rows whole."""
    lender = prefill if source == "tp1" else tp_prefill
    path = "/v1/completions"
    received = 'tokenline_kv_transfer_bytes_total{direction="received"}'
    before = metric(tp_decode, "scheduler", received)
    body = body_for(path, False) | {"prompt": STORY + f" the {source} crew rang the bell."}
    params = httpx.post(lender.api_url + path, json=prefill_body(path, body), timeout=60).json()[
        "kv_transfer_params"
    ]
    assert params.get("tp_size", 1) == (1 if source == "tp1" else 2) and params["remote_block_ids"]
    answer = httpx.post(
        tp_decode.api_url + path, json={**body, "kv_transfer_params": params}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    alone = httpx.post(stack.api_url + path, json=body, timeout=60)
    assert text_of(path, answer, False) == text_of(path, alone, False)
    # every lent block it did not hold, both ranks' halves of each: the second prompt shares
    # the story's first blocks with the first, cached here since
    cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (cached > 0) == (source == "tp2")
    read = metric(tp_decode, "scheduler", received) - before
    assert read == (len(params["remote_block_ids"]) - cached // 16) * TINY_BYTES_PER_BLOCK


def test_a_dead_prefill_stack_fails_the_decode_request_fast(prefill, decode) -> None:
    """The module's last test: it stops the prefill stack between the two calls."""
    path = "/v1/completions"
    body = body_for(path, False) | {"prompt": STORY + " a ship ran aground."}
    first = httpx.post(prefill.api_url + path, json=prefill_body(path, body), timeout=60)
    params = first.json()["kv_transfer_params"]
    prefill.stop()
    started = time.monotonic()
    answer = httpx.post(
        decode.api_url + path, json={**body, "kv_transfer_params": params}, timeout=60
    )
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "kv_load_failed"
    assert time.monotonic() - started < 15
    # the decode stack took nothing with it: its next request is served
    assert disaggregated_alone(decode).status_code == 200


def disaggregated_alone(decode) -> httpx.Response:
    return httpx.post(decode.api_url + "/v1/completions", json=body_for("/v1/completions", False))
