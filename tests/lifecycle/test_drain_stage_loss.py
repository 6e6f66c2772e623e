"""A stage that dies during a drain fails the streams in flight at once, with stage_failure,
instead of leaving them to hang until --drain-timeout ends them with shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from test_chaos import _stream_outcome

pytestmark = pytest.mark.timeout(180)
STREAM = {
    "model": "tiny",
    "prompt": "drain",
    "stream": True,
    "max_tokens": 1900,
    "ignore_eos": True,
}


def _gone(stack, stage: str) -> bool:
    try:
        stack.pid_of(stage)
    except LookupError:
        return True
    return False


def test_a_scheduler_killed_during_a_drain_fails_the_streams_at_once(launch_stack):
    stack = launch_stack("--drain-timeout", "40")

    async def scenario() -> tuple[list[str], float]:
        async with httpx.AsyncClient(base_url=stack.api_url, timeout=90) as client:
            streams = [asyncio.create_task(_stream_outcome(client, STREAM)) for _ in range(2)]
            while not stack.metric("scheduler", "tokenline_num_requests_running"):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            scheduler = stack.pid_of("scheduler")
            stack.process.send_signal(signal.SIGTERM)
            # The drain has begun once the tokenizer, which holds nothing, has left it.
            deadline = time.monotonic() + 10
            while not _gone(stack, "tokenizer"):
                assert time.monotonic() < deadline, "the tokenizer never left the drain"
                await asyncio.sleep(0.05)
            os.kill(scheduler, signal.SIGKILL)
            killed = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), 60)
            return outcomes, time.monotonic() - killed

    try:
        outcomes, took = asyncio.run(scenario())
    finally:
        stack.process.kill()  # the stages die with it; the rest of the drain is not the test's
        stack.process.wait(30)
    assert outcomes == ["error:stage_failure"] * 2
    assert took < 5, f"the streams failed {took:.1f}s after the scheduler died"
