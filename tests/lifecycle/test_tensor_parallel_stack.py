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


def _spawned_children(pid: int) -> list[int]:
    """``pid``'s children started by multiprocessing's spawn (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(") ", 1)[1].split()[1]) != pid:
                continue
            if b"spawn_main" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


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
    (worker,) = _spawned_children(scheduler)  # rank 1, spawned by the scheduler stage
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
