"""Drain as an endpoint picker sees it: on SIGTERM the pod fails readiness at once (the
picker's informer drops not-ready pods), keeps serving /metrics, and finishes its streams."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request

import httpx
import pytest
from test_chaos import _stream_outcome

pytestmark = pytest.mark.timeout(120)
# Long enough to outlast several heartbeats (0.5 s apart), which carry the running count the
# test waits for: a warm stack streams 300 tokens of the tiny model in less.
STREAM = {
    "model": "tiny",
    "prompt": "drain",
    "stream": True,
    "max_tokens": 2000,
    "ignore_eos": True,
}


def ready_state(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_sigterm_fails_readiness_at_once_and_streams_finish(launch_stack):
    stack = launch_stack("--drain-timeout", "40")
    assert ready_state(stack.api_url)[0] == 200

    async def scenario() -> tuple[list[str], float, dict, float]:
        async with httpx.AsyncClient(base_url=stack.api_url, timeout=90) as client:
            streams = [asyncio.create_task(_stream_outcome(client, STREAM)) for _ in range(2)]
            while not stack.metric("api", "tokenline_endpoint_requests_running"):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            signalled = time.monotonic()
            stack.process.send_signal(signal.SIGTERM)
            status, body = ready_state(stack.api_url)
            while status == 200 and time.monotonic() - signalled < 5:
                await asyncio.sleep(0.02)
                status, body = await asyncio.to_thread(ready_state, stack.api_url)
            flipped = time.monotonic() - signalled
            assert status == 503, body
            # The picker keeps scraping a draining pod: its load is still reported.
            running = stack.metric("api", "tokenline_endpoint_requests_running")
            return await asyncio.gather(*streams), flipped, body, running

    outcomes, flipped, body, running = asyncio.run(scenario())
    assert body["draining"] is True and body["problem"] == "draining"
    assert flipped < 1.0, f"readiness failed {flipped:.2f}s after SIGTERM"
    assert running >= 1
    assert outcomes == ["done", "done"]
    assert stack.process.wait(60) == 0
