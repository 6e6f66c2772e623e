"""Chaos: kill stages, disconnect at random, send garbage; every request ends, nothing leaks."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

STREAM = {"model": "tiny", "prompt": "chaos", "stream": True, "max_tokens": 400, "ignore_eos": True}


async def _stream_outcome(
    client: httpx.AsyncClient, body: dict, read_chunks: int | None = None
) -> str:
    """'done', 'error:<code>', 'http:<status>' or 'left' (the client hung up on purpose)."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return f"http:{response.status_code}"
        seen = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done"
            if '"error"' in line:
                return "error:" + line.split('"code":"')[1].split('"')[0]
            seen += 1
            if read_chunks is not None and seen >= read_chunks:
                return "left"
    return "cut"


def _wait_for_restart(stack, stage: str, old_pid: int, timeout: float = 60) -> None:
    """Until a new process of ``stage`` serves its metrics and the api is ready again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stack.pid_of(stage) != old_pid:
                stack.metric(stage, "tokenline_live_uids", stage=stage)
                break
        except (LookupError, OSError):
            pass
        time.sleep(0.1)
    else:
        raise TimeoutError(f"{stage} was not restarted")
    assert _wait_ready(stack, True, timeout)


def _wait_ready(stack, ready: bool, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stack.ready() == ready:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("stage", ["tokenizer", "scheduler", "detokenizer"])
def test_a_killed_stage_fails_in_flight_requests_fast_and_serving_resumes(
    short_stack, stage, nothing_held
):
    assert _wait_ready(short_stack, True, 60)
    # 4 streams of 4 choices × 1900 tokens: far more work than fits before the kill is noticed
    body = {**STREAM, "n": 4, "max_tokens": 1900}

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(base_url=short_stack.api_url, timeout=30) as client:
            streams = [asyncio.create_task(_stream_outcome(client, body)) for _ in range(4)]
            await asyncio.sleep(1.0)
            os.kill(short_stack.pid_of(stage), signal.SIGKILL)
            killed_at = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), 15)
            assert time.monotonic() - killed_at < 10, "in-flight requests took too long to fail"
            return outcomes

    before = short_stack.metric("api", "tokenline_aborts_total", reason="stage_failure")
    outcomes = asyncio.run(scenario())
    assert outcomes == ["error:stage_failure"] * 4
    assert short_stack.metric("api", "tokenline_aborts_total", reason="stage_failure") > before
    assert _wait_ready(short_stack, True, 60), f"not ready again after the {stage} restarted"
    reply = httpx.post(
        f"{short_stack.api_url}/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": "back?", "max_tokens": 4},
    )
    assert reply.status_code == 200
    nothing_held(short_stack)


def test_chaos_every_request_ends_and_nothing_leaks(short_stack, nothing_held):
    rng = random.Random(7)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        kind = rng.choice(
            ["stream", "stream_leave", "plain", "plain_leave", "too_long", "malformed"]
        )
        body = {
            "model": "tiny",
            "prompt": f"request {i}",
            "max_tokens": rng.randint(4, 48),
            "ignore_eos": True,
        }
        await asyncio.sleep(rng.random() * 6)
        if kind == "stream":
            return await _stream_outcome(client, {**body, "stream": True})
        if kind == "stream_leave":
            return await _stream_outcome(client, {**body, "stream": True}, rng.randint(1, 5))
        if kind == "too_long":
            body["prompt"] = "mountain river " * 2000
        if kind == "malformed":
            r = await client.post("/v1/completions", content=b'{"model": "tiny", "prompt": [')
            return f"http:{r.status_code}"
        try:
            timeout = rng.uniform(0.05, 0.5) if kind == "plain_leave" else 30
            r = await client.post("/v1/completions", json=body, timeout=timeout)
            return f"http:{r.status_code}"
        except httpx.TimeoutException:
            return "left"

    async def load() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=short_stack.api_url, timeout=30, limits=limits
        ) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(240)]
            await asyncio.sleep(3)
            os.kill(short_stack.pid_of("scheduler"), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    outcomes = asyncio.run(load())
    allowed = {
        "done",
        "left",
        "http:200",
        "http:400",
        "http:429",
        "http:503",
        "error:stage_failure",
    }
    assert set(outcomes) <= allowed, sorted(set(outcomes) - allowed)
    assert outcomes.count("http:400") >= 20  # the over-long and malformed ones
    assert _wait_ready(short_stack, True, 60)
    nothing_held(short_stack, timeout=45)


def test_shutdown_lets_streams_finish_and_leaves_no_process(launch_stack):
    stack = launch_stack("--drain-timeout", "40")
    processes = stack.descendants()
    assert len(processes) >= 4

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(base_url=stack.api_url, timeout=60) as client:
            body = {**STREAM, "max_tokens": 400}
            streams = [asyncio.create_task(_stream_outcome(client, body)) for _ in range(3)]
            while not stack.metric("scheduler", "tokenline_num_requests_running"):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            stack.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5  # the signal reaches the api through serve
            while (await client.get("/ready")).status_code == 200:
                assert time.monotonic() < deadline, "still ready 5 s after SIGTERM"
                await asyncio.sleep(0.05)
            refused = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert refused.status_code == 503
            return await asyncio.wait_for(asyncio.gather(*streams), 60)

    assert asyncio.run(scenario()) == ["done"] * 3
    assert stack.process.wait(60) == 0
    survivors = [pid for pid in processes if os.path.exists(f"/proc/{pid}")]
    assert not survivors, f"processes left behind: {survivors}"
    assert not os.path.exists(f"{stack.ipc_dir}/scheduler.sock")


def test_a_stalled_api_does_not_blame_the_ring(short_stack):
    """Heartbeat loss is measured from the oldest unanswered heartbeat: an api that was itself
    paused past the timeout (GC, SIGSTOP, an overloaded node) serves at once when it resumes."""
    import concurrent.futures

    assert _wait_ready(short_stack, True, 60)
    api = short_stack.pid_of("api")
    body = {"model": "tiny", "prompt": "still here", "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        os.kill(api, signal.SIGSTOP)
        try:
            time.sleep(6)  # longer than the 5 s heartbeat timeout
            # these wait in the kernel's backlog and are the first thing the api sees
            pending = [
                pool.submit(
                    httpx.post, f"{short_stack.api_url}/v1/completions", json=body, timeout=30
                )
                for _ in range(4)
            ]
            time.sleep(0.5)
        finally:
            os.kill(api, signal.SIGCONT)
        codes = [f.result().status_code for f in pending]
    assert codes == [200] * 4, codes


@pytest.mark.parametrize(
    "stopped_s",
    [1.0, 9.0],  # the short stack's request timeout is 8 s
    ids=["back-within-the-request-timeout", "back-after-the-request-timeout"],
)
def test_an_abort_lost_with_a_dead_scheduler_is_sent_again(short_stack, nothing_held, stopped_s):
    """The scheduler dies with a client's abort still in its inbox; the detokenizer, which
    saw the uid begin, must still be told: the api re-sends recent aborts after a restart,
    also when the scheduler comes back later than the request's timeout."""
    assert _wait_ready(short_stack, True, 60)
    detokenizer_held = lambda: short_stack.metric(  # noqa: E731
        "detokenizer", "tokenline_live_uids", stage="detokenizer"
    )
    import json
    import socket as socket_module

    sock = socket_module.create_connection(("127.0.0.1", short_stack.port))
    body = json.dumps(
        {"model": "tiny", "prompt": "lost", "stream": True, "max_tokens": 1900, "ignore_eos": True}
    ).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 10
    while not detokenizer_held() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert detokenizer_held() == 1
    scheduler = short_stack.pid_of("scheduler")
    os.kill(scheduler, signal.SIGSTOP)  # the abort will wait in its inbox...
    sock.close()
    time.sleep(stopped_s)
    os.kill(scheduler, signal.SIGKILL)  # ...and die there
    _wait_for_restart(short_stack, "scheduler", scheduler)
    # well inside the 8 s deadline + 30 s grace after which the ledger would reclaim it
    nothing_held(short_stack, timeout=10)


