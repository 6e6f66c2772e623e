"""How a closed-loop load's forward time splits between prefill and decode, in process.

``--streams`` prompts of ``--prompt-len`` random tokens are admitted at once under the CPU's
default step budget; the steps until every prompt is read are the prefill phase (their later
steps also carry the first prompts' decode rows, as in the stack), then ``--steps`` decode
steps of every stream are timed. With a stack run's token counts (``tokenline bench``'s
output and prompt tokens) this says how much of its time each side takes, and what a decode
step would have to cost for a given tokens/s.

    python benchmarks/real_shapes.py --shape smollm2-135m --out /tmp/smollm2-shape
    python benchmarks/prefill_decode_split.py --model-dir /tmp/smollm2-shape --prompt-len 91
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=91)
    parser.add_argument("--budget", type=int, default=128, help="tokens a step (CPU default)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from tokenline.model_source import ModelSource
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler.engine import Engine, EngineLimits
    from tokenline.scheduler.runner import ModelRunner, RunnerOptions

    source = ModelSource(spec=args.model_dir, path=args.model_dir)
    options = RunnerOptions(device="cpu", dtype=args.dtype, kv_cache_memory=2**30)
    runner = ModelRunner(source, options)
    print(f"{args.dtype}, {torch.get_num_threads()} torch threads")
    for repeat in range(args.repeats):
        limits = EngineLimits(4096, max_num_seqs=args.streams, max_num_batched_tokens=args.budget)
        engine = Engine(runner, limits, eos_ids=[], prefix_caching=False)
        rng = random.Random(repeat)
        for i in range(args.streams):
            ids = [rng.randrange(runner.vocab_size) for _ in range(args.prompt_len)]
            engine.add(f"r{repeat}-{i}", ids, SamplingParams(max_tokens=10**6, temperature=0))
        with torch.inference_mode():
            start, steps = time.perf_counter(), 0
            while engine.policy.waiting or any(
                seq.num_computed < args.prompt_len for seq in engine.policy.running
            ):
                engine.step()
                steps += 1
            prefill_s = time.perf_counter() - start
            for _ in range(3):
                engine.step()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            decode_s = (time.perf_counter() - start) / args.steps
        prompt_tokens = args.streams * args.prompt_len
        print(
            f"repeat {repeat}: {prompt_tokens} prompt tokens in {steps} steps, {prefill_s:.2f} s "
            f"({prompt_tokens / prefill_s:.0f} prompt tokens/s); a decode step of "
            f"{args.streams} streams {decode_s * 1e3:.1f} ms"
        )
        for uid in engine.held_uids():
            engine.abort(uid)


if __name__ == "__main__":
    main()
