"""Where a token's time goes, read from a running stack's own timers.

For each load (``--concurrency``, one `tokenline bench` phase each) this scrapes every stage's
metrics before and after the phase and prints, from the differences:

- the engine step's phases (``tokenline_step_phase_seconds{phase}``: schedule, inputs,
  forward, sample, outputs), mean per step, and the mean batch (``tokenline_step_sequences``);
- each stage's CPU time per generated token (``process_cpu_seconds_total``, which every stage
  exports): what the api, tokenizer and detokenizer cost beside the engine.

The stack is `tokenline serve`'s (stage metrics on the api port + 1, 2, 3):

    tokenline serve --model /tmp/tiny-noeos --served-model-name tiny --port 8200 &
    python benchmarks/step_profile.py --stack-url http://127.0.0.1:8200 --concurrency 1 16 256
"""

from __future__ import annotations

import argparse
import asyncio
import urllib.request
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from tokenline.loadgen.config import BenchConfig, TargetConfig
from tokenline.loadgen.load import isolated_phase
from tokenline.loadgen.workload import LengthDist, build_workload
from tokenline.scheduler.step_times import STEP_PHASES
from tokenline.serve import metrics_port

STAGES = ("api", "tokenizer", "scheduler", "detokenizer")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page: {(name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metrics_urls(stack_url: str) -> dict[str, str]:
    parts = urlsplit(stack_url)
    urls = {"api": f"{stack_url.rstrip('/')}/metrics"}
    for stage in STAGES[1:]:
        urls[stage] = f"http://{parts.hostname}:{metrics_port(stage, parts.port)}/metrics"
    return urls


def snapshot(urls: dict[str, str]) -> dict[str, dict]:
    return {stage: scrape(url) for stage, url in urls.items()}


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def run_phase(config: BenchConfig, specs, concurrency: int) -> int:
    """One bench phase; the output tokens it got."""
    target = config.targets[0]
    phase = asyncio.run(
        isolated_phase(config, target, target.model, specs, concurrency=concurrency)
    )
    failed = [r for r in phase.records if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, first: {failed[0].error}")
    tokens = sum(r.output_tokens or 0 for r in phase.records)
    print(f"  {tokens / phase.duration:,.0f} output tokens/s over {phase.duration:.1f} s")
    return tokens


def report(before: dict, after: dict, tokens: int) -> None:
    sched_before, sched_after = before["scheduler"], after["scheduler"]
    steps = delta(sched_before, sched_after, "tokenline_step_sequences_count")
    sequences = delta(sched_before, sched_after, "tokenline_step_sequences_sum")
    if not steps:
        print("  no engine step ran")
        return
    print(f"  {steps:,.0f} steps, mean batch {sequences / steps:.1f} sequences")
    host = 0.0
    for phase in STEP_PHASES:
        spent = delta(sched_before, sched_after, "tokenline_step_phase_seconds_sum", phase=phase)
        if phase != "forward":
            host += spent
        print(f"  {phase:<9} {spent / steps * 1e3:8.3f} ms a step")
    print(f"  host work {host / steps * 1e3:.3f} ms a step (all but forward)")
    for stage in STAGES:
        cpu = delta(before[stage], after[stage], "process_cpu_seconds_total")
        print(f"  {stage:<11} {cpu / tokens * 1e3:8.3f} ms of CPU a generated token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack-url", required=True, help="a `tokenline serve` api URL")
    parser.add_argument("--model", default="tiny", help="the stack's served model name")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument(
        "--requests-per-stream", type=int, default=4, help="requests per concurrent stream"
    )
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    urls = metrics_urls(args.stack_url)
    lengths = LengthDist(args.prompt_words, args.prompt_words)
    output = LengthDist(args.output_len, args.output_len)
    for concurrency in args.concurrency:
        requests = max(concurrency * args.requests_per_stream, 8)
        # distinct prompts in every phase: nothing measured is served from the prefix cache
        specs = build_workload(requests, lengths, output, args.seed + concurrency)
        warmup = build_workload(8, lengths, output, args.seed + concurrency + 100_000)
        config = BenchConfig(
            targets=[TargetConfig("stack", args.stack_url, args.model)],
            num_requests=requests,
            concurrency=concurrency,
            prompt_len=lengths,
            output_len=output,
            seed=args.seed,
            warmup=0,
            progress=False,
        )
        run_phase(config, warmup, concurrency)  # not counted
        before = snapshot(urls)
        print(f"concurrency {concurrency}, {requests} requests x {args.output_len} tokens")
        tokens = run_phase(config, specs, concurrency)
        report(before, snapshot(urls), tokens)


if __name__ == "__main__":
    main()
