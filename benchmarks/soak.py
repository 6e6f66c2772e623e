"""Soak: sustained mixed traffic against `tokenline serve`, each stage's RSS sampled over time.

Not a test: it runs for minutes. It starts `tokenline serve --model tiny` (or targets a running
stack with ``--url`` and ``--pids``), sends the traffic of issue 34 from concurrent clients and
samples every stage's resident memory every ``--sample-interval`` seconds. Traffic per request,
drawn from a seeded generator:

- chat or completions, half each; streamed or not, half each; ``n: 2`` one in four;
- a JSON-schema ``response_format`` on half of them, half of those a schema never seen before
  (a new property name), the rest one of a few fixed schemas;
- function tools on one chat request in five;
- one stream in ten dropped by the client after its first chunk;
- one request in twenty malformed (bad JSON, an unknown field, an invalid schema).

The report (``--out`` DIR): ``samples.csv`` (time, requests, RSS per stage), ``report.json``
(the samples, counts by outcome, the gauges read at the end, the growth) and ``summary.txt``.
Growth is the least-squares slope of RSS against requests completed, over the samples after
``--warmup`` seconds, per 10,000 requests.

    .venv/bin/python benchmarks/soak.py --duration 720 --warmup 120 --out benchmarks/results/soak
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STAGES = ("api", "tokenizer", "scheduler", "detokenizer")
FIXED_SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}},
    {
        "type": "object",
        "properties": {"qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["qty"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
]
WORDS = "river mountain road old the stone light a blue far green north wind sea".split()


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=dict)
    completed: int = 0

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.completed += 1


def _schema(rng: random.Random, serial: int) -> dict:
    if rng.random() < 0.5:  # never seen before: every grammar cache misses
        name = f"field_{serial}_{rng.randrange(1 << 30):x}"
        return {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    return rng.choice(FIXED_SCHEMAS)


def make_request(rng: random.Random, serial: int, model: str) -> tuple[str, bytes, bool, bool]:
    """(path, body, stream, drop_after_first_chunk)."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    text = " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))
    body: dict = {"model": model, "max_tokens": rng.randint(4, 24), "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if rng.random() < 0.25:
        body["n"] = 2
    if rng.random() < 0.5:
        body["max_tokens"] = 48
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": _schema(rng, serial)},
        }
    elif chat and rng.random() < 0.2:
        body["tools"] = TOOLS
        body["tool_choice"] = rng.choice(["auto", "required"])
        body["max_tokens"] = 64
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(WORDS)]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(body).encode()
    malformed = rng.random()
    if malformed < 0.0167:
        raw = raw[: len(raw) // 2]  # not JSON
    elif malformed < 0.0333:
        body["no_such_field"] = 1
        raw = json.dumps(body).encode()
    elif malformed < 0.05:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bad", "schema": {"type": "object", "minProperties": "x"}},
        }
        raw = json.dumps(body).encode()
    drop = stream and rng.random() < 0.1
    return path, raw, stream, drop


