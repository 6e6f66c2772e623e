"""The load: the request loop of one phase, and the order in which phases run.

A phase is one target running the whole workload once. Closed loop (no request rate):
``concurrency`` workers each send their next request as soon as the previous one ends. Open
loop (a request rate): requests start at Poisson arrival times, optionally capped at
``concurrency`` in flight.

In a conversation workload the unit of the loop is a conversation: its turns go one after the
other (each needs the reply before it), and ``concurrency`` or the arrivals apply to
conversations, so requests in flight stay within the same bound.

With two targets, rounds run in the order A B, B A, A B, ... so that drifting machine noise
(thermal, other tenants, caches warming) falls on both targets alike. Each round after the
first gets its own words (``reword``; the same for every target), so that a server with a
prefix cache does not find the previous round's prompts in it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from tokenline.loadgen.config import BenchConfig, TargetConfig
from tokenline.loadgen.isolation import frozen
from tokenline.loadgen.records import BenchResult, Phase, RequestRecord, TargetInfo
from tokenline.loadgen.request import Message, discover_model, new_record, send_request
from tokenline.loadgen.workload import (
    RequestSpec,
    build_workload,
    conversations,
    poisson_arrivals,
    reword,
)

OnDone = Callable[[RequestRecord], None]
READY_TIMEOUT_S = 30.0
READY_POLL_S = 0.05
OnPhase = Callable[[str, int], None]


def _ignore_record(_: RequestRecord) -> None:
    pass


def _ignore_phase(_: str, __: int) -> None:
    pass


def round_order(targets: list[TargetConfig], round_: int) -> list[TargetConfig]:
    """Targets in the order they run in ``round_``: forward on even rounds, reversed on odd."""
    return list(targets) if round_ % 2 == 0 else list(reversed(targets))


async def run_phase(
    client: aiohttp.ClientSession,
    config: BenchConfig,
    target: TargetConfig,
    model: str,
    specs: list[RequestSpec],
    *,
    round_: int = 0,
    run_start: float = 0.0,
    arrivals: list[float] | None = None,
    concurrency: int | None = None,
    on_done: OnDone = _ignore_record,
) -> Phase:
    """Send every spec to ``target`` once; records come back sorted by spec index.

    ``arrivals`` has one offset per conversation (per request when every conversation has
    one turn)."""
    records: list[RequestRecord] = []
    phase_start = time.perf_counter()
    chats = conversations(specs)

    async def one(turns: list[RequestSpec]) -> None:
        history: list[Message] = []
        for position, spec in enumerate(turns):
            reply: list[str] = []
            record = await send_request(
                client,
                config,
                target,
                model,
                spec,
                round_=round_,
                run_start=run_start,
                history=history,
                reply=reply,
            )
            records.append(record)
            on_done(record)
            if not record.ok:
                # The next turn would resend a conversation that never happened.
                for skipped in turns[position + 1 :]:
                    lost = new_record(target, skipped, round_)
                    lost.error = f"not sent: turn {spec.turn} of its conversation failed"
                    records.append(lost)
                    on_done(lost)
                return
            history += [
                {"role": "user", "content": spec.prompt},
                {"role": "assistant", "content": "".join(reply)},
            ]

    if arrivals is None:
        if concurrency is None:
            raise ValueError("a closed loop needs a concurrency")
        pending = iter(chats)

        async def worker() -> None:
            for turns in pending:
                await one(turns)

        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(chats))):
                group.create_task(worker())
    else:
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def gated(turns: list[RequestSpec]) -> None:
            if gate is None:
                await one(turns)
                return
            async with gate:
                await one(turns)

        async with asyncio.TaskGroup() as group:
            for turns, arrival in zip(chats, arrivals, strict=True):
                delay = phase_start + arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                group.create_task(gated(turns))

    duration = time.perf_counter() - phase_start
    records.sort(key=lambda record: record.index)
    return Phase(target.label, round_, phase_start - run_start, duration, records)


def _client(config: BenchConfig) -> aiohttp.ClientSession:
    # aiohttp rather than httpx: the client shares the machine with the servers it measures,
    # and its C-accelerated HTTP parsing takes less of it (benchmarks/README.md).
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=min(config.timeout, 30.0), sock_read=config.timeout
        ),
        connector=aiohttp.TCPConnector(limit=config.concurrency or 0),
        trust_env=False,  # a proxy from the environment must not sit between us and loopback
    )


def _others_frozen(config: BenchConfig, measured: TargetConfig):
    """Stop the other targets' processes (if given) while ``measured`` is under load."""
    others = [pid for t in config.targets if t is not measured for pid in t.pids]
    return frozen(others, spared=measured.pids)


