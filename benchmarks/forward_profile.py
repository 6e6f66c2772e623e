"""Where a decode step's time goes at a real model's shapes, in process, by torch's profiler.

The engine runs ``--batch`` prompts to their first token, takes a few decode steps to warm up,
then profiles ``--steps`` decode steps and prints the mean step time and the operators that
took it, grouped into what a step does (matmuls, attention, norms, rotary, the lm head,
sampling, the rest), then torch's own table of the top operators.

    python benchmarks/real_shapes.py --shape smollm2-135m --out /tmp/smollm2-shape
    python benchmarks/forward_profile.py --model-dir /tmp/smollm2-shape --dtype bfloat16 \\
        --batch 1 16
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch

# An operator's group by its name; the first match wins. The lm head is found by its output
# width (the vocabulary), not its name: it is a matmul like the others.
GROUPS = (
    ("attention", ("attention", "sdpa", "softmax", "bmm", "baddbmm", "flex")),
    ("matmul", ("linear", "mm", "addmm", "matmul", "mkldnn", "onednn")),
    ("norm", ("rms", "norm", "rsqrt", "pow", "mean", "var")),
    ("rotary", ("rotary", "rope", "cos", "sin")),
    ("sampling", ("argmax", "topk", "sort", "multinomial", "exponential", "softmax")),
    ("copy", ("copy", "cat", "index", "gather", "scatter", "contiguous", "clone", "to")),
    ("elementwise", ("mul", "add", "silu", "sub", "div", "neg", "where", "fill")),
)


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, needles in GROUPS:
        if any(needle in lowered for needle in needles):
            return group
    return "other"


def engine_for(runner, batch: int, prompt_len: int, vocab: int):
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.engine import Engine, EngineLimits

    limits = EngineLimits(4096, max_num_seqs=batch, max_num_batched_tokens=4096)
    engine = Engine(runner, limits, eos_ids=[], prefix_caching=False)
    rng = random.Random(batch)
    for i in range(batch):
        ids = [rng.randrange(vocab) for _ in range(prompt_len)]
        engine.add(f"r{i}", ids, SamplingParams(max_tokens=10_000, temperature=0))
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    from tokenline.model_source import ModelSource
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions

    runner = ModelRunner(
        ModelSource(spec=args.model_dir, path=args.model_dir),
        RunnerOptions(
            device="cpu",
            dtype=args.dtype,
            kv_cache_memory=2**30,
            torch_threads=args.torch_threads,
            compile_layers=args.compile,
            attention_backend=args.attention_backend,
        ),
    )
    lm_head_width = runner.vocab_size
    for batch in args.batch:
        engine = engine_for(runner, batch, args.prompt_len, lm_head_width)
        for _ in range(8):  # prefill every prompt, then a few decode steps
            engine.step()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step_ms = (time.perf_counter() - start) / args.steps * 1e3
        with torch.profiler.profile(record_shapes=True) as prof:
            for _ in range(args.steps):
                engine.step()
        groups: dict[str, float] = defaultdict(float)
        total = 0.0
        for event in prof.key_averages(group_by_input_shape=True):
            self_us = event.self_cpu_time_total
            total += self_us
            shapes = str(event.input_shapes)
            name = event.key
            if group_of(name) == "matmul" and str(lm_head_width) in shapes:
                groups["lm head"] += self_us
            else:
                groups[group_of(name)] += self_us
        print(
            f"\n== batch {batch}, {args.dtype}, {args.torch_threads} thread(s), "
            f"attention {args.attention_backend}{', compiled' if args.compile else ''}: "
            f"{step_ms:.2f} ms a decode step unprofiled"
        )
        for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {group:12s} {us / args.steps / 1e3:7.2f} ms  {100 * us / total:5.1f}%")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        for uid in engine.held_uids():
            engine.abort(uid)


if __name__ == "__main__":
    main()