async def one_request(
    client: httpx.AsyncClient, path: str, raw: bytes, stream: bool, drop: bool, hang_s: float
) -> str:
    headers = {"content-type": "application/json"}
    try:
        async with asyncio.timeout(hang_s):
            if not stream:
                response = await client.post(path, content=raw, headers=headers)
                return str(response.status_code)
            async with client.stream("POST", path, content=raw, headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    return str(response.status_code)
                async for line in response.aiter_lines():
                    if drop and line.startswith("data:"):
                        return "dropped"  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        return "200"
                return "200-no-done"
    except TimeoutError:
        return "hung"
    except httpx.HTTPError as exc:
        return f"transport:{type(exc).__name__}"


async def client_loop(
    url: str, seed: int, model: str, stop_at: float, tally: Tally, hang_s: float
) -> None:
    rng = random.Random(seed)
    serial = 0
    limits = httpx.Limits(max_connections=4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        while time.monotonic() < stop_at:
            serial += 1
            path, raw, stream, drop = make_request(rng, seed * 10_000_000 + serial, model)
            tally.count(await one_request(client, path, raw, stream, drop, hang_s))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def stage_pids(serve_pid: int) -> dict[str, int]:
    """The stages `tokenline serve` started, found by their command lines."""
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if ppid != serve_pid:
            continue
        for stage in STAGES:
            if stage.encode() in argv:
                found[stage] = int(entry)
    return found


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError as exc:
        return f"# unreachable: {exc}"


def gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line)
        if match and match.group(1) in names:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def slope_per_10k(points: list[tuple[float, float]]) -> float | None:
    """Least-squares MiB per 10,000 requests over (requests, MiB) points."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return sxy / sxx * 10_000


def free_port_block(count: int = 4) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free block of ports")


def wait_ready(url: str, timeout: float, serve: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise RuntimeError(f"tokenline serve exited with {serve.returncode}; see serve.log")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become ready in {timeout:.0f}s")


async def soak(args: argparse.Namespace, url: str, pids: dict[str, int], out: Path) -> dict:
    tally = Tally()
    started = time.monotonic()
    stop_at = started + args.duration
    clients = [
        asyncio.create_task(
            client_loop(url, args.seed + i, args.model_name, stop_at, tally, args.hang_timeout)
        )
        for i in range(args.concurrency)
    ]
    samples = []
    with open(out / "samples.csv", "w", newline="") as f:  # noqa: ASYNC230 (tiny writes)
        writer = csv.writer(f)
        writer.writerow(["seconds", "requests", *[f"{s}_rss_mib" for s in STAGES]])
        while True:
            row = {"seconds": round(time.monotonic() - started, 1), "requests": tally.completed}
            row.update({s: round(rss_mib(pid), 2) for s, pid in pids.items()})
            samples.append(row)
            writer.writerow([row["seconds"], row["requests"], *[row.get(s) for s in STAGES]])
            f.flush()
            print(json.dumps(row), flush=True)
            if time.monotonic() >= stop_at:
                break
            await asyncio.sleep(min(args.sample_interval, max(0.0, stop_at - time.monotonic())))
    await asyncio.gather(*clients)
    await asyncio.sleep(args.settle)  # the last aborts travel the ring; sweeps run
    final = {"seconds": round(time.monotonic() - started, 1), "requests": tally.completed}
    final.update({s: round(rss_mib(pid), 2) for s, pid in pids.items()})
    names = ("tokenline_live_uids", "tokenline_leaked_uids", "tokenline_cache_entries")
    port = int(url.rsplit(":", 1)[1])
    metrics = {"api": gauges(scrape(f"{url}/metrics"), names)}
    for offset, stage in enumerate(("tokenizer", "scheduler", "detokenizer"), start=1):
        metrics[stage] = gauges(scrape(f"http://127.0.0.1:{port + offset}/metrics"), names)
    after = [s for s in samples if s["seconds"] >= args.warmup]
    growth = {}
    for stage in pids:
        first, last = after[0] if after else None, after[-1] if after else None
        growth[stage] = {
            "rss_at_warmup_mib": first and first[stage],
            "rss_at_end_mib": last and last[stage],
            "mib_per_10k_requests": slope_per_10k([(s["requests"], s[stage]) for s in after]),
        }
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "requests": tally.completed,
        "outcomes": tally.outcomes,
        "http_5xx": sum(v for k, v in tally.outcomes.items() if k.startswith("5")),
        "hung": tally.outcomes.get("hung", 0),
        "leaked_uids": sum(v for m in metrics.values() for k, v in m.items() if "leaked_uids" in k),
        "live_uids_after": sum(
            v for m in metrics.values() for k, v in m.items() if "live_uids" in k
        ),
        "growth": growth,
        "gauges_at_end": metrics,
        "samples": samples,
        # after the traffic stopped: the scheduler gives its decode rows back when idle, so
        # this sample is not comparable with the loaded ones and stays out of the slope
        "idle_after": final,
    }


def summary(report: dict) -> str:
    lines = [
        f"requests {report['requests']}  5xx {report['http_5xx']}  hung {report['hung']}  "
        f"leaked uids {report['leaked_uids']:.0f}  live uids after {report['live_uids_after']:.0f}",
        f"outcomes {json.dumps(report['outcomes'], sort_keys=True)}",
        f"after {report['args']['warmup']:.0f}s warm-up:",
        "stage        RSS at warm-up  RSS at end  MiB per 10,000 requests",
    ]
    for stage, g in report["growth"].items():
        slope = g["mib_per_10k_requests"]
        lines.append(
            f"{stage:<12} {g['rss_at_warmup_mib']:>10.1f} MiB {g['rss_at_end_mib']:>7.1f} MiB "
            f"{'n/a' if slope is None else f'{slope:+.2f}':>12}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=720.0, help="seconds of traffic")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds left out of growth")
    parser.add_argument("--sample-interval", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--hang-timeout", type=float, default=60.0, help="a request past it hung")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before the gauges")
    parser.add_argument("--model-name", default="tiny")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    parser.add_argument("--url", help="a running stack's api (with --pids) instead of starting one")
    parser.add_argument("--pids", help="api,tokenizer,scheduler,detokenizer pids for --url")
    parser.add_argument("serve_args", nargs="*", help="extra `tokenline serve` flags (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    serve = None
    if args.url:
        url = args.url.rstrip("/")
        pids = dict(zip(STAGES, (int(p) for p in args.pids.split(",")), strict=True))
    else:
        port = free_port_block()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "tokenline.cli", "serve", "--model", "tiny"]
        argv += ["--port", str(port), "--log-level", "warning", *args.serve_args]
        log = open(args.out / "serve.log", "w")
        serve = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_ready(url, 300, serve)
        pids = stage_pids(serve.pid)
        if set(pids) != set(STAGES):
            serve.terminate()
            raise RuntimeError(f"found stages {pids}, not all four")
    try:
        report = asyncio.run(soak(args, url, pids, args.out))
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    text = summary(report)
    (args.out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
