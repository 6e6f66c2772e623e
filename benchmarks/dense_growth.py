"""The dense decode rows' growth stalls at many streams, in process.

On CPU every decoding sequence keeps a dense row of its K/V (scheduler/attention/
decode_contexts.py) that doubles its columns when the longest context outgrows them; each
doubling copies what the rows hold into a new buffer inside one step, and every stream waits
for it. This runs ``--streams`` requests that decode together for ``--steps`` steps and
prints each growth (its time and the buffer's shape before and after), the step time's p50,
p99 and maximum, and the process's peak RSS.

    python benchmarks/dense_growth.py --model /tmp/tiny-noeos --streams 256 --steps 500
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from tokenline.model_source import resolve
from tokenline.protocol import SamplingParams
from tokenline.scheduler.attention.decode_contexts import DecodeContexts
from tokenline.scheduler.engine import Engine, EngineLimits
from tokenline.scheduler.runner import ModelRunner, RunnerOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    args = parser.parse_args()

    growths: list[tuple[float, tuple, tuple]] = []
    reserve = DecodeContexts._reserve

    def timed_reserve(self: DecodeContexts, rows: int, length: int) -> None:
        before, started = tuple(self.buffer.shape), time.perf_counter()
        reserve(self, rows, length)
        if tuple(self.buffer.shape) != before:
            growths.append((time.perf_counter() - started, before, tuple(self.buffer.shape)))

    DecodeContexts._reserve = timed_reserve
    runner = ModelRunner(
        resolve(args.model),
        RunnerOptions(kv_cache_memory=args.kv_cache_mib * 2**20, torch_threads=1),
    )
    engine = Engine(runner, EngineLimits(2048, max(256, args.streams), 2048), [], True)
    sampling = SamplingParams(max_tokens=args.steps + 100, ignore_eos=True, temperature=1.0)
    for i in range(args.streams):
        engine.add(f"r{i}", [5 + (i * 7 + j) % 600 for j in range(20)], sampling)
    steps = []
    for _ in range(args.steps):
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    for seconds, before, after in growths:
        print(f"growth {before} -> {after}: {seconds * 1e3:.1f} ms")
    steps.sort()
    p99 = steps[int(0.99 * (len(steps) - 1))]
    print(
        f"{args.streams} streams, {args.steps} steps: step p50 {statistics.median(steps) * 1e3:.1f}"
        f" ms, p99 {p99 * 1e3:.1f} ms, max {steps[-1] * 1e3:.1f} ms; peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )


if __name__ == "__main__":
    main()
