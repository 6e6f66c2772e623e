"""The engine's step phases in process, in steady decode at fixed batch sizes.

Each batch size gets a fresh engine over one runner: that many requests of 20 prompt tokens are
added and decoded until every one is past its prompt, then ``--steps`` steps are timed from
``engine.last_step_times`` (median per phase).

    python benchmarks/engine_step_phases.py --model tiny --batches 1,16,256 --steps 150
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenline.model_source import resolve
from tokenline.protocol import SamplingParams
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions
from tokenline.scheduler.step_times import STEP_PHASES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batches", default="1,16,256")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()

    runner = ModelRunner(
        resolve(args.model),
        RunnerOptions(kv_cache_memory=256 * 2**20, torch_threads=args.torch_threads),
    )
    for batch in (int(b) for b in args.batches.split(",")):
        engine = Engine(runner, EngineLimits(2048, max(256, batch), 2048), [], True)
        sampling = SamplingParams(
            max_tokens=args.steps + 100, ignore_eos=True, temperature=args.temperature
        )
        for i in range(batch):
            engine.add(f"r{i}", [5 + (i * 7 + j) % 600 for j in range(20)], sampling)
        while (
            not all(s.num_computed > 20 for s in engine.policy.running)
            or len(engine.policy.running) < batch
        ):
            engine.step()
        spent = {phase: [] for phase in STEP_PHASES}
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
            for phase in STEP_PHASES:
                spent[phase].append(getattr(engine.last_step_times, phase))
        wall = (time.perf_counter() - started) / args.steps
        median = {phase: statistics.median(v) * 1e3 for phase, v in spent.items()}
        host = sum(v for phase, v in median.items() if phase != "forward")
        phases = " ".join(f"{phase} {v:.3f}" for phase, v in median.items())
        print(
            f"batch {batch:4d}: {phases} | host {host:.3f} ms, step {wall * 1e3:.3f} ms, "
            f"{batch / wall:,.0f} tokens/s"
        )
        del engine
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
