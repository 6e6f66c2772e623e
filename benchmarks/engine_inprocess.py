"""The engine alone, in one process, on the load `tokenline bench` sends to the stack.

Closed loop: ``--concurrency`` requests in flight; as one finishes the next is added. The
output tokens/s here is the ceiling the four-process stack is measured against (sockets and
HTTP should cost at most 10% of it). The prompts are `tokenline bench`'s own (the same seeded
words, tokenized by the model's tokenizer), so both see the same token counts.

    python benchmarks/engine_inprocess.py --model tiny --num-requests 48 --concurrency 16 \
        --prompt-words 32 --output-len 64

With ``--stack-url`` each in-process round is followed by one `tokenline bench` phase of the
same load against a running stack (same machine, idle while the engine runs), and each pair's
ratio is printed: on a machine whose speed drifts by tens of percent within a minute, only
pairs measured back to back say what the stack costs.

    tokenline serve --model /tmp/tiny-noeos --served-model-name tiny --port 8200 &
    python benchmarks/engine_inprocess.py --model /tmp/tiny-noeos --rounds 8 \
        --stack-url http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from tokenline.loadgen.config import BenchConfig, TargetConfig
from tokenline.loadgen.load import isolated_phase
from tokenline.loadgen.workload import LengthDist, build_workload
from tokenline.model_source import resolve
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine
from tokenline.scheduler.engine_limits import EngineLimits, default_token_budget
from tokenline.scheduler.runner import ModelRunner, RunnerOptions


def run_round(
    engine: Engine, prompts: list[list[int]], args: argparse.Namespace, round_: int
) -> float:
    """One closed-loop pass over ``prompts``; output tokens/s."""
    sampling = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight = 0
    tokens = 0
    started = time.perf_counter()
    delay = args.replace_after_ms / 1000
    due = [started] * args.concurrency  # when each free slot takes its next request
    while pending or in_flight:
        now = time.perf_counter()
        while due and due[0] <= now and pending:
            due.pop(0)
            i, prompt = pending.pop(0)
            engine.add(f"r{round_}-{i}", prompt, sampling)
            in_flight += 1
        if not in_flight:  # idle until the next replacement arrives
            time.sleep(max(0.0, due[0] - now))
            continue
        for out in engine.step():
            tokens += len(out.token_ids)
            if out.finish_reason:
                in_flight -= 1
                due.append(time.perf_counter() + delay)
    return tokens / (time.perf_counter() - started)


def stack_round(config: BenchConfig, specs) -> float:
    """One `tokenline bench` phase against the stack; output tokens/s."""
    target = config.targets[0]
    phase = asyncio.run(
        isolated_phase(config, target, target.model, specs, concurrency=config.concurrency)
    )
    failed = [r for r in phase.records if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests to the stack failed, first: {failed[0].error}")
    return sum(r.output_tokens or 0 for r in phase.records) / phase.duration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=32, help="as tokenline bench's")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="default: what the scheduler stage uses on this device",
    )
    parser.add_argument(
        "--replace-after-ms",
        type=float,
        default=0.0,
        help="time between a request finishing and its replacement arriving (0: before the "
        "next step; the stack's HTTP and socket round trip is about 5 ms)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="default: what the scheduler stage uses (every core but one)",
    )
    parser.add_argument(
        "--stack-url",
        help="a running stack serving the same model: alternate its rounds with ours",
    )
    parser.add_argument("--stack-model", default="tiny", help="the stack's served model name")
    args = parser.parse_args()

    source = resolve(args.model)
    runner = ModelRunner(source, RunnerOptions(torch_threads=args.torch_threads))
    budget = args.max_num_batched_tokens or default_token_budget(runner.device.type)
    limits = EngineLimits(source.max_model_len(), max_num_batched_tokens=budget)
    engine = Engine(runner, limits, source.eos_token_ids())
    lengths = LengthDist(args.prompt_words, args.prompt_words)
    output = LengthDist(args.output_len, args.output_len)
    specs = build_workload(args.num_requests, lengths, output, args.seed)
    tokenizer = source.load_tokenizer()
    prompts = [tokenizer(spec.prompt)["input_ids"] for spec in specs]
    config = BenchConfig(
        targets=[TargetConfig("stack", args.stack_url or "", args.stack_model)],
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        prompt_len=lengths,
        output_len=output,
        seed=args.seed,
        warmup=0,
        progress=False,
    )

    ours, stack = [], []
    for round_ in range(args.rounds + 1):  # the first round of each warms up
        ours.append(run_round(engine, prompts, args, round_))
        if args.stack_url:
            stack.append(stack_round(config, specs))
            print(
                f"round {round_}{' (warm-up)' if round_ == 0 else ''}: in process "
                f"{ours[-1]:.0f} tokens/s, stack {stack[-1]:.0f} tokens/s, "
                f"ratio {stack[-1] / ours[-1]:.2f}",
                flush=True,
            )
    result = {
        "output_tokens_per_s": round(statistics.mean(ours[1:]), 1),
        "rounds": [round(r, 1) for r in ours[1:]],
    }
    if args.stack_url:
        ratios = [s / o for s, o in zip(stack[1:], ours[1:], strict=True)]
        result |= {
            "stack_output_tokens_per_s": round(statistics.mean(stack[1:]), 1),
            "stack_rounds": [round(r, 1) for r in stack[1:]],
            "stack_ratio_median": round(statistics.median(ratios), 3),
            "stack_ratios": [round(r, 3) for r in ratios],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
