"""The whole stack with --tensor-parallel-size 2 (gloo on CPU): under concurrent load with
client disconnects every request ends and nothing leaks; a killed worker rank fails the
in-flight requests fast, /ready turns false, and the restarted scheduler serves again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from test_chaos import STREAM, _stream_outcome, _wait_ready

SHORT_FLAGS = ("--request-timeout", "8", "--slow-client-timeout", "2", "--drain-timeout", "5")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def tp_stack(launch_stack):
    stack = launch_stack(*SHORT_FLAGS, "--tensor-parallel-size", "2", "--torch-threads", "1")
    yield stack
    stack.stop()


def _spawned(stack) -> list[int]:
    """The stack's processes started by multiprocessing's spawn (a tensor-parallel stack's
    worker ranks; not the resource tracker)."""
    return [
        pid
        for pid in stack.descendants()
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def test_concurrent_requests_with_disconnects_all_end_and_nothing_leaks(tp_stack, nothing_held):
    assert _wait_ready(tp_stack, True, 120)
    body = {**STREAM, "max_tokens": 40}

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(base_url=tp_stack.api_url, timeout=60) as client:
            return await asyncio.gather(
                *(_stream_outcome(client, body, 3 if i % 3 == 0 else None) for i in range(9))
            )

    outcomes = asyncio.run(scenario())
    assert sorted(set(outcomes)) == ["done", "left"], outcomes
    assert tp_stack.metric("scheduler", "tokenline_collective_seconds_count", rank="1") > 0
    nothing_held(tp_stack)


def test_a_killed_worker_rank_fails_requests_fast_and_serving_resumes(tp_stack, nothing_held):
    assert _wait_ready(tp_stack, True, 120)
    scheduler = tp_stack.pid_of("scheduler")
    (worker,) = _spawned(tp_stack)  # rank 1, spawned by the scheduler stage
    body = {**STREAM, "max_tokens": 1900}

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(base_url=tp_stack.api_url, timeout=30) as client:
            streams = [asyncio.create_task(_stream_outcome(client, body)) for _ in range(3)]
            await asyncio.sleep(1.0)
            os.kill(worker, signal.SIGKILL)
            killed_at = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), 15)
            assert time.monotonic() - killed_at < 10, "in-flight requests took too long to fail"
            return outcomes

    assert asyncio.run(scenario()) == ["error:stage_failure"] * 3
    assert _wait_ready(tp_stack, True, 120), "not ready again after the scheduler restarted"
    assert tp_stack.pid_of("scheduler") != scheduler
    reply = httpx.post(
        f"{tp_stack.api_url}/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": "back?", "max_tokens": 4},
    )
    assert reply.status_code == 200
    nothing_held(tp_stack)
