"""The engine's decode step with ``--compile`` against the eager one, in process.

``--mode compiled`` builds the runner with ``--compile``: on CPU every dense Llama-style layer
runs as one graph compiled by inductor with frozen weights (layers/compiled.py: inductor packs
the projections for oneDNN and fuses the norms, rotary, SiLU and residual adds; attention is an
opaque custom op). ``--mode eager`` runs the engine as it serves by default, over weights packed
for oneDNN. Both run decode steps over ``--batch`` sequences of 128-token prompts; the warm-up
includes the compilation.

    python benchmarks/compiled_forward_probe.py --model-dir /tmp/smollm2-shape --mode compiled
    python benchmarks/compiled_forward_probe.py --model-dir /tmp/smollm2-shape --mode compiled \\
        --cpp-wrapper
    python benchmarks/compiled_forward_probe.py --model-dir /tmp/smollm2-shape --mode eager
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cpp-wrapper", action="store_true", help="inductor's C++ wrapper")
    args = parser.parse_args()

    from tokenline.model_source import ModelSource
    from tokenline.protocol import SamplingParams
    from tokenline.scheduler import runner as runner_module
    from tokenline.scheduler.engine import Engine, EngineLimits

    if args.cpp_wrapper:
        torch._inductor.config.cpp_wrapper = True  # the generated code's calls made from C++
    runner = runner_module.ModelRunner(
        ModelSource(spec=args.model_dir, path=args.model_dir),
        runner_module.RunnerOptions(
            device="cpu",
            dtype="bfloat16",
            kv_cache_memory=2**30,
            torch_threads=args.torch_threads,
            compile_layers=args.mode == "compiled",
        ),
    )
    for batch in args.batch:
        limits = EngineLimits(4096, max_num_seqs=batch, max_num_batched_tokens=4096)
        engine = Engine(runner, limits, eos_ids=[], prefix_caching=False)
        rng = random.Random(batch)
        for i in range(batch):
            ids = [rng.randrange(runner.vocab_size) for _ in range(128)]
            engine.add(f"r{i}", ids, SamplingParams(max_tokens=10_000, temperature=0))
        with torch.inference_mode():
            start = time.perf_counter()
            for _ in range(8):  # the prefill, compilation, and a few decode steps
                engine.step()
            warm = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
        step_ms = (time.perf_counter() - start) / args.steps * 1e3
        print(f"{args.mode}, batch {batch}: {step_ms:.2f} ms a decode step (warm-up {warm:.1f} s)")
        for uid in engine.held_uids():
            engine.abort(uid)


if __name__ == "__main__":
    main()
