"""Each request's per-stage times explain its end-to-end time (the Pipeline dashboard's promise)."""

from __future__ import annotations

import asyncio

import httpx

STAGES = ("tokenizer", "scheduler", "detokenizer", "api")


def _parse(header: str) -> dict[str, float]:
    parts = (item.strip().split("=") for item in header.split(","))
    return {name: float(value.removesuffix("ms")) for name, value in parts}


def test_stage_times_add_up_to_end_to_end_within_ten_percent(stack):
    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.api_url, timeout=60) as client:
            bodies = [
                {
                    "model": stack.model,
                    "prompt": f"breakdown {i} " * (1 + i % 7),
                    "max_tokens": 8 + i % 24,
                    "ignore_eos": True,
                }
                for i in range(24)
            ]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(load())
    assert {r.status_code for r in responses} == {200}
    for response in responses:
        timings = _parse(response.headers["x-tokenline-timings"])
        assert all(timings[s] > 0 for s in STAGES), timings
        parts = sum(timings[s] for s in STAGES)
        assert abs(parts - timings["e2e"]) <= 0.10 * timings["e2e"], timings
        assert timings["queue"] <= timings["scheduler"]


def test_every_stage_reports_its_latency_histogram(stack):
    for stage in STAGES:
        count = stack.metric(stage, "tokenline_stage_latency_seconds_count", stage=stage)
        assert count > 0, f"{stage} observed no request"
