"""The load: the request loop of one phase, and the order in which phases run.

A phase is one target running the whole workload once. Closed loop (no request rate):
``concurrency`` workers each send their next request as soon as the previous one ends. Open
loop (a request rate): requests start at Poisson arrival times, optionally capped at
``concurrency`` in flight.

With two targets, rounds run in the order A B, B A, A B, ... so that drifting machine noise
(thermal, other tenants, caches warming) falls on both targets alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from tokenline.bench.config import BenchConfig, TargetConfig
from tokenline.bench.isolation import frozen
from tokenline.bench.records import BenchResult, Phase, RequestRecord, TargetInfo
from tokenline.bench.request import discover_model, send_request
from tokenline.bench.workload import RequestSpec, build_workload, poisson_arrivals

OnDone = Callable[[RequestRecord], None]
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
    """Send every spec to ``target`` once; records come back sorted by spec index."""
    records: list[RequestRecord] = []
    phase_start = time.perf_counter()

    async def one(spec: RequestSpec) -> None:
        record = await send_request(
            client, config, target, model, spec, round_=round_, run_start=run_start
        )
        records.append(record)
        on_done(record)

    if arrivals is None:
        if concurrency is None:
            raise ValueError("a closed loop needs a concurrency")
        pending = iter(specs)

        async def worker() -> None:
            for spec in pending:
                await one(spec)

        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(specs))):
                group.create_task(worker())
    else:
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def gated(spec: RequestSpec) -> None:
            if gate is None:
                await one(spec)
                return
            async with gate:
                await one(spec)

        async with asyncio.TaskGroup() as group:
            for spec, arrival in zip(specs, arrivals, strict=True):
                delay = phase_start + arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                group.create_task(gated(spec))

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
    return frozen([pid for t in config.targets if t is not measured for pid in t.pids])


async def isolated_phase(
    config: BenchConfig, target: TargetConfig, model: str, specs: list[RequestSpec], **kwargs
) -> Phase:
    """One phase against ``target`` with the other targets paused, over a fresh connection
    pool: a keep-alive connection left idle while its server was paused for the other target
    is closed by that server just as it is reused."""
    with _others_frozen(config, target):
        async with _client(config) as client:
            return await run_phase(client, config, target, model, specs, **kwargs)


async def run_benchmark(
    config: BenchConfig,
    *,
    on_done: OnDone = _ignore_record,
    on_phase: OnPhase = _ignore_phase,
) -> BenchResult:
    """Run the configured load against every target; warm-up requests are not recorded."""
    specs = build_workload(config.num_requests, config.prompt_len, config.output_len, config.seed)
    warmup_specs = build_workload(
        config.warmup, config.prompt_len, config.output_len, config.seed + 1
    )
    arrivals = (
        poisson_arrivals(config.num_requests, config.request_rate, config.seed)
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
        for target in round_order(config.targets, round_):
            on_phase(target.label, round_)
            phase = await isolated_phase(
                config,
                target,
                models[target.label],
                specs,
                round_=round_,
                run_start=run_start,
                arrivals=arrivals,
                concurrency=config.concurrency,
                on_done=on_done,
            )
            result.phases.append(phase)
    return result
