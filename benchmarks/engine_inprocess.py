"""The engine alone, in one process, on the load `tokenline bench` sends to the stack.

Closed loop: ``--concurrency`` requests in flight; as one finishes the next is added. The
output tokens/s here is the ceiling the four-process stack is measured against (sockets and
HTTP should cost at most 10% of it).

    python benchmarks/engine_inprocess.py --model tiny --num-requests 48 --concurrency 16 \
        --prompt-tokens 100 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import random
import time

from tokenline.model_source import resolve
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits, default_token_budget
from tokenline.scheduler.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
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
    args = parser.parse_args()

    source = resolve(args.model)
    runner = ModelRunner(source, torch_threads=args.torch_threads)
    budget = args.max_num_batched_tokens or default_token_budget(runner.device.type)
    limits = EngineLimits(source.max_model_len(), max_num_batched_tokens=budget)
    engine = Engine(runner, limits, source.eos_token_ids())
    rng = random.Random(0)
    vocab = runner.vocab_size
    results = []
    for _ in range(args.rounds + 1):  # the first round warms up
        prompts = [
            [rng.randrange(5, vocab) for _ in range(args.prompt_tokens)]
            for _ in range(args.num_requests)
        ]
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
                engine.add(f"r{i}", prompt, sampling)
                in_flight += 1
            if not in_flight:  # idle until the next replacement arrives
                time.sleep(max(0.0, due[0] - now))
                continue
            for out in engine.step():
                tokens += len(out.token_ids)
                if out.finish_reason:
                    in_flight -= 1
                    due.append(time.perf_counter() + delay)
        results.append(tokens / (time.perf_counter() - started))
    print(
        json.dumps(
            {
                "output_tokens_per_s": round(sum(results[1:]) / args.rounds, 1),
                "rounds": [round(r, 1) for r in results[1:]],
            }
        )
    )


if __name__ == "__main__":
    main()