@pytest.mark.parametrize("stage", ["tokenizer", "scheduler", "detokenizer"])
def test_ready_and_admission_agree_through_a_killed_stage(short_stack, stage, nothing_held):
    """A request every 50 ms and /ready polled at 20 Hz while ``stage`` is killed (-9):
    /ready turns non-200 within 1 s; no request is refused as ``stage_unavailable`` before a
    /ready that still answered 200; once /ready is 200 again, requests succeed."""
    assert _wait_ready(short_stack, True, 60)
    body = {"model": "tiny", "prompt": "steady", "max_tokens": 4}

    async def scenario() -> tuple[float, list, list]:
        polls: list[tuple[float, float, int]] = []  # (sent, received, status)
        requests: list[tuple[float, float, int, str]] = []  # (sent, received, status, code)
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(
            base_url=short_stack.api_url, timeout=30, limits=limits
        ) as client:

            async def poll() -> None:
                sent = time.monotonic()
                r = await client.get("/ready")
                polls.append((sent, time.monotonic(), r.status_code))

            async def request() -> None:
                sent = time.monotonic()
                r = await client.post("/v1/completions", json=body)
                code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
                requests.append((sent, time.monotonic(), r.status_code, code))

            tasks: list[asyncio.Task] = []
            killed_at = None
            back_at = None
            started = time.monotonic()
            while time.monotonic() - started < 60:
                tasks += [asyncio.create_task(poll()), asyncio.create_task(request())]
                await asyncio.sleep(0.05)
                now = time.monotonic()
                if killed_at is None and now - started > 1.0:
                    os.kill(short_stack.pid_of(stage), signal.SIGKILL)
                    killed_at = time.monotonic()
                if killed_at and back_at is None:
                    flipped = [p for p in polls if p[0] > killed_at and p[2] != 200]
                    if flipped and any(p[0] > flipped[0][0] and p[2] == 200 for p in polls):
                        back_at = now
                if back_at and now - back_at > 1.5:
                    break
            await asyncio.gather(*tasks)
            return killed_at, sorted(polls), sorted(requests)

    killed_at, polls, requests = asyncio.run(scenario())
    flipped = [p for p in polls if p[0] > killed_at and p[2] != 200]
    assert flipped, "/ready never turned non-200 after the kill"
    assert flipped[0][1] - killed_at < 1.0, f"/ready took {flipped[0][1] - killed_at:.2f}s"
    last_ready_before = max(p[0] for p in polls if p[2] == 200 and p[0] < flipped[0][0])
    refused = [r for r in requests if r[3] == "stage_unavailable"]
    early = [r for r in refused if r[1] < last_ready_before]
    assert not early, f"refused while /ready still answered 200: {early}"
    back = min(p[1] for p in polls if p[0] > flipped[0][0] and p[2] == 200)
    after = [r for r in requests if r[0] > back]
    assert after and all(r[2] == 200 for r in after), [r for r in after if r[2] != 200]
    nothing_held(short_stack)
