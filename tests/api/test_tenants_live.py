"""Many tenants on one stack: named API keys, priority scheduling and weighted fair share.

One stack for the module: three named keys (team-a weighs 1, team-b 3), priority scheduling,
four sequences at most, and a limit of waiting requests per tenant. Floods run from threads of
the official client; shares are read from the scheduler's own per-tenant token counter.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

KEYS = {"team-a": "sk-team-a-1", "team-b": "sk-team-b-2", "team-c": "sk-team-c-3"}
PER_TENANT = 6


@pytest.fixture(scope="module")
def tenants_stack(launch_stack, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    stack = launch_stack(
        "tiny",
        "--api-key-file", str(key_file),
        "--scheduling-policy", "priority",
        "--tenant-weights", "team-a=1,team-b=3",
        "--max-waiting-per-tenant", str(PER_TENANT),
        "--max-num-seqs", "4",
        "--request-timeout", "60",
    )  # fmt: skip
    yield stack
    stack.stop()


def client(stack, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{stack.api_url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=60
    )


def generated(stack) -> dict[str, float]:
    """The scheduler's tokens generated per tenant so far."""
    text = urllib.request.urlopen(stack.metrics_urls["scheduler"], timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tokenline_tenant_generation_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            tenant = labels.split('tenant="', 1)[1].split('"', 1)[0]
            out[tenant] = out.get(tenant, 0.0) + float(value)
    return out


def flood(stack, tenant: str, stop: threading.Event, max_tokens: int, priority: int = 0):
    """Requests of ``tenant`` back to back until ``stop``; returns the 429s seen."""
    api = client(stack, tenant)
    refused = []
    while not stop.is_set():
        try:
            api.completions.create(
                model="tiny",
                prompt="a flood of words",
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True, "priority": priority},
            )
        except openai.RateLimitError as exc:
            refused.append(exc)
            time.sleep(0.05)
    return refused


def test_tenants_share_the_pool_by_weight(tenants_stack) -> None:
    stop = threading.Event()
    with ThreadPoolExecutor(2 * PER_TENANT) as pool:
        # lengths that differ, so the slots free one at a time and each tenant's queue stays
        # stocked (equal lengths finish together and can empty a queue for a step)
        floods = [
            pool.submit(flood, tenants_stack, tenant, stop, 16 + 8 * i)
            for tenant in ("team-a", "team-b")
            for i in range(PER_TENANT)
        ]
        time.sleep(3)  # both tenants saturate the four sequences
        before = generated(tenants_stack)
        time.sleep(8)
        after = generated(tenants_stack)
        stop.set()
        for f in floods:
            f.result()
    got = {t: after.get(t, 0) - before.get(t, 0) for t in ("team-a", "team-b")}
    assert got["team-a"] > 50, got
    assert got["team-b"] / got["team-a"] == pytest.approx(3, rel=0.1), got


def test_an_urgent_request_is_not_held_back_by_a_flood(tenants_stack) -> None:
    """team-c floods at priority 10 (long requests, every sequence slot taken); a request at
    priority -1 gets its first token within a step or two, one at priority 10 waits. Eight
    flood threads for four slots, each asking a different length: a queue of four stands ahead
    of the waiting request, and slots free one at a time. (Equal lengths kept the flood in
    lockstep: four requests ended in one step, the queue emptied into the slots, and a request
    arriving before the threads asked again found a slot free.)"""
    stop = threading.Event()
    api = client(tenants_stack, "team-c")

    def ttft(priority: int) -> float:
        started = time.perf_counter()
        stream = api.completions.create(
            model="tiny",
            prompt="now",
            max_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True, "priority": priority},
        )
        first = None
        for _ in stream:
            first = first or time.perf_counter()
        return first - started

    with ThreadPoolExecutor(8) as pool:
        lengths = [300 + 47 * i for i in range(8)]  # four waiting + the probe: under PER_TENANT
        floods = [pool.submit(flood, tenants_stack, "team-c", stop, n, 10) for n in lengths]
        time.sleep(2)
        urgent = ttft(-1)
        waiting = ttft(10)
        stop.set()
        for f in floods:
            f.result()
    assert urgent < 0.5 and urgent * 3 < waiting, (urgent, waiting)


def test_a_tenant_over_its_waiting_limit_gets_429_with_retry_after(tenants_stack) -> None:
    stop = threading.Event()
    with ThreadPoolExecutor(PER_TENANT + 6) as pool:
        floods = [
            pool.submit(flood, tenants_stack, "team-c", stop, 200, 5) for _ in range(PER_TENANT + 6)
        ]
        time.sleep(4)
        # another tenant is not refused for team-c's queue
        reply = client(tenants_stack, "team-a").completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={"priority": 0}
        )
        stop.set()
        refused = [e for f in floods for e in f.result()]
    assert reply.choices[0].text is not None
    assert refused, "team-c never went over its limit"
    first = refused[0]
    assert first.response.headers["retry-after"] == "1"
    assert "team-c" in first.message and "--max-waiting-per-tenant" in first.message