async def isolated_phase(
    config: BenchConfig, target: TargetConfig, model: str, specs: list[RequestSpec], **kwargs
) -> Phase:
    """One phase against ``target`` with the other targets paused, over a fresh connection
    pool: a keep-alive connection left idle while its server was paused for the other target
    is closed by that server just as it is reused."""
    with _others_frozen(config, target):
        async with _client(config) as client:
            if target.pids:
                await wait_ready(client, target.base_url)
            return await run_phase(client, config, target, model, specs, **kwargs)


async def wait_ready(
    client: aiohttp.ClientSession, base_url: str, within: float = READY_TIMEOUT_S
) -> bool:
    """Wait until ``GET /ready`` stops answering 503; True when it did ``within`` seconds.

    A server whose processes were just continued may still hold a verdict formed while it
    was stopped (tokenline's api saw no heartbeat for as long as its stages were stopped, and
    refuses requests until the next one comes back): its first requests would fail for a
    reason that is the bench's doing. A server without ``/ready`` (404) counts as ready.
    """
    deadline = time.perf_counter() + within
    while True:
        try:
            async with client.get(f"{base_url}/ready") as response:
                if response.status != 503:
                    return True
        except (aiohttp.ClientError, TimeoutError):
            pass
        if time.perf_counter() >= deadline:
            return False
        await asyncio.sleep(READY_POLL_S)


async def run_benchmark(
    config: BenchConfig,
    *,
    on_done: OnDone = _ignore_record,
    on_phase: OnPhase = _ignore_phase,
) -> BenchResult:
    """Run the configured load against every target; warm-up requests are not recorded.

    Warm-up requests have their own words but the run's shared prefixes: measuring starts
    with a prefix already seen, as a long-running service sees its system prompt."""
    shape = {
        "shared_prefix_len": config.shared_prefix_len,
        "prefix_groups": config.prefix_groups,
        "turns": config.turns,
        "prefix_seed": config.seed,
    }
    specs = build_workload(
        config.num_requests, config.prompt_len, config.output_len, config.seed, **shape
    )
    warmup_specs = build_workload(
        config.warmup, config.prompt_len, config.output_len, config.seed + 1, **shape
    )
    arrivals = (
        poisson_arrivals(len(conversations(specs)), config.request_rate, config.seed)
        if config.request_rate is not None
        else None
    )
    models: dict[str, str] = {}
    for target in config.targets:
        if target.model:
            models[target.label] = target.model
        else:
            async with _client(config) as client:
                models[target.label] = await discover_model(client, target.base_url)
    result = BenchResult(
        config=config.describe(),
        targets=[TargetInfo(t.label, t.base_url, models[t.label]) for t in config.targets],
    )
    for target in config.targets:
        if not warmup_specs:
            break
        on_phase(target.label, -1)
        phase = await isolated_phase(
            config,
            target,
            models[target.label],
            warmup_specs,
            concurrency=min(len(warmup_specs), config.concurrency or len(warmup_specs)),
        )
        failed = [r for r in phase.records if not r.ok]
        if failed:
            result.warnings.append(
                f"{target.label}: {len(failed)} of {len(warmup_specs)} warm-up requests "
                f"failed, first: {failed[0].error}"
            )

    run_start = time.perf_counter()  # after warm-up: the plots' time axis starts here
    for round_ in range(config.rounds):
        round_specs = (
            reword(specs, f"{config.seed}:{round_}") if round_ and config.reword_rounds else specs
        )
        for target in round_order(config.targets, round_):
            on_phase(target.label, round_)
            phase = await isolated_phase(
                config,
                target,
                models[target.label],
                round_specs,
                round_=round_,
                run_start=run_start,
                arrivals=arrivals,
                concurrency=config.concurrency,
                on_done=on_done,
            )
            result.phases.append(phase)
    return result
